"""The prompts command's Magpie run: the target loaded, the conversations generated in one process or on every rank
(each writing its share as a shard, rank 0 merging), selected and written with a summary; and a built-in source
written to a file. `recipes.prompts` parses and checks the flags; the generation is `data.magpie`."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_dflash.recipes._cli import fail, user_errors

if TYPE_CHECKING:
    from nemo_dflash.engine.sampling import SamplingParams

logger = logging.getLogger("nemo_dflash.prompts")


def write_builtin(source: str, out: Path) -> dict[str, Any]:
    """Write the prompts of the built-in ``source`` to ``out``."""
    from nemo_dflash.data import BadRecordCounter, DataError
    from nemo_dflash.data.prompts import parse_source, read_source, write_prompts

    with user_errors(DataError, OSError):
        spec = parse_source(source)
        if spec.builtin == "sharegpt" or (spec.builtin is None and not os.path.isdir(spec.what)):
            raise DataError(f"--source {source!r}: give chitchat, gsm_symbolic[:COUNT], code[:COUNT], "
                            "code_stdlib[+KINDS][:COUNT], code_site[+KINDS][:COUNT] or a folder of Python source")
        _, convs = read_source(spec, BadRecordCounter())
        out.parent.mkdir(parents=True, exist_ok=True)
        n = write_prompts(str(out), convs)
    logger.info("wrote %d %s prompts to %s", n, spec.name, out)
    return {"out": str(out), "written": n}


def shard_path(out: Path, rank: int, world: int) -> Path:
    """Where rank ``rank`` of ``world`` writes its Magpie conversations for rank 0 to merge (temporary)."""
    return out.with_name(f"{out.name}.rank{rank}-of-{world}.magpie.jsonl")


def run_magpie(args: argparse.Namespace, out: Path, counts: dict[str, int], turns: tuple[int, int],
               sampling: SamplingParams, device: str, dtype: str, rank: int, world: int,
               local_rank: int) -> dict[str, Any]:
    """The Magpie prompts in one process, or this rank's share under torchrun (a gloo group for the barriers
    alone: the ranks exchange files, not tensors), each rank on its own GPU."""
    if world == 1:
        return _magpie(args, out, counts, turns, sampling, device, dtype)
    import datetime

    import torch.distributed as dist

    from nemo_dflash.train.distributed import init_process_group

    own_group = not dist.is_initialized()
    if own_group:  # only for barriers: the ranks exchange files, not tensors
        init_process_group("gloo", datetime.timedelta(days=7))
    if device == "cuda":
        import torch

        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    try:
        return _magpie(args, out, counts, turns, sampling, device, dtype, rank=rank, world=world)
    finally:
        if own_group:
            dist.destroy_process_group()


def _magpie(args: argparse.Namespace, out: Path, counts: dict[str, int], turns: tuple[int, int],
            sampling: SamplingParams, device: str, dtype: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Load the target and write the Magpie prompts: in one process, or this rank's share (rank 0 merging)."""
    from nemo_dflash.data import DataError
    from nemo_dflash.data.prompts import magpie_generate, magpie_prompts, write_magpie_shard
    from nemo_dflash.target.loading import load_target

    try:
        model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    except (FileNotFoundError, OSError, ValueError) as e:
        fail(f"cannot load --target {args.target}: {e}")
    if not getattr(tokenizer, "chat_template", None):
        fail(f"the tokenizer of {args.target} has no chat template; Magpie prompts need the instruct model")
    if args.batch_size == "auto":
        from nemo_dflash.engine.plain import auto_rows, max_rows
        from nemo_dflash.data.prompts import MAGPIE_TOPICS, magpie_max_prompt, magpie_prefix

        with user_errors(DataError):
            longest = max(len(magpie_prefix(tokenizer, MAGPIE_TOPICS[t])) for t in counts)
        # a row holds a whole conversation: its longest prompt (every earlier turn) plus a turn (the larger cap)
        longest = magpie_max_prompt(longest, turns[1], args.max_new_tokens, args.user_max_new_tokens)
        cap = max(args.max_new_tokens, args.user_max_new_tokens or args.max_new_tokens)
        args.batch_size = auto_rows(max_rows(model, longest, cap))
        logger.info("--batch-size auto: %d prompts in flight", args.batch_size)
    kw = dict(seed=args.seed, max_new_tokens=args.max_new_tokens, user_max_new_tokens=args.user_max_new_tokens,
              batch_size=args.batch_size, sampling=sampling,
              oversample=args.oversample, turns=turns)
    topic_report: dict[str, dict[str, Any]] = {}
    if world == 1:
        with user_errors(DataError, ValueError):
            convs = magpie_prompts(model, tokenizer, counts, report=topic_report, **kw)
        return _write_magpie(out, convs, counts, topic_report)
    import torch.distributed as dist

    with user_errors(DataError, ValueError):
        mine = magpie_generate(model, tokenizer, counts, rank=rank, world=world, **kw)
    with user_errors(OSError):  # a full disk: one line; the shards are written again on the rerun
        write_magpie_shard(shard_path(out, rank, world), mine)
    logger.info("rank %d of %d: %d conversations (%d user turns wanted) in %s", rank, world, len(mine),
                sum(c.turns for c in mine), shard_path(out, rank, world))
    dist.barrier()  # every rank's shard is written
    if rank != 0:
        dist.barrier()  # rank 0 has written --out
        return {"out": str(out), "rank": rank, "generated": len(mine)}
    try:
        return _merge_shards(args, out, counts, turns, world, topic_report)
    finally:
        dist.barrier()  # the other ranks end once --out is written (or rank 0 failed)


