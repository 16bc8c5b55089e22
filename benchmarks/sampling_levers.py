r"""The T > 0 levers side by side: drafts trained at equal tokens on the same prompts, one GPU each, then
measured at T=0, at the target's recommended sampling and at T=1.

    python benchmarks/sampling_levers.py regen  OUT --target pkg:smollm2 --data sharegpt --data code=P/code.jsonl
    python benchmarks/sampling_levers.py train  OUT [--levers a,b,c,d] [--tokens 30e6] [--max-minutes M]
    python benchmarks/sampling_levers.py eval   OUT [--levers ...]          # export + acceptance (no timing)
    python benchmarks/sampling_levers.py speed  OUT [--levers ...] [--speedup-prompts 20] [--speed-max-new-tokens 512]
    python benchmarks/sampling_levers.py chain  OUT --levers a,b,c,d --gpu-list 0,1,2,3 [the phases' flags]
    python benchmarks/sampling_levers.py report OUT [--json docs/bench/drafter_summary.json] [--device NAME]

Levers (`LEVERS`): the data's sampling temperature and `loss.distill_weight`:
  a: hard CE on answers sampled at T=0.2 / top-p 0.9 (today's recipe)   b: a + distillation (weight 1)
  b05: a + distillation (weight 0.5)   c: hard CE on answers sampled at T=1 (two answers a prompt)   d: c + b
and, at decode time, for every draft: T=1 with the draft proposing its argmax (`--draft-proposals greedy`).

`regen` answers the prompts twice, at T=0.2 / top-p 0.9 and at T=1 (two samples a prompt), on half the GPUs
each (torchrun), with the same seed and the same time cap. `train` trains every lever on its own GPU from the
same recipe with the same step count (`--tokens` / 32,768-token steps), resuming each where it stopped (run the
same command again after `--max-minutes`). `eval` exports each draft and runs, side by side on its GPU, replay
(T=0), batched T=1 and batched T=1 with argmax proposals, at the paper's lengths (2048 new tokens, MT-Bench both
turns, HumanEval). `speed` times batch-1 speedup with CUDA graphs at T=0, the recommended settings and T=1, alone
on each GPU (tau at the recommended settings is read from those timed answers). `report` prints the table and appends one row per
lever to the drafter summary, every figure read from the files those phases wrote.
`chain` runs each lever's train, eval and speed phases one after another on its own GPU, the levers side by side,
so a GPU moves on as soon as its lever's phase ends. Every phase skips what is complete, so a phase can be re-run
(or continued on a fresh machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

LEVERS: dict[str, dict[str, Any]] = {
    "a": {"data": "t02", "distill": 0.0, "loss": "hard CE"},
    "b": {"data": "t02", "distill": 1.0, "loss": "distill 1.0"},
    "b05": {"data": "t02", "distill": 0.5, "loss": "distill 0.5"},
    "c": {"data": "t1", "distill": 0.0, "loss": "hard CE"},
    "d": {"data": "t1", "distill": 1.0, "loss": "distill 1.0"},
}
DATA = {  # name -> (regenerate sampling flags, samples per prompt, data temperature label)
    "t02": (["--temperature", "0.2", "--top-p", "0.9"], 1, "0.2 (top-p 0.9)"),
    "t1": (["--temperature", "1", "--top-p", "1"], 2, "1"),
}
STEP_TOKENS = 4 * 8192  # the GPU recipe's packed step on one GPU: 4 rows of 8192 tokens
# evaluate runs per draft: (directory, arguments); acceptance side by side on one GPU, speed alone
ACCEPTANCE = {
    "t0": ["--method", "replay", "--temperatures", "0"],
    "t1": ["--method", "batched", "--temperatures", "1"],
    "t1_greedy_draft": ["--method", "batched", "--temperatures", "1", "--draft-proposals", "greedy"],
}


def run_all(jobs: list[tuple[str, list[str], dict[str, str]]], logs: Path) -> dict[str, int]:
    """Start every (name, argv, extra env) at once, wait for all; exit codes by name, logs under `logs`."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, argv, env in jobs:
        log = open(logs / f"{name}.log", "a")
        procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}), log)
        print(f"[{time.strftime('%H:%M:%S')}] started {name}: {' '.join(argv)}", flush=True)
    codes = {}
    for name, (proc, log) in procs.items():
        codes[name] = proc.wait()
        log.close()
        print(f"[{time.strftime('%H:%M:%S')}] {name} exited {codes[name]}", flush=True)
        if codes[name]:
            print("".join((logs / f"{name}.log").read_text().splitlines(True)[-15:]), flush=True)
    return codes


