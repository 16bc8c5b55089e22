r"""Write a prompt file for `regenerate --data NAME=FILE`: prompts the target writes itself (Magpie).

    python -m nemo_dflash.recipes.prompts --target pkg:smollm2 --out data/magpie.jsonl \
        --topics chat=40000,code=30000,math=30000,reading=10000 --turns 2-6 --batch-size 1024

The target gets its chat template up to the user header, after a system prompt that steers the
topic (chat, code, math, reading: answer from a passage, formatting: follow formatting
instructions, explain_code: `nemo_dflash.data.magpie.MAGPIE_TOPICS`), and samples the user turn
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
    python -m nemo_dflash.recipes.prompts --config RECIPE [--job NAME] --out FILE.jsonl [prompts.jobs.0.seed=1 ...]

The second form takes a recipe's `prompts.jobs` item (--job NAME; default: the only one) as the pipeline's prompts
stage runs it: its keys give the flags (its target.path the --target of a Magpie job), and a flag given wins.

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
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from nemo_dflash.config import PromptJobConfig
from nemo_dflash.files import Output, OutputError, guard_outputs
from nemo_dflash.recipes._cli import (
    add_batch_size_arg, add_device_args, add_jsonl_out_arg, add_recipe_args, fail, parse_with_recipe,
    resolve_device_dtype, section_defaults, set_threads, setup_logging, user_errors,
)
from nemo_dflash.recipes._prompts_run import run_magpie, shard_path, write_builtin  # noqa: F401  (shard_path: here too)

if TYPE_CHECKING:
    from nemo_dflash.config import RecipeConfig

logger = logging.getLogger("nemo_dflash.prompts")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="the aligned target: local HF dir, .gguf file or pkg:smollm2")
    p.add_argument("--source",
                   help="write this built-in source's prompts instead (chitchat, gsm_symbolic[:COUNT], code[:COUNT], "
                        "code_stdlib[+KINDS][:COUNT], code_site[+KINDS][:COUNT], or a folder of Python source; "
                        "no model)")
    add_jsonl_out_arg(p)
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
    add_batch_size_arg(p, "prompts in flight")
    p.add_argument("--oversample", type=float,
                   help="prompts sampled per prompt wanted, so the filters still leave --topics' counts")
    p.add_argument("--temperature", type=float, help="sampling temperature (Magpie samples at 1)")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_device_args(p)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--job", metavar="NAME",
                   help="with --config: the prompts.jobs item whose keys give the flags (default: the only one)")
    add_recipe_args(p, "prompts.jobs", pick=recipe_job, example="prompts.jobs.0.seed=1")  # --config RECIPE
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


def recipe_job(cfg: RecipeConfig, args: argparse.Namespace, argv: Sequence[str]) -> tuple[PromptJobConfig, bool]:
    """With --config: the prompts.jobs item --job names (the only one without --job), and whether the recipe's
    target.path is its --target (a Magpie job, as the pipeline runs it). A --target or --source given here wins
    over the job's kind."""
    jobs, names = cfg.prompts.jobs, [j.name for j in cfg.prompts.jobs]
    if not jobs:
        fail(f"--config {args.config}: the recipe has no prompts.jobs; add one (e.g. prompts.jobs="
             "'[{name: magpie, topics: \"chat=100\"}]') or pass the flags without --config")
    if args.job is None and len(jobs) > 1:
        fail(f"--config {args.config}: the recipe's prompts.jobs are {', '.join(names)}: pick one with --job NAME")
    if args.job is not None and args.job not in names:
        fail(f"--job {args.job}: the recipe's prompts.jobs are {', '.join(names)}")
    job = jobs[names.index(args.job) if args.job is not None else 0]
    target, source = (any(a == flag or a.startswith(flag + "=") for a in argv) for flag in ("--target", "--source"))
    if target and not source:
        job = dataclasses.replace(job, source=None)  # --target here: Magpie, whatever the job's kind
    return job, job.source is None and not source


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_with_recipe(build_parser(), argv)  # --config RECIPE: its prompts.jobs item, flags winning
    setup_logging()
    from nemo_dflash.recipes._cli import dist_env
    from nemo_dflash.recipes._regen_args import check_sampling
    from nemo_dflash.engine.sampling import SamplingParams

    if args.job is not None and args.config is None:
        fail(f"--job {args.job} picks a recipe's prompts.jobs item: give --config RECIPE, or pass the flags alone")
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
    return run_magpie(args, out, counts, turns, sampling, device, dtype, rank, world, local_rank)


if __name__ == "__main__":
    main()
