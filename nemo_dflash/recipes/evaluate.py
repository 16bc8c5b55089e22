r"""Measure a DFlash draft: acceptance length tau, its histogram, tau over the first 256 tokens,
the share of looping answers, and speedup over plain decoding.

    python -m nemo_dflash.recipes.evaluate --draft DIR --target PATH --out DIR \
        [--protocol paper|quick] [--datasets mtbench,humaneval,FILE.jsonl] [--max-new-tokens N]
        [--turns N] [--temperatures 0,1] [--block-size B] [--num-prompts K] [--first-prompt I]
        [--speedup-prompts K] [--workers N] [--max-minutes M] [--overwrite] [--decode eager|graphs]
        [--device cuda] [--dtype bf16] [--threads N]

--protocol paper (default): up to 2048 new tokens, stopping at end of turn; MT-Bench on both turns
(turn 2 sees the target's own turn-1 answer), all 164 HumanEval prompts; T=0 and T=1; the first
10 prompts per dataset also timed against plain decoding. --protocol quick (CI, the demo): 8
prompts per dataset, 64 new tokens, one turn, T=0. Explicit flags override the protocol's values.

Speedup is timed first, in this process, with nothing else running on the device; only then
are the --workers processes started for the acceptance runs (their clocks are not used).
Answers are appended to OUT/answers.jsonl (speedup runs: OUT/speedup.jsonl) as they finish; the
same command run again continues from them. Writes OUT/results.json and
OUT/acceptance_histogram.png and prints a table with the protocol beside every figure.
Metric definitions: docs/evaluation.md. The library: nemo_dflash.inference.evaluate.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from nemo_dflash.inference.evaluate import (  # noqa: F401  (the old import path of the library names)
    Answer, ConversationDecoder, EvalPrompt, EvalProtocol, EvalSettings, PROTOCOLS, dataset_result, encode_chat,
    evaluate_acceptance, format_table, load_chat_file, load_humaneval, load_mtbench, load_prompt_set,
    plot_histograms, protocol_record, speedup_metrics,
)
from nemo_dflash.recipes._cli import fail, setup_logging

logger = logging.getLogger("nemo_dflash.evaluate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="exported draft, training draft dir, or checkpoint/run dir")
    p.add_argument("--target", required=True, help="local HF dir, .gguf file, or pkg:smollm2")
    p.add_argument("--out", required=True, help="output directory (results.json, answers.jsonl, histogram PNG)")
    p.add_argument("--protocol", default="paper", help="paper (default) or quick; the flags below override it")
    p.add_argument("--datasets", default=None, help="comma list: mtbench, humaneval, FILE.json[l]")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--turns", type=int, default=None, help="user turns decoded per conversation (MT-Bench has 2)")
    p.add_argument("--multi-turn", action="store_true", help="same as --turns 2")
    p.add_argument("--temperatures", "--temperature", dest="temperatures", default=None, help="e.g. 0 or 0,1")
    p.add_argument("--block-size", type=int, default=None, help="default: the draft's trained block size")
    p.add_argument("--num-prompts", type=int, default=None, help="first K prompts of each dataset")
    p.add_argument("--first-prompt", type=int, default=None, help="skip this many prompts of each dataset first")
    p.add_argument("--speedup-prompts", type=int, default=None,
                   help="time the first K prompts of each dataset against plain decoding, alone on the device "
                        "before any worker starts (0: no speedup)")
    p.add_argument("--no-speedup", action="store_true", help="same as --speedup-prompts 0")
    p.add_argument("--decode", default=None, choices=["eager", "graphs"],
                   help="decoder mode, for both the speculative and the plain side (default eager)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the device for the acceptance runs, each with its own target + draft; "
                        "a conversation's turns stay in one process; results are merged in prompt order. "
                        "Speedup is never timed in workers (see --speedup-prompts)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no conversation after this; results.json then says complete: false (re-run continues)")
    p.add_argument("--overwrite", action="store_true", help="discard answers of an earlier run in --out")
    p.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: cores / workers)")
    p.add_argument("--seed", type=int, default=0)
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
        if not temps or any(t < 0 for t in temps):
            raise ValueError(f"--temperatures {args.temperatures!r}: give one or more numbers >= 0, e.g. 0,1")
    datasets = None if args.datasets is None else tuple(d.strip() for d in args.datasets.split(",") if d.strip())
    if datasets is not None and not datasets:
        raise ValueError("--datasets is empty: e.g. --datasets mtbench,humaneval")
    turns = 2 if args.multi_turn and args.turns is None else args.turns
    speedup = 0 if args.no_speedup else args.speedup_prompts
    for flag, v, lo in [("--max-new-tokens", args.max_new_tokens, 1), ("--turns", turns, 1),
                        ("--block-size", args.block_size, 1), ("--num-prompts", args.num_prompts, 1),
                        ("--first-prompt", args.first_prompt, 0), ("--speedup-prompts", speedup, 0)]:
        if v is not None and v < lo:
            raise ValueError(f"{flag} must be >= {lo} (got {v})")
    return PROTOCOLS[args.protocol].with_overrides(
        max_new_tokens=args.max_new_tokens, turns=turns, temperatures=temps, datasets=datasets,
        num_prompts=args.num_prompts, speedup_prompts=speedup, block_size=args.block_size, decode=args.decode,
        first_prompt=args.first_prompt)


def check_args(args: argparse.Namespace) -> None:
    """The remaining user errors that need no model."""
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {args.workers})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1 (got {args.threads})")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise ValueError(f"--max-minutes must be > 0 (got {args.max_minutes})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible: pass --device cpu")


def check_paths(draft: str, target: str) -> None:
    """The draft's and target's paths exist (a worker would otherwise fail with a traceback)."""
    from nemo_dflash.build import resolve_draft_dir
    from nemo_dflash.loading import resolve_target_path

    resolve_draft_dir(draft)
    if not Path(resolve_target_path(target)).exists():
        raise FileNotFoundError(f"--target {target} does not exist: pass a local HF dir, a .gguf file or pkg:smollm2")


def check_decode(decode: str, device: str) -> None:
    """The decoder's own check of a decode mode on this device, before any model loads."""
    import nemo_dflash.inference as inference

    check = getattr(inference, "check_decode_mode", None)
    if check is not None:
        check(decode, torch.device(device))
    elif decode != "eager":
        raise ValueError(f"--decode {decode} is not available in this install: use --decode eager")


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class ModelSpec:
    """What a process loads: the parent for speedup (and workers=1), each worker for its share."""

    draft: str
    target: str
    device: str
    dtype: str
    threads: Optional[int] = None