CPU_ONLY = False  # --cpu: no GPU pinning (a dry run of every phase on a tiny target)


GPU_LIST: list[str] = []  # --gpu-list: the GPU of the i-th lever (default: GPU i)


def gpu_env(i: int) -> dict[str, str]:
    if CPU_ONLY:
        return {}
    return {"CUDA_VISIBLE_DEVICES": GPU_LIST[i % len(GPU_LIST)] if GPU_LIST else str(i)}


def python() -> list[str]:
    return [sys.executable]


def regen(args: argparse.Namespace) -> None:
    out = Path(args.out)
    n = max(args.gpus // 2, 1)
    jobs = []
    for k, (name, (flags, spp, _)) in enumerate(DATA.items()):
        path = out / "data" / f"{name}.jsonl"
        if path.exists():
            continue
        launcher = (python() + ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                                "--master-port", str(29500 + k)] if n > 1 else python())
        gpus = ",".join(str(k * n + i) for i in range(n))
        argv = launcher + ["-m", "nemo_dflash.recipes.regenerate", "--target", args.target,
                           *[x for d in args.data for x in ("--data", d)], "--out", str(path), "--turns", "all",
                           "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-tokens", "1536",
                           "--sampling", "given", *flags, "--samples-per-prompt", str(spp), "--loops", "cut",
                           "--batch-size", args.batch_size, "--seed", "0", "--summary-json",
                           str(out / "data" / f"{name}.summary.json"), *args.extra]
        if args.max_minutes:
            argv += ["--max-minutes", str(args.max_minutes)]
        if args.dtype:
            argv += ["--dtype", args.dtype]
        jobs.append((f"regen_{name}", argv, {} if CPU_ONLY else {"CUDA_VISIBLE_DEVICES": gpus}))
    (out / "data").mkdir(parents=True, exist_ok=True)
    codes = run_all(jobs, out / "logs")
    if any(codes.values()):
        sys.exit(1)


def levers_of(args: argparse.Namespace) -> list[str]:
    names = [x.strip() for x in args.levers.split(",") if x.strip()]
    unknown = [x for x in names if x not in LEVERS]
    if unknown:
        sys.exit(f"unknown lever(s) {unknown}: choose from {', '.join(LEVERS)}")
    return names


def train(args: argparse.Namespace) -> None:
    out = Path(args.out)
    steps = max(1, round(float(args.tokens) / args.step_tokens))
    jobs = []
    for i, name in enumerate(levers_of(args)):
        lever = LEVERS[name]
        run = out / "runs" / name
        if finished(run):
            continue
        argv = python() + ["-m", "nemo_dflash.recipes.train", "--config", args.recipe, f"target.path={args.target}",
                           f"data.sources=[{{path: {out / 'data' / (lever['data'] + '.jsonl')}}}]",
                           f"output_dir={run}", f"train.max_steps={steps}", f"loss.distill_weight={lever['distill']}",
                           f"train.eval_every={args.eval_every}", "wandb.mode=disabled", *args.overrides]
        if args.max_minutes:
            argv.append(f"train.max_minutes={args.max_minutes}")
        jobs.append((f"train_{name}", argv, gpu_env(i)))
    codes = run_all(jobs, out / "logs")
    if any(codes.values()):
        sys.exit(1)


def finished(run: Path) -> bool:
    """The run reached its step count (a run stopped by train.max_minutes also writes final/, and resumes)."""
    summary = _read(run / "summary.json")
    return bool(summary) and not summary.get("stopped_early") and summary["steps"] >= summary["total_steps"]


def export_dir(out: Path, name: str) -> Path:
    return out / "export" / name


def evaluate_argv(args: argparse.Namespace, draft: Path, dest: Path, extra: list[str]) -> list[str]:
    return python() + ["-m", "nemo_dflash.recipes.evaluate", "--draft", str(draft), "--target", args.target,
                       "--out", str(dest), "--protocol", args.protocol, *extra, *args.eval_extra]


