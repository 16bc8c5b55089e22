r"""Write a prompt file for `regenerate --data NAME=FILE`: prompts the target writes itself (Magpie).

    python -m nemo_dflash.recipes.prompts --target pkg:smollm2 --out data/magpie.jsonl \
        --topics chat=40000,code=30000,math=30000,reading=10000 --turns 2-6 --batch-size 1024

The target gets its chat template up to the user header, after a system prompt that steers the
topic (chat, code, math, reading: answer from a passage, formatting: follow formatting
instructions, explain_code: `nemo_dflash.data.prompts.MAGPIE_TOPICS`), and samples the user turn
(Magpie, arXiv 2406.08464). With --turns MIN-MAX it then answers that turn and writes the next
user turn (the template up to the next user header), for a seeded number of user turns in the
range. Empty, duplicate, too short, too long, looping or capped first turns are dropped; a later
turn that fails ends its conversation at the last good user turn. --max-new-tokens caps every turn;
--user-max-new-tokens gives the user turns their own cap (answers are context only: regenerate
answers every user turn again, so they may stay short while user turns run long). A topic left short of its
count is reported (log and summary), never padded from another. Writes OpenAI-layout JSONL:
    {"messages": [{"role": "system", ...}, {"role": "user", ...}, ...], "id": "magpie-code:17"}
then `regenerate --data magpie=data/magpie.jsonl --turns all` answers every user turn (its
decontamination drops any that overlap the evaluation prompts).

    python -m nemo_dflash.recipes.prompts --source gsm_symbolic:20000 --out data/gsm.jsonl

writes a built-in source's prompts (chitchat, gsm_symbolic[:COUNT], code[:COUNT], code_stdlib[+KINDS][:COUNT],
code_site[+KINDS][:COUNT] (installed libraries, evaluation packages left out), or a folder of Python source:
code prompts from its documented functions, read without importing it; KINDS: +explain, +test, +fix, +humaneval
or +all) to a file instead, without a model: build them once on any machine and carry the file to the GPU one.
A source left with no prompts by the filters is refused (exit 2), naming it.

    torchrun --nproc-per-node 4 -m nemo_dflash.recipes.prompts --target pkg:smollm2 --out data/magpie.jsonl ...

runs Magpie on every rank, each with the target on its own GPU (cuda:LOCAL_RANK) and --batch-size
prompts in flight: each generates its share of the conversations and writes it to
OUT.rankR-of-W.magpie.jsonl; rank 0 then merges the shares in their global order, filters and
writes --out, byte-identical to one process with the same seed, and removes the shards. A --source
job runs on rank 0 alone.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from nemo_dflash.files import Output, OutputError, guard_outputs
from nemo_dflash.config import PromptJobConfig
from nemo_dflash.recipes._cli import (
    add_device_args, count_or_auto, fail, resolve_device_dtype, section_defaults, set_threads, setup_logging,
    user_errors,
)

if TYPE_CHECKING:
    from nemo_dflash.engine.sampling import SamplingParams

logger = logging.getLogger("nemo_dflash.prompts")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="the aligned target: local HF dir, .gguf file or pkg:smollm2")
    p.add_argument("--source",
                   help="write this built-in source's prompts instead (chitchat, gsm_symbolic[:COUNT], code[:COUNT], "
                        "code_stdlib[+KINDS][:COUNT], code_site[+KINDS][:COUNT], or a folder of Python source; "
                        "no model)")
    p.add_argument("--out", required=True, help="output FILE.jsonl")
    p.add_argument("--topics",
                   help="TOPIC=COUNT,... conversations per topic (topics: chat, code, math, reading, formatting, "
                        "explain_code)")
    p.add_argument("--turns",
                   help="user turns per conversation: N or MIN-MAX (e.g. 2-6), drawn per conversation (seeded)")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--max-new-tokens", type=int,
                   help="cap on a turn's tokens: a capped user turn is dropped, a capped answer kept cut (it is "
                        "context only: regenerate answers again)")
    p.add_argument("--user-max-new-tokens", type=int,
                   help="the user turns' own cap (default: --max-new-tokens), e.g. 512 with --max-new-tokens 256: "
                        "long user turns, short answers")
    p.add_argument("--batch-size", type=count_or_auto,
                   help="prompts in flight; auto: as many as the GPU's free memory holds, at most 2,048 (on a CPU: 8)")
    p.add_argument("--oversample", type=float,
                   help="prompts sampled per prompt wanted, so the filters still leave --topics' counts")
    p.add_argument("--temperature", type=float, help="sampling temperature (Magpie samples at 1)")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_device_args(p)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    # the recipe's `prompts.jobs` items are the source of the defaults
    section_defaults(p, PromptJobConfig, pipeline_only=("name", "weight"))
    return p


def parse_topics(text: str) -> dict[str, int]:
    """``chat=10,code=5`` -> ``{"chat": 10, "code": 5}``; one line naming the fix when malformed."""
    from nemo_dflash.data.prompts import MAGPIE_TOPICS

    counts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        topic, _, n = part.partition("=")
        if topic not in MAGPIE_TOPICS or not n.isdigit() or int(n) < 1 or topic in counts:
            fail(f"--topics {text!r}: give TOPIC=COUNT pairs, each topic once, with topics {', '.join(MAGPIE_TOPICS)} "
                 "and counts >= 1 (e.g. chat=1000,code=500)")
        counts[topic] = int(n)
    if not counts:
        fail("--topics is empty: e.g. chat=1000,code=1000,math=1000")
    return counts


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


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    setup_logging()
    from nemo_dflash.recipes._cli import dist_env
    from nemo_dflash.recipes._regen_args import check_sampling
    from nemo_dflash.engine.sampling import SamplingParams

    out = Path(args.out)
    if not out.name.endswith(".jsonl") or out.is_dir():
        fail(f"--out must be a .jsonl file (got {args.out!r})")
    if (args.source is None) == (args.target is None):
        fail("give --target (Magpie prompts the target writes) or --source (a built-in source's prompts), not both")
    rank, world, local_rank = dist_env()
    if args.source is not None and rank != 0:  # no model to spread: rank 0 writes it
        logger.info("rank %d: --source %s is written by rank 0", rank, args.source)
        return {"out": str(out), "rank": rank}
    if world > 1 and args.source is None and "MASTER_ADDR" not in os.environ:
        fail(f"WORLD_SIZE {world} without torchrun's MASTER_ADDR: launch the ranks with torchrun "
             f"(torchrun --nproc-per-node {world} -m nemo_dflash.recipes.prompts ...) or run one process")
    # never an input, replaced only with --overwrite, writable: checked before the prompts are made
    inputs = [(flag, value) for flag, value in (("--target", args.target), ("--source", args.source))
              if value is not None and os.path.exists(value)]
    shards = [shard_path(out, r, world) for r in range(world)] if world > 1 and args.source is None else []
    with user_errors(OutputError, OSError):
        guard_outputs([Output(out, "--out"), *(Output(p, "--out's rank shard", may_exist=True) for p in shards)],
                      inputs, args.overwrite)
    if args.source is not None:
        return write_builtin(args.source, out)
    counts = parse_topics(args.topics)
    from nemo_dflash.data import DataError
    from nemo_dflash.data.prompts import parse_turns

    with user_errors(DataError):
        turns = parse_turns(args.turns)
    for name in ("max_new_tokens", "user_max_new_tokens", "batch_size"):
        if getattr(args, name) not in ("auto", None) and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    if not 1 <= args.oversample <= 100:
        fail(f"--oversample must be in [1, 100] (got {args.oversample})")
    sampling = SamplingParams(args.temperature, top_p=args.top_p)  # the flags' one SamplingParams
    if sampling.greedy:
        fail("--temperature 0 writes one prompt per topic: Magpie samples, use e.g. 1.0")
    with user_errors(OSError):
        out.parent.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)
    with user_errors():
        device, dtype = resolve_device_dtype(args.device, args.dtype)
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


if __name__ == "__main__":
    main()