def load_models(spec: ModelSpec) -> tuple[Any, Any, Any]:
    """(target, tokenizer, draft), the draft checked against the target."""
    from nemo_dflash.build import load_draft_for_target
    from nemo_dflash.loading import load_target

    if spec.threads:
        torch.set_num_threads(spec.threads)
    target, tokenizer = load_target(spec.target, dtype=spec.dtype, device=spec.device)
    draft = load_draft_for_target(spec.draft, target.config, tokenizer, device=spec.device, dtype=spec.dtype)
    return target, tokenizer, draft


def _decode(models: tuple[Any, Any, Any], decoders: dict, settings: EvalSettings, prompt: EvalPrompt,
            warmup: bool = False) -> dict[str, Any]:
    """One conversation as a journal row; one `ConversationDecoder` per settings, warmed up once."""
    dec = decoders.get(settings)
    if dec is None:
        dec = decoders[settings] = ConversationDecoder(*models, settings)
        if warmup:
            dec.warmup(prompt)
    return {"block_size": dec.block_size, "trained_block_size": int(dec.spec.draft.config.block_size),
            "answers": [a.record() for a in dec.run(prompt)]}


_WORKER: dict[str, Any] = {}


def _worker_init(spec: ModelSpec) -> None:
    _WORKER["models"], _WORKER["decoders"] = load_models(spec), {}


def _worker_job(job: tuple[EvalSettings, EvalPrompt]) -> dict[str, Any]:
    return _decode(_WORKER["models"], _WORKER["decoders"], *job)


Key = tuple[str, str, str]  # (temperature, dataset, prompt id)


