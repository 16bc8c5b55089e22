"""How long a paper-protocol acceptance run takes, by replay, and whether replay gives the sequential
decoder's figures; with the speedup timed over 20 prompts per set and its spread.

    python benchmarks/eval_speed.py --target pkg:smollm2 --draft EXPORT_DIR \
        [--protocol paper] [--datasets mtbench,humaneval] [--num-prompts K] [--max-new-tokens N] [--turns N]
        [--sequential-prompts 20] [--decode graphs|eager] [--t1 [--t1-method batched [--t1-decode graphs]]]
        [--t1-gpu N] [--workers N] [--draft-attention flex|sdpa]
        [--device auto|cpu|cuda] [--dtype auto|bf16|fp32] [--out DIR] [--overwrite] [--max-minutes M]
        [--json docs/bench/eval_speed.json]

Three phases, each an `evaluate` run (`nemo_dflash.evaluation.run.EvalRun`) into its own
directory under --out. The same command again continues them from their journals (under a
command time limit, with --max-minutes), each phase's seconds summed over the runs; --overwrite
starts afresh. The row is appended once every phase is complete:

1. `t0_seconds`: the protocol's T=0 acceptance by replay (`evaluate --method replay`), models
   loaded included: every answer of every set.
2. `speedup_seconds`: the first --sequential-prompts prompts of each set decoded by the one-at-a-time
   speculative decoder and by plain decoding, timed alone (`evaluate --speedup-prompts K`, --decode
   for both sides). Their speculative answers are the sequential reference: each is compared with
   the replay's answer to the same turn (`max_abs_tau_diff_vs_sequential` over `checked_answers`;
   `identical_answers`: the same tokens and acceptance lengths).
3. `t1_seconds` (with --t1): the protocol's T=1 acceptance by the sequential decoder, or with
   `--t1-method batched` by the batched speculative decoder (`evaluate --method batched`); null otherwise.
   With `--t1-gpu N` this phase runs in a child process on GPU N while phases 1-2 run here
   (`t1_side_by_side`; its seconds are the child's wall time): the longest phase no longer adds to the others.

Prints a table and appends one row to --json: {"date", "commit", "device", "command", "protocol",
"answers", "t0_seconds", "t1_seconds", "speedup_seconds", "max_abs_tau_diff_vs_sequential",
"checked_answers", "identical_answers", "sets": {set: {replay and sequential tau side by side,
speedup mean / min / median / max, and over the answers that do not loop}}}. Runs on a CPU with a tiny target (the test of its plumbing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import append_rows, provenance  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent.parent / "docs" / "bench" / "eval_speed.json"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "nemo_dflash_eval_speed"
TIMES = "eval_speed_seconds.json"  # in --out: each phase's seconds so far, summed over interrupted runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="local HF dir or pkg:smollm2")
    p.add_argument("--draft", required=True, help="the draft (export, training draft dir, checkpoint or run dir)")
    p.add_argument("--protocol", default="paper")
    p.add_argument("--datasets", default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="first K prompts of each set (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--sequential-prompts", type=int, default=20,
                   help="prompts per set decoded one at a time, speculative and plain, timed: the speedup and the "
                        "sequential reference replay is checked against")
    p.add_argument("--decode", default=None, choices=["eager", "graphs"],
                   help="both sides of the speedup (default: graphs on CUDA, eager on CPU)")
    p.add_argument("--t1", action="store_true", help="also time the protocol's T=1 acceptance (sequential decoder)")
    p.add_argument("--t1-method", default="sequential", choices=["sequential", "batched"],
                   help="how the T=1 run decodes: one conversation at a time, or --batch-size at once")
    p.add_argument("--batch-size", default="auto",
                   help="conversations per batch (--t1-method batched): a number or auto (evaluate's default)")
    p.add_argument("--t1-decode", default="eager", choices=["eager", "graphs"],
                   help="--t1-method batched: the eager batched decoder, or the CUDA-graph one (same draws)")
    p.add_argument("--workers", type=int, default=1, help="processes for the T=1 run (sequential)")
    p.add_argument("--t1-gpu", type=int, default=None,
                   help="run the T=1 phase in a child process on this GPU (an index among the GPUs this process "
                        "sees), side by side "
                        "with the T=0 phases on this process's GPU; t1_seconds is the child's wall time. With "
                        "--device cpu the child runs on the CPU (any value)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="directory for the three runs; the same command again continues them (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="start the runs in --out afresh")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no conversation after this (a command time limit): run again to continue; the row is "
                        "appended once every phase is complete, its seconds summed over the runs")
    p.add_argument("--draft-attention", default=None, choices=["flex", "sdpa"],
                   help="the replay draft forward's attention on this device (default: replay.DRAFT_ATTENTION)")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="append the row here")
    return p


def _evaluate_args(args: argparse.Namespace, out: Path, *extra: str) -> argparse.Namespace:
    """The `evaluate` command's own flags (and so its own checks) for one phase."""
    from nemo_dflash.recipes import evaluate

    return evaluate.build_parser().parse_args(_evaluate_argv(args, out, *extra))


