"""The evaluate command's flags turned into the library's settings: the protocol (named, with the flags' overrides
and the target's recommended sampling), the run's options, and every user error that needs no model."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path
from typing import Optional

from nemo_dflash.engine.sampling import SamplingParams, check_sampling
from nemo_dflash.evaluation.preflight import check_fits_models
from nemo_dflash.evaluation.protocol import PROTOCOLS, EvalProtocol
from nemo_dflash.evaluation.run import RunOptions
from nemo_dflash.recipes._cli import resolve_device_dtype

logger = logging.getLogger("nemo_dflash.evaluate")


def batch_size(text: str) -> Optional[int]:
    """--batch-size: a number >= 1, or auto (None); anything else is refused in one line."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--batch-size must be a number >= 1 or auto (got {text!r})")
    return int(text)


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
    check_fits_models(args.target, args.draft, args.max_new_tokens, args.block_size)
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


def run_options(args: argparse.Namespace) -> RunOptions:
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    return RunOptions(draft=str(args.draft), target=str(args.target), out=Path(args.out), device=device, dtype=dtype,
                      seed=args.seed, chat_template=not args.no_chat_template, workers=args.workers,
                      threads=args.threads, max_minutes=args.max_minutes, overwrite=args.overwrite,
                      reasoning=args.reasoning, batch_size=batch_size(args.batch_size),
                      speedup_only=args.speedup_only, part=part(args), any_target=args.any_target,
                      allow_nonfinite=args.allow_nonfinite)