class Journal:
    """A JSONL file of finished conversations behind a header line; a re-run continues from it.

    The header holds every setting that changes an answer, so answers of another evaluation are
    refused rather than mixed in. A line cut short by a kill is dropped (and the conversation redone).
    """

    def __init__(self, path: Path, header: dict[str, Any], overwrite: bool) -> None:
        self.path, self.rows = path, {}
        if path.is_file() and not overwrite:
            lines = path.read_text().split("\n")
            old = _json_or_none(lines[0]) or {}
            if old.get("header") != header:
                diff = sorted(k for k in header if (old.get("header") or {}).get(k) != header[k])
                raise ValueError(f"{path} holds answers of another evaluation ({', '.join(diff) or 'header'} "
                                 "differ): pass --overwrite or another --out")
            for row in filter(None, map(_json_or_none, lines[1:])):
                if {"temperature", "dataset", "id", "answers"} <= set(row):
                    self.rows[(row["temperature"], row["dataset"], row["id"])] = row
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in [{"header": header}, *self.rows.values()]))
        os.replace(tmp, path)

    def add(self, key: Key, row: dict[str, Any]) -> None:
        row = {"temperature": key[0], "dataset": key[1], "id": key[2], **row}
        self.rows[key] = row
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def answers(self, key: Key) -> list[Answer]:
        return [Answer.from_record(r) for r in self.rows[key]["answers"]] if key in self.rows else []


def _json_or_none(line: str) -> Optional[dict]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


