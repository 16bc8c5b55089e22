"""What an evaluation checks before any model loads: the counts that size a decode against the two models'
config.json files (read as files), and the decode mode on the device. A mistake found here costs nothing; found
after the load, it cost minutes (or a decode that runs for months)."""

from __future__ import annotations

import json
from typing import Optional


def check_fits_models(target: str, draft: str, max_new_tokens: Optional[int], block_size: Optional[int]) -> None:
    """``max_new_tokens`` within the target's context (a decode past it runs for months), ``block_size`` within the
    draft's trained block (each position a row of every attention: 100,000 of them take tens of GB); ValueError
    (one line, naming the flag) otherwise."""
    from nemo_dflash.target.loading import target_context

    context = target_context(str(target))
    if max_new_tokens is not None and context is not None and max_new_tokens > context:
        raise ValueError(f"--max-new-tokens {max_new_tokens} exceeds the target's context ({context} positions, "
                         "its config.json's max_position_embeddings): give at most that")
    if block_size is not None:
        trained = draft_block_size(str(draft))
        if trained is not None and block_size > trained:
            raise ValueError(f"--block-size {block_size} is larger than the {trained} the draft was trained "
                             f"for: give 1 to {trained}, or leave it out for {trained}")


def draft_block_size(draft: str) -> Optional[int]:
    """The block size the draft's config.json records, None when it cannot be read here (the load checks)."""
    from nemo_dflash.draft.build import DraftError, resolve_draft_dir

    try:
        raw = json.loads((resolve_draft_dir(draft) / "config.json").read_text())
    except (OSError, ValueError, DraftError):
        return None
    value = raw.get("block_size", (raw.get("dflash_config") or {}).get("block_size")) if isinstance(raw, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def check_decode(decode: str, device: str) -> None:
    """The decoder's own check of a decode mode on this device, before any model loads."""
    import torch

    import nemo_dflash.engine.spec_decode as inference

    check = getattr(inference, "check_decode_mode", None)
    if check is not None:
        check(decode, torch.device(device))
    elif decode != "eager":
        raise ValueError(f"--decode {decode} is not available in this install: use --decode eager")
