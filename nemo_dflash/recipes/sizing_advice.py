"""The plan-time sizing warning: a run whose training budget is below the tokens that the closest measured
target's draft needed to pay gets one WARNING line before anything loads. Never a refusal: the measurements
are of other targets and other data, so they advise.

The measurements are `sizing.json` beside this file: the rows `benchmarks/sizing.py` writes from
docs/bench/ (the same rows as docs/bench/sizing.json, shown in docs/train.md "What budget pays"). A JSON file
written by the script, not a table in this module, so that one command regenerates both copies and a test
checks that they are the same.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from nemo_dflash.config import RecipeConfig

logger = logging.getLogger(__name__)

SIZING_FILE = Path(__file__).with_name("sizing.json")
DOCS = "docs/train.md, 'What budget pays'"


def load_rows(path: Path = SIZING_FILE) -> list[dict[str, Any]]:
    """The measured targets that have a paying draft; [] when the file is missing or unreadable."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("tokens_to_speedup_1") and r.get("hidden_size")
            and r.get("num_hidden_layers")]


def tokens_text(n: float) -> str:
    """A token count as the warning prints it: millions, or the count itself below 0.1 M."""
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{int(n):,}"


def rate_text(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:g}"


def tokens_per_step(cfg: RecipeConfig, world: int) -> int:
    """Token slots one optimizer step trains on: micro batch x row length x grad accumulation x ranks. A row
    is data.pack_length tokens when packed, at most data.max_length when not (padding fills the rest)."""
    row = cfg.data.pack_length or cfg.data.max_length
    return cfg.train.micro_batch_size * row * cfg.train.grad_accum * max(world, 1)


def planned_tokens(cfg: RecipeConfig, world: int, tokens_per_s: Optional[float]) -> Optional[tuple[int, str]]:
    """The most tokens the recipe's caps let training see, and how that was counted; None when only
    train.epochs bounds it (the data's size is known only after regeneration)."""
    found: list[tuple[int, str]] = []
    per = tokens_per_step(cfg, world)
    if cfg.train.max_steps:
        found.append((cfg.train.max_steps * per, f"train.max_steps {cfg.train.max_steps} x {per:,} tokens a step"))
    if cfg.train.max_minutes is not None and tokens_per_s:  # the cap is checked after a step: one at least
        n = max(int(cfg.train.max_minutes * 60 * tokens_per_s * max(world, 1)), per)
        found.append((n, f"train.max_minutes {cfg.train.max_minutes:g} x {rate_text(tokens_per_s)} tokens/s a GPU "
                         f"x {max(world, 1)} GPU(s)"))
    return min(found) if found else None


def _gguf_dims(path: str) -> Optional[dict[str, int]]:
    """Layers, width and vocabulary from a GGUF file's header (memory-mapped: no weights are read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        fields = reader.fields

        def scalar(key: str) -> Optional[int]:
            f = fields.get(key)
            return int(f.parts[f.data[0]][0]) if f is not None else None

        arch = bytes(fields["general.architecture"].parts[-1]).decode()
        tokens = fields.get("tokenizer.ggml.tokens")
        dims = {"num_hidden_layers": scalar(f"{arch}.block_count"), "hidden_size": scalar(f"{arch}.embedding_length"),
                "vocab_size": len(tokens.data) if tokens is not None else None}
    except Exception:  # noqa: BLE001 - any unreadable header: the advice is skipped, the load reports the file
        return None
    return {k: v for k, v in dims.items() if v}


def target_dims(path: str) -> Optional[dict[str, int]]:
    """The target's layers, width and vocabulary, read as files before any load (config.json, or a GGUF's
    header); None when neither can be read here."""
    from nemo_dflash.target.loading import resolve_target_path, target_text_config

    config = target_text_config(path)
    if config is None:
        try:
            resolved = resolve_target_path(path)
        except FileNotFoundError:
            return None
        return _gguf_dims(resolved) if resolved.endswith(".gguf") and Path(resolved).is_file() else None
    dims = {k: config.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    if not isinstance(dims["num_hidden_layers"], int) or not isinstance(dims["hidden_size"], int):
        return None
    return {k: int(v) for k, v in dims.items() if isinstance(v, int)}


def approx_params(dims: dict[str, Any]) -> float:
    """Parameters of a dense decoder of these dimensions: 12 L H^2 for the layers, V H for the embedding."""
    return 12 * dims["num_hidden_layers"] * dims["hidden_size"] ** 2 + (dims.get("vocab_size") or 0) * dims["hidden_size"]


def closest(rows: list[dict[str, Any]], dims: dict[str, int]) -> dict[str, Any]:
    """The measured target nearest in size (ratio of approximate parameter counts)."""
    size = approx_params(dims)
    return min(rows, key=lambda r: abs(math.log(approx_params(r) / size)))


def sizing_warning(cfg: RecipeConfig, world: int, rows: Optional[list[dict[str, Any]]] = None,
                   dims: Optional[dict[str, int]] = None) -> Optional[str]:
    """The warning's text when the planned training tokens are below a paying draft's; None otherwise."""
    rows = load_rows() if rows is None else rows
    if not rows:
        return None
    by_path = {r.get("target_path"): r for r in rows}
    if dims is None:
        dims = target_dims(cfg.target.path)
    if dims is None and cfg.target.path not in by_path:
        logger.debug("sizing advice skipped: the target's config cannot be read before it loads")
        return None
    row = by_path[cfg.target.path] if dims is None else closest(rows, dims)
    planned = planned_tokens(cfg, world, row.get("train_tokens_per_s"))
    need = int(row["tokens_to_speedup_1"])
    if planned is None or planned[0] >= need:
        return None
    tokens, how = planned
    minutes = row.get("minutes_per_gpu_to_speedup_1")
    ratio = approx_params(dims) / approx_params(row) if dims is not None else 1.0
    size = f"; this target is about {ratio:.1f}x its size" if not 0.5 <= ratio <= 2 else ""
    return (f"this run trains on at most {tokens_text(tokens)} tokens ({how}); the closest measured target, "
            f"{row['target']} ({row['num_hidden_layers']} layers x {row['hidden_size']}{size}), first had a draft that pays "
            f"(T=0 speedup >= 1.0 at batch 1) at {tokens_text(need)} training tokens"
            + (f", about {minutes:.0f} minutes of one GPU to regenerate and train" if minutes else "")
            + f" ({DOCS}): a smaller budget gives a draft that may slow its target down")


def warn_small_budget(cfg: RecipeConfig, world: int) -> None:
    """Log the sizing warning, if any: one line, at plan time."""
    message = sizing_warning(cfg, world)
    if message:
        logger.warning("%s", message)