def _evaluate_argv(args: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    """The `evaluate` command line of one phase."""
    argv = ["--draft", args.draft, "--target", args.target, "--out", str(out), "--protocol", args.protocol,
            "--device", args.device, "--dtype", args.dtype] + (["--overwrite"] if args.overwrite else [])
    for flag, value in (("--datasets", args.datasets), ("--max-new-tokens", args.max_new_tokens),
                        ("--turns", args.turns), ("--block-size", args.block_size), ("--threads", args.threads),
                        ("--max-minutes", args.max_minutes)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(extra)


def _write_tmp(path: Path, value: Any) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    return tmp


def _check(ns: argparse.Namespace):
    """(the run's options, its protocol): every flag checked before any model loads."""
    from nemo_dflash.recipes import evaluate

    evaluate.check_args(ns)
    protocol = evaluate.resolve_protocol(ns)
    options = evaluate.run_options(ns)
    evaluate.check_decode(protocol.decode, options.device)
    evaluate.check_out(ns)
    return options, protocol


def _run(ns: argparse.Namespace):
    """(EvalRun, its protocol), every flag checked before any model loads."""
    from nemo_dflash.evaluation.run import EvalRun

    options, protocol = _check(ns)
    return EvalRun(options, protocol), protocol


def _tau(answers: Sequence[Any]) -> Optional[float]:
    taus = [sum(a.acceptance_lengths) / len(a.acceptance_lengths) for a in answers if a.acceptance_lengths]
    return sum(taus) / len(taus) if taus else None


def _fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nemo_dflash.evaluation.processes import start_process
    from nemo_dflash.recipes import evaluate
    from nemo_dflash.recipes._cli import resolve_device_dtype

    if args.sequential_prompts < 1:
        raise ValueError(f"--sequential-prompts must be >= 1 (got {args.sequential_prompts})")
    if args.draft_attention is not None:
        from nemo_dflash.evaluation import replay as replay_mod

        replay_mod.DRAFT_ATTENTION["cuda"] = replay_mod.DRAFT_ATTENTION["cpu"] = args.draft_attention
    out = Path(args.out)
    device, _ = resolve_device_dtype(args.device, args.dtype)
    decode = args.decode or ("graphs" if device == "cuda" else "eager")
    num = [] if args.num_prompts is None else ["--num-prompts", str(args.num_prompts)]
    k = args.sequential_prompts if args.num_prompts is None else min(args.sequential_prompts, args.num_prompts)
    # every phase's flags are checked before the first model loads
    replay_ns = _evaluate_args(args, out / "replay_t0", "--method", "replay", "--temperatures", "0", "--no-speedup",
                               *num)
    seq_ns = _evaluate_args(args, out / "sequential_t0", "--temperatures", "0", "--num-prompts", str(k),
                            "--speedup-prompts", str(k), "--decode", decode)
    t1_extra = (["--method", "batched", "--batch-size", str(args.batch_size), "--decode", args.t1_decode]
                if args.t1_method == "batched" else ["--workers", str(args.workers)])
    t1_flags = ["--temperatures", "1", "--no-speedup", *t1_extra, *num]
    t1_argv = _evaluate_argv(args, out / f"{args.t1_method}_t1", *t1_flags) if args.t1 else None
    t1_ns = evaluate.build_parser().parse_args(t1_argv) if t1_argv is not None else None
    side = t1_ns is not None and args.t1_gpu is not None
    if args.t1_gpu is not None and t1_ns is None:
        raise ValueError("--t1-gpu runs the T=1 phase: add --t1")
    replay, protocol = _run(replay_ns)
    sequential, _ = _run(seq_ns)
    if side:  # the child checks and runs the phase; this process reads its journal once it has ended
        _check(t1_ns)
        child_log = out / "t1_child.log"
        child, child_t = start_process(t1_argv, args.t1_gpu, device, child_log), time.perf_counter()
    t1_run = _run(t1_ns)[0] if t1_ns is not None and not side else None
    times_path = out / TIMES
    times = {} if args.overwrite or not times_path.is_file() else json.loads(times_path.read_text())

    def phase(name: str, work) -> dict[str, Any]:
        """Run one phase (if anything is left of it), adding its seconds to those of earlier runs."""
        t = time.perf_counter()
        res = work()
        times[name] = times.get(name, 0.0) + time.perf_counter() - t
        os.replace(_write_tmp(times_path, times), times_path)
        return res

    def replay_phase() -> dict[str, Any]:
        replay.run_acceptance()
        replay.release_models()
        return replay.write_results()

    def speedup_phase() -> dict[str, Any]:
        sequential.run_speedup()
        sequential.release_models()
        return sequential.write_results()

    def t1_phase() -> dict[str, Any]:
        t1_run.run_acceptance()
        t1_run.release_models()
        return t1_run.write_results()

    try:
        rep_res = phase("t0", replay_phase)
        seq_res = phase("speedup", speedup_phase)
    except BaseException:
        if side:
            child.terminate()  # this process failed: the child's journal keeps what it finished
        raise
    if side:
        rc = child.wait()
        times["t1"] = times.get("t1", 0.0) + time.perf_counter() - child_t
        os.replace(_write_tmp(times_path, times), times_path)
        if rc != 0:
            raise ValueError(f"the T=1 phase on --t1-gpu {args.t1_gpu} exited {rc}: see {child_log}")
        t1_run = _run(t1_ns)[0]
        t1_res = t1_run.write_results()
    else:
        t1_res = phase("t1", t1_phase) if t1_run is not None else None
    timed_done = all(("0", name, p.id) in sequential.timed.rows for name, ps in sequential.sets for p in ps[:k])
    complete = bool(rep_res["complete"]) and timed_done and (t1_res is None or bool(t1_res["complete"]))
    t0_seconds, speedup_seconds = times["t0"], times["speedup"]
    t1_seconds = times.get("t1") if t1_run is not None else None

    sets: dict[str, Any] = {}
    diffs: list[float] = []
    identical = 0
    for name, prompts in sequential.sets:
        rep_checked, seq_checked = [], []
        for p in prompts[:k]:
            key = ("0", name, p.id)
            ref = {a.turn: a for a in sequential.timed.answers(key)}
            for a in replay.journal.answers(key):
                b = ref.get(a.turn)
                if b is None:
                    continue
                rep_checked.append(a)
                seq_checked.append(b)
                ta, tb = _tau([a]), _tau([b])
                if ta is not None and tb is not None:
                    diffs.append(abs(ta - tb))
                identical += a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths
        whole = rep_res["results"].get("0", {}).get(name, {})
        sp = seq_res["speedup"].get("0", {}).get(name, {})
        spread = sp.get("per_prompt_speedup") or {}
        sets[name] = {
            "answers": whole.get("answers"), "replay_tau": whole.get("mean_acceptance_length"),
            "checked_answers": len(rep_checked), "replay_tau_checked": _tau(rep_checked),
            "sequential_tau_checked": _tau(seq_checked), "speedup_prompts": spread.get("prompts"),
            "speedup": sp.get("speedup"), "speedup_min": spread.get("min"), "speedup_median": spread.get("median"),
            "speedup_max": spread.get("max"), "speedup_no_loop": sp.get("speedup_no_loop"),
            "answers_no_loop": sp.get("answers_no_loop"), "greedy_match": sp.get("greedy_match"),
        }
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {
        **provenance(dev_name),
        "protocol": rep_res["protocol"], "dtype": rep_res["settings"]["dtype"], "decode_speedup": decode,
        "answers": sum(s["answers"] or 0 for s in sets.values()),
        "t0_seconds": round(t0_seconds, 2), "t1_seconds": None if t1_seconds is None else round(t1_seconds, 2),
        "t1_method": args.t1_method if t1_run is not None else None,
        "t1_side_by_side": side,
        "t1_decode": args.t1_decode if t1_run is not None and args.t1_method == "batched" else None,
        "t1_tau": None if t1_res is None else {
            name: r.get("mean_acceptance_length") for name, r in t1_res["results"].get("1", {}).items()},
        "speedup_seconds": round(speedup_seconds, 2),
        "max_abs_tau_diff_vs_sequential": max(diffs) if diffs else None,
        "checked_answers": sum(s["checked_answers"] for s in sets.values()), "identical_answers": identical,
        "complete": complete, "sets": sets, "out": str(out),
    }


def table(row: dict[str, Any]) -> str:
    pr = row["protocol"]
    lines = [f"protocol {pr['name']}: up to {pr['max_new_tokens']} new tokens, {pr['turns']} turn(s), T=0, "
             f"block {pr['block_size']}, {row['dtype']} on {row['device']}; speedup decode {row['decode_speedup']}",
             f"T=0 acceptance by replay: {row['answers']} answers in {row['t0_seconds']:.1f} s; "
             f"T=1 ({row.get('t1_method') or '-'}): "
             f"{'-' if row['t1_seconds'] is None else format(row['t1_seconds'], '.1f') + ' s'}"
             f"{'' if not row.get('t1_tau') else ' (tau ' + ', '.join(f'{k} {_fmt(v)}' for k, v in row['t1_tau'].items()) + ')'}; "
             f"speedup + sequential check: {row['speedup_seconds']:.1f} s",
             f"replay vs sequential: {row['identical_answers']}/{row['checked_answers']} answers identical, "
             f"max |tau diff| {_fmt(row['max_abs_tau_diff_vs_sequential'], '.4f')}",
             f"{'set':<12}{'answers':>8}{'tau replay':>11}{'checked':>8}{'replay':>8}{'sequential':>11}"
             f"{'speedup':>9}{'min':>7}{'median':>8}{'max':>7}{'no loop':>8}{'prompts':>8}"]
    for name, s in row["sets"].items():
        lines.append(f"{name[:11]:<12}{s['answers'] or 0:>8}{_fmt(s['replay_tau']):>11}{s['checked_answers']:>8}"
                     f"{_fmt(s['replay_tau_checked']):>8}{_fmt(s['sequential_tau_checked']):>11}"
                     f"{_fmt(s['speedup'], '.2f'):>9}{_fmt(s['speedup_min'], '.2f'):>7}"
                     f"{_fmt(s['speedup_median'], '.2f'):>8}{_fmt(s['speedup_max'], '.2f'):>7}"
                     f"{_fmt(s.get('speedup_no_loop'), '.2f'):>8}{s['speedup_prompts'] or 0:>8}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nemo_dflash.recipes._cli import setup_logging, user_errors

    args = build_parser().parse_args(argv)
    setup_logging()
    with user_errors(ValueError, FileNotFoundError):  # one line, exit 2
        row = measure(args)
    print(table(row))
    if not row["complete"]:
        print(f"partial (--max-minutes): run the same command again to continue; no row appended to {args.json}")
        return 0
    append_rows(Path(args.json), [row])
    print(f"row appended to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