def evaluate(args: argparse.Namespace) -> None:
    out = Path(args.out)
    names = levers_of(args)
    exports = []
    for i, name in enumerate(names):
        exp = export_dir(out, name)
        if not finished(out / "runs" / name):
            print(f"lever {name}: its training has not reached its step count: run `train` again first")
        if not (exp / "config.json").exists():
            exports.append((f"export_{name}", python() + ["-m", "nemo_dflash.recipes.export", "--checkpoint",
                                                          str(out / "runs" / name), "--out", str(exp), "--target",
                                                          args.target], gpu_env(i)))
    run_all(exports, out / "logs")
    jobs = []
    tags = [t.strip() for t in args.acceptance.split(",") if t.strip()]
    unknown = [t for t in tags if t not in ACCEPTANCE]
    if unknown:
        sys.exit(f"unknown --acceptance run(s) {unknown}: choose from {', '.join(ACCEPTANCE)}")
    for i, name in enumerate(names):
        for tag in tags:
            extra = ACCEPTANCE[tag]
            dest = out / "eval" / name / tag
            if (dest / "results.json").exists() and json.loads((dest / "results.json").read_text()).get("complete"):
                continue
            argv = evaluate_argv(args, export_dir(out, name), dest, extra + ["--no-speedup"])
            if argv:
                jobs.append((f"eval_{name}_{tag}", argv, gpu_env(i)))
    run_all(jobs, out / "logs")


def speed(args: argparse.Namespace) -> None:
    """Batch-1 speedup, graphs on both sides, alone on each GPU; the acceptance phase after the timing is cut
    off by --max-minutes (its figures come from `eval`)."""
    out = Path(args.out)
    jobs = []
    for i, name in enumerate(levers_of(args)):
        dest = out / "eval" / name / "speed"
        argv = evaluate_argv(args, export_dir(out, name), dest, [
            "--temperatures", args.speed_temperatures, "--sampling", "target", "--method", "batched",
            "--decode", "graphs", "--num-prompts", str(args.speedup_prompts), "--speedup-prompts",
            str(args.speedup_prompts), "--speedup-only", "--max-minutes", str(args.max_minutes or 8)]
            + (["--max-new-tokens", str(args.speed_max_new_tokens)] if args.speed_max_new_tokens else []))
        jobs.append((f"speed_{name}", argv, gpu_env(i)))
    run_all(jobs, out / "logs")


def chain(args: argparse.Namespace) -> None:
    """Each lever's train -> export + acceptance -> speed on its own GPU, the levers side by side: a GPU
    moves on as soon as its lever's phase ends (the phases' flags as given; --max-minutes caps each phase)."""
    names = levers_of(args)
    gpus = GPU_LIST or [str(i) for i in range(len(names))]
    jobs = []
    for i, name in enumerate(names):
        argv = [sys.executable, os.path.abspath(__file__), "_chain_one", *args.argv_rest, "--levers", name,
                "--gpu-list", gpus[i % len(gpus)]]
        jobs.append((f"chain_{name}", argv, {}))
    codes = run_all(jobs, Path(args.out) / "logs")
    if any(codes.values()):
        sys.exit(1)


def _chain_one(args: argparse.Namespace) -> None:
    train(args)
    evaluate(args)
    speed(args)


# ----------------------------------------------------------------------------- report