class EvalRun:
    """One evaluation: prompt sets, the journals in --out, the speedup phase, then the acceptance phase."""

    def __init__(self, args: argparse.Namespace, protocol: EvalProtocol) -> None:
        self.args, self.protocol = args, protocol
        dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
        self.sets: list[tuple[str, list[EvalPrompt]]] = []
        for name in protocol.datasets:
            display, prompts = load_prompt_set(name)
            end = None if protocol.num_prompts is None else protocol.first_prompt + protocol.num_prompts
            prompts = prompts[protocol.first_prompt:end]
            if not prompts:
                raise ValueError(f"no {display} prompts left after --first-prompt {protocol.first_prompt}")
            if display in dict(self.sets):
                raise ValueError(f"two datasets are named {display!r}: rename one file")
            self.sets.append((display, prompts))
        check_paths(str(args.draft), str(args.target))
        self.model_spec = ModelSpec(str(args.draft), str(args.target), args.device, dtype, args.threads)
        header = {"draft": str(args.draft), "target": str(args.target), "device": args.device, "dtype": dtype,
                  "seed": args.seed, "chat_template": not args.no_chat_template,
                  "max_new_tokens": protocol.max_new_tokens, "turns": protocol.turns,
                  "block_size": protocol.block_size, "decode": protocol.decode}
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.out / "answers.jsonl", header, args.overwrite)
        self.timed = Journal(self.out / "speedup.jsonl", header, args.overwrite)
        self.deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes

    def settings(self, temperature: float, timed: bool) -> EvalSettings:
        p = self.protocol
        return EvalSettings(max_new_tokens=p.max_new_tokens, temperature=temperature, block_size=p.block_size,
                            turns=p.turns, decode=p.decode, measure_speedup=timed, warmup=False,
                            use_chat_template=not self.args.no_chat_template, seed=self.args.seed)

    def _items(self, journal: Journal, timed: bool) -> list[tuple[Key, EvalSettings, EvalPrompt]]:
        k = self.protocol.speedup_prompts if timed else None
        return [((f"{t:g}", name, p.id), self.settings(t, timed), p) for t in self.protocol.temperatures
                for name, prompts in self.sets for p in prompts[:k] if (f"{t:g}", name, p.id) not in journal.rows]

    def _expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def execute(self) -> dict[str, Any]:
        timed, items = self._items(self.timed, True), self._items(self.journal, False)
        models, decoders = None, {}
        if timed:  # alone on the device: no worker exists yet
            models = load_models(self.model_spec)
            logger.info("Timing %d conversations against plain decoding", len(timed))
            for key, s, p in timed:
                if self._expired():
                    break
                self.timed.add(key, _decode(models, decoders, s, p, warmup=True))
        if items and not self._expired():
            logger.info("Decoding %d conversations with %d worker(s)", len(items), self.args.workers)
            if self.args.workers == 1:
                models = models or load_models(self.model_spec)
                for key, s, p in items:
                    if self._expired():
                        break
                    self.journal.add(key, _decode(models, decoders, s, p))
            else:
                del models, decoders
                gc.collect()  # the parent's models leave the device before the workers load theirs
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self._run_workers(items)
        return self.write_results()

    def _run_workers(self, items: list[tuple[Key, EvalSettings, EvalPrompt]]) -> None:
        import multiprocessing as mp

        n = self.args.workers
        threads = self.args.threads or max(1, (os.cpu_count() or 1) // n)
        spec = replace(self.model_spec, threads=threads)
        # by module name, also when this file runs as __main__, so spawned workers can import them
        from nemo_dflash.recipes import evaluate as this

        with mp.get_context("spawn").Pool(n, initializer=this._worker_init, initargs=(spec,)) as pool:
            # imap hands out one conversation at a time (balanced) and yields in prompt order
            for (key, _, _), row in zip(items, pool.imap(this._worker_job, [(s, p) for _, s, p in items])):
                self.journal.add(key, row)
                if self._expired():
                    pool.terminate()
                    break

    def write_results(self) -> dict[str, Any]:
        p = self.protocol
        rows = [*self.journal.rows.values(), *self.timed.rows.values()]
        block = rows[0]["block_size"] if rows else p.block_size
        trained = rows[0]["trained_block_size"] if rows else None
        results: dict[str, dict[str, Any]] = {}
        speedup: dict[str, dict[str, Any]] = {}
        complete = True
        for t in p.temperatures:
            tkey = f"{t:g}"
            for name, prompts in self.sets:
                keys = [(tkey, name, x.id) for x in prompts]
                done = [k for k in keys if k in self.journal.rows]
                complete &= len(done) == len(keys)
                if done:
                    results.setdefault(tkey, {})[name] = dataset_result(
                        [a for k in done for a in self.journal.answers(k)], block_size=block, temperature=t,
                        max_new_tokens=p.max_new_tokens, num_prompts=len(done))
                tk = [k for k in keys[: p.speedup_prompts] if k in self.timed.rows]
                complete &= len(tk) == len(keys[: p.speedup_prompts])
                if tk:
                    speedup.setdefault(tkey, {})[name] = {
                        "num_prompts": len(tk), **speedup_metrics([a for k in tk for a in self.timed.answers(k)], t)}
        counts = {name: {"prompts": len(ps), "answers_per_temperature": sum(min(p.turns, len(x.turns)) for x in ps)}
                  for name, ps in self.sets}
        res = {
            "draft": str(self.args.draft), "target": str(self.args.target),
            "protocol": protocol_record(p, block, trained, counts),
            "settings": {"device": self.model_spec.device, "dtype": self.model_spec.dtype, "seed": self.args.seed,
                         "workers": self.args.workers, "chat_template": not self.args.no_chat_template},
            "complete": complete, "results": results, "speedup": speedup,
        }
        (self.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
        if results:
            plot_histograms(results, self.out / "acceptance_histogram.png", p)
        return res

    def table(self, res: dict[str, Any]) -> str:
        pr = res["protocol"]
        sets = ", ".join(f"{n} {c['prompts']} prompts ({c['answers_per_temperature']} answers)"
                         for n, c in pr["datasets"].items())
        head = (f"protocol {pr['name']}{' (changed: ' + ', '.join(pr['overrides']) + ')' if pr['overrides'] else ''}: "
                f"up to {pr['max_new_tokens']} new tokens, stop at end of turn, up to {pr['turns']} turn(s), "
                f"T = {','.join(f'{t:g}' for t in pr['temperatures'])}, block {pr['block_size']}, "
                f"decode {pr['decode']}; {sets}")
        return head + "\n" + format_table(res["results"], self.protocol, pr["block_size"] or 0, res["speedup"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        check_args(args)
        protocol = resolve_protocol(args)
        check_decode(protocol.decode, args.device)
        run = EvalRun(args, protocol)  # prompt sets and earlier answers in --out: no model yet
    except (FileNotFoundError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    try:
        results = run.execute()
    except (FileNotFoundError, ValueError) as e:  # a draft that does not fit the target, a bad checkpoint
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    print(run.table(results))
    partial = "" if results["complete"] else "  (partial: run the same command again to continue)"
    print(f"results: {Path(args.out) / 'results.json'}{partial}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
