"""`regenerate`'s target: the process group and device of a rank, the target loaded (or the server standing in
for it), and the prompt cap and answers in flight fitted to its context and to the GPU's free memory.

Kept apart from `recipes/regenerate.py`, which only runs the steps; each refusal is one line naming its fix.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Optional

from nemo_dflash.recipes._cli import fail

logger = logging.getLogger("nemo_dflash.regenerate")


def join_ranks(device: str, local_rank: int, world: int, group: bool) -> str:
    """Start the process group (only for the ranks' barriers and shared queue: they exchange files, not
    tensors) and pin this rank's GPU; the device this rank runs on."""
    if group:
        import datetime

        from nemo_dflash.train.distributed import init_process_group

        init_process_group("gloo", datetime.timedelta(days=7))
    if device == "cuda" and world > 1:
        import torch

        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return device


def load_model(args: argparse.Namespace, server: Optional[tuple[Any, Any]], device: str,
               dtype: str) -> tuple[Any, Any]:
    """(the target, its tokenizer): loaded here, or the server standing in for it (``--backend openai``: the
    target's tokenizer and config only). A tokenizer without a chat template is refused."""
    if server is not None:
        from nemo_dflash.recipes._regen_server import server_target

        model, tokenizer = server_target(args, *server)
    else:
        from nemo_dflash.target.loading import load_target

        logger.info("loading target %s (%s, %s)", args.target, device, dtype)
        try:
            model, tokenizer = load_target(args.target, dtype=dtype, device=device)
        except (FileNotFoundError, OSError, ValueError) as e:
            fail(f"cannot load --target {args.target}: {e}")
    if not getattr(tokenizer, "chat_template", None):
        fail(f"the tokenizer of {args.target} has no chat template; regeneration prompts the target with its own "
             "template: point --target at the instruct model")
    return model, tokenizer


def fit_model(args: argparse.Namespace, model: Any, served: bool) -> Optional[int]:
    """The prompt cap (``--max-prompt-tokens``, default the context minus ``--max-new-tokens``), checked
    against the model's context; ``args.batch_size`` set to the answers in flight (the server's requests, or
    what the GPU's free memory holds for ``auto``) and checked to fit."""
    max_prompt = args.max_prompt_tokens
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:
        if args.max_new_tokens >= context:
            fail(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's context of "
                 f"{context} tokens: give at most {context - 1}")
        if max_prompt is None:
            max_prompt = context - args.max_new_tokens
        if max_prompt + args.max_new_tokens > context:
            fail(f"--max-prompt-tokens {max_prompt} + --max-new-tokens {args.max_new_tokens} exceeds the model's "
                 f"context of {context} tokens; lower one of them")
    if served:
        args.batch_size = args.concurrency  # answers in flight: the server's requests
        return max_prompt
    from nemo_dflash.engine.plain import auto_rows, max_rows

    rows_fit = args.engine == "continuous" and max_prompt is not None  # the engine's rows: a KV cache each
    fit = max_rows(model, max_prompt, args.max_new_tokens) if rows_fit else None
    if args.batch_size == "auto":
        args.batch_size = auto_rows(fit)
        logger.info("--batch-size auto: %d answers in flight%s", args.batch_size,
                    f" ({fit} fit in the GPU's free memory)" if fit is not None else "")
    elif fit is not None and args.batch_size > fit:
        fail(f"--batch-size {args.batch_size}: the KV cache of only {fit} answers fits in the GPU's free memory; "
             "lower it, or pass --batch-size auto")
    return max_prompt