def _read(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else None


def _sets(res: Optional[dict[str, Any]], tkey: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """{dataset: figures} of one sampling key of an evaluate results.json (the only key when tkey is None)."""
    if not res or not res.get("results"):
        return {}
    block = res["results"]
    key = tkey if tkey is not None else next(iter(block))
    return block.get(key, {})


def _speed(res: Optional[dict[str, Any]], tkey: str, dataset: str) -> Optional[dict[str, Any]]:
    return ((res or {}).get("speedup") or {}).get(tkey, {}).get(dataset)


def _sha256(path: Path) -> Optional[str]:
    """The file's sha256, or the one written beside it (`NAME.sha256`) when the file stayed on its machine."""
    if not path.exists():
        side = path.with_name(path.name + ".sha256")
        return side.read_text().split()[0] if side.exists() else None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lever_row(out: Path, name: str, target: str) -> dict[str, Any]:
    """Every figure of one lever, read from its run and evaluation files."""
    lever = LEVERS[name]
    run = out / "runs" / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "metrics.jsonl").exists() else []
    ev = [r for r in rows if "eval_accept_len" in r]
    last = ev[-1] if ev else {}
    tokens = max((r.get("tokens", 0) for r in rows), default=0)
    summary = _read(run / "summary.json") or {}
    ev_dir = out / "eval" / name
    res = {tag: _read(ev_dir / tag / "results.json") for tag in (*ACCEPTANCE, "speed")}
    exp = export_dir(out, name)
    computed = None
    if (exp / "model.safetensors").exists():  # the hash evaluate keys answers on (names and bytes of the weights)
        from nemo_dflash.draft.build import draft_weights_sha256

        computed = draft_weights_sha256(exp)
    row: dict[str, Any] = {
        "draft": f"sampling lever {name}", "loss": lever["loss"], "distill_weight": lever["distill"],
        "data_temperature": DATA[lever["data"]][2], "samples_per_prompt": DATA[lever["data"]][1],
        "train_tokens": tokens, "train_steps": summary.get("steps"), "planned_steps": summary.get("total_steps"),
        "train_seconds": summary.get("train_seconds"), "stopped_early": summary.get("stopped_early"),
        "sim_tau_heldout": last.get("eval_accept_len"),
        "sampled_tau_heldout": last.get("eval_sampled_accept_len"),
        "sampled_tau_heldout_greedy_draft": last.get("eval_sampled_accept_len_greedy_draft"),
        "loss_heldout": last.get("eval_loss"), "target": target,
    }
    recorded = {r.get("draft_sha256") for r in res.values() if r}
    # the export's hash where its weights are here, else the one every evaluation file recorded (when they agree)
    row["draft_sha256"] = computed or (next(iter(recorded)) if len(recorded) == 1 else None)
    row["eval_draft_sha256_match"] = (recorded == {computed}) if computed else len(recorded) == 1
    row["model_safetensors_sha256"] = _sha256(exp / "model.safetensors")
    for ds, short in (("humaneval", "humaneval"), ("mtbench", "mtbench")):
        t0 = _sets(res["t0"]).get(ds, {})
        t1 = _sets(res["t1"]).get(ds, {})
        t1g = _sets(res["t1_greedy_draft"]).get(ds, {})
        row[f"{short}_t0_answers"] = t0.get("answers")
        row[f"{short}_t1_answers"] = t1.get("answers")
        row[f"{short}_t0_loop_share"] = t0.get("loop_share")
        row[f"{short}_t0_tau"] = t0.get("mean_acceptance_length")
        row[f"{short}_t0_tau_no_loop"] = t0.get("mean_acceptance_length_no_loop")
        row[f"{short}_t1_tau"] = t1.get("mean_acceptance_length")
        row[f"{short}_t1_tau_no_loop"] = t1.get("mean_acceptance_length_no_loop")
        row[f"{short}_t1_tau_greedy_draft"] = t1g.get("mean_acceptance_length")
        sp = res["speed"]
        for tag, key in (("t0", "0"), ("t1", "1")):
            s = _speed(sp, key, ds)
            row[f"{short}_{tag}_speedup"] = s.get("speedup") if s else None
            row[f"{short}_{tag}_speedup_prompts"] = s.get("num_prompts") if s else None
            row[f"{short}_{tag}_speedup_no_loop"] = s.get("speedup_no_loop") if s else None
            row[f"{short}_{tag}_speedup_per_prompt"] = s.get("per_prompt_speedup") if s else None
        rkey = next((k for k in ((sp or {}).get("speedup") or {}) if k not in ("0", "1")), None)
        s = _speed(sp, rkey, ds) if rkey else None
        row[f"{short}_recommended_speedup"] = s.get("speedup") if s else None
        row[f"{short}_recommended_tau"] = s.get("mean_acceptance_length") if s else None  # the timed prompts
        row[f"{short}_recommended_speedup_prompts"] = s.get("num_prompts") if s else None
    protocols = {tag: r["protocol"] for tag, r in res.items() if r}
    row["protocol"] = {tag: {k: p.get(k) for k in ("max_new_tokens", "turns", "temperatures", "sampling", "method",
                                                    "decode", "block_size", "speedup_prompts", "num_prompts")}
                       for tag, p in protocols.items()}
    return row


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    rows = [lever_row(out, name, args.target) for name in levers_of(args) if (out / "runs" / name).exists()]
    cols = [("lever", lambda r: r["draft"].split()[-1]), ("loss", lambda r: r["loss"]),
            ("data T", lambda r: r["data_temperature"]), ("M tok", lambda r: r["train_tokens"] / 1e6),
            ("sim tau", lambda r: r["sim_tau_heldout"]), ("T1 exp", lambda r: r["sampled_tau_heldout"]),
            ("T1 exp argmax", lambda r: r["sampled_tau_heldout_greedy_draft"])]
    for ds in ("humaneval", "mtbench"):
        cols += [(f"{ds[:2]} T0", lambda r, d=ds: r[f"{d}_t0_tau"]),
                 (f"{ds[:2]} T0 noloop", lambda r, d=ds: r[f"{d}_t0_tau_no_loop"]),
                 (f"{ds[:2]} rec", lambda r, d=ds: r[f"{d}_recommended_tau"]),
                 (f"{ds[:2]} T1", lambda r, d=ds: r[f"{d}_t1_tau"]),
                 (f"{ds[:2]} T1 argmax", lambda r, d=ds: r[f"{d}_t1_tau_greedy_draft"]),
                 (f"{ds[:2]} x T0", lambda r, d=ds: r[f"{d}_t0_speedup"]),
                 (f"{ds[:2]} x rec", lambda r, d=ds: r[f"{d}_recommended_speedup"]),
                 (f"{ds[:2]} x T1", lambda r, d=ds: r[f"{d}_t1_speedup"])]

    def cell(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    print(" | ".join(c for c, _ in cols))
    for r in rows:
        print(" | ".join(cell(f(r)) for _, f in cols))
    if args.json:
        path = Path(args.json)
        table = json.loads(path.read_text()) if path.exists() else []
        stamp = {"date": args.date or time.strftime("%Y-%m-%d"), "device": args.device, "commit": args.commit,
                 "command": f"python benchmarks/sampling_levers.py {{regen,train,eval,speed}} OUT {args.note}".strip()}
        names = {r["draft"] for r in rows}
        table = [r for r in table if r.get("draft") not in names] + [{**stamp, **r} for r in rows]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
        print(f"{len(rows)} rows -> {path}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("regen", "train", "eval", "speed", "chain", "report", "_chain_one"))
    p.add_argument("out")
    p.add_argument("--target", default="pkg:smollm2")
    p.add_argument("--data", action="append", default=[], help="regenerate --data specs (regen)")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--levers", default="a,b,c,d")
    p.add_argument("--tokens", type=float, default=30e6, help="training tokens per lever (train)")
    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS)
    p.add_argument("--recipe", default="smollm2_135m_gpu.yaml")
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=1024, help="regenerated answer cap (regen)")
    p.add_argument("--batch-size", default="auto", help="regenerate --batch-size")
    p.add_argument("--dtype", default=None)
    p.add_argument("--extra", default="", help="more regenerate flags, one string")
    p.add_argument("--overrides", nargs="*", default=[], help="more training overrides (key=value)")
    p.add_argument("--protocol", default="paper")
    p.add_argument("--eval-extra", default="", help="more evaluate flags (every evaluate run), one string")
    p.add_argument("--speedup-prompts", type=int, default=20)
    p.add_argument("--speed-temperatures", default="0,1")
    p.add_argument("--speed-max-new-tokens", type=int, default=None,
                   help="answer cap of the timed prompts (default: the protocol's)")
    p.add_argument("--acceptance", default=",".join(ACCEPTANCE), help="acceptance runs of `eval`, comma list")
    p.add_argument("--gpu-list", default="", help="GPU of each lever in order, comma list (default: 0, 1, ...)")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--note", default="", help="the phases' flags, recorded in the rows' command")
    p.add_argument("--date", default=None, help="the runs' date (default today)")
    p.add_argument("--cpu", action="store_true", help="pin no GPU (a dry run on a tiny target)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv_rest = _without(argv[1:], ("--levers", "--gpu-list"))  # what `chain` passes on to each lever
    args.extra, args.eval_extra = shlex.split(args.extra), shlex.split(args.eval_extra)
    global CPU_ONLY, GPU_LIST
    CPU_ONLY = args.cpu
    GPU_LIST = [g.strip() for g in args.gpu_list.split(",") if g.strip()]
    {"regen": regen, "train": train, "eval": evaluate, "speed": speed, "report": report, "chain": chain,
     "_chain_one": _chain_one}[args.phase](args)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