def _merge_shards(args: argparse.Namespace, out: Path, counts: dict[str, int], turns: tuple[int, int], world: int,
                  topic_report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: every rank's conversations in their global order, selected and written like one process's."""
    from nemo_dflash.data import DataError
    from nemo_dflash.data.prompts import magpie_merge, magpie_plan, magpie_select, read_magpie_shard

    paths = [shard_path(out, r, world) for r in range(world)]
    try:
        with user_errors(DataError, OSError):
            total = len(magpie_plan(counts, seed=args.seed, oversample=args.oversample, turns=turns))
            merged = magpie_merge((read_magpie_shard(p) for p in paths), total)
    finally:  # temporary: a rerun writes them again
        for p in paths:
            p.unlink(missing_ok=True)
    convs = magpie_select(merged, counts, report=topic_report)
    return _write_magpie(out, convs, counts, topic_report)


def _write_magpie(out: Path, convs: list[Any], counts: dict[str, int],
                  topic_report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write the selected conversations (every topic empty: refused, exit 2) and summarise them."""
    from nemo_dflash.data.prompts import write_prompts

    by_topic = {t: sum(c.location.startswith(f"magpie-{t}:") for c in convs) for t in counts}
    if not convs:
        fail(f"Magpie topic(s) {', '.join(counts)}: every sampled prompt was dropped by the filters (empty, too short "
             "or long, duplicate, looping or capped); raise --max-new-tokens (or --user-max-new-tokens, the user turns' "
             "own cap) or check the target's chat template")
    empty = [t for t, n in by_topic.items() if n == 0]
    short = [t for t, n in by_topic.items() if 0 < n < counts[t]]
    if empty:  # written as they are: a topic is never padded from another
        logger.warning("Magpie topics %s: the target wrote no usable prompt (degenerate); the summary's topic_report "
                       "says why", ", ".join(empty))
    if short:
        logger.warning("Magpie topics %s: fewer conversations than asked; the summary's topic_report says why",
                       ", ".join(short))
    n = write_prompts(str(out), convs)
    logger.info("wrote %d conversations to %s (%s)", n, out, ", ".join(f"{t} {k}" for t, k in by_topic.items()))
    return {"out": str(out), "written": n, "topics": by_topic, "degenerate_topics": empty, "short_topics": short,
            "topic_report": topic_report}
