"""One evaluation run behind `python -m nemo_dflash.recipes.evaluate`: the journals in the output
directory (a re-run continues from them), the speedup phase alone on the device, then the
acceptance phase in one process or several workers, and results.json with its histogram.

The command only parses flags into `RunOptions` and an `EvalProtocol`; the measuring itself
(conversations, metrics, plots) is `nemo_dflash.evaluation.protocol`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from nemo_dflash.train.device import release_device_memory
from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash.evaluation.protocol import (
    Answer,
    ConversationDecoder,
    EvalPrompt,
    EvalProtocol,
    EvalSettings,
    dataset_result,
    format_table,
    load_prompt_set,
    plot_histograms,
    protocol_record,
    speedup_metrics,
)

logger = logging.getLogger("nemo_dflash.evaluate")


@dataclass(frozen=True)
class RunOptions:
    """What the command decides beside the protocol: models, output, device (resolved), processes."""

    draft: str
    target: str
    out: Path
    device: str
    dtype: str
    seed: int = 0
    chat_template: bool = True
    workers: int = 1
    threads: Optional[int] = None
    max_minutes: Optional[float] = None
    overwrite: bool = False
    reasoning: Optional[str] = None  # the thinking mode prompts are rendered in; None: the template's default
    batch_size: Optional[int] = None  # conversations per batch (--method batched); None: auto (batch_rows)
    speedup_only: bool = False  # time the speedup prompts, skip the acceptance phase (their tau is in the timing)
    part: Optional[tuple[int, int]] = None  # (i, n): this process takes prompt j of each set where j % n == i
    any_target: bool = False  # allow a target other than the one the draft records it was trained on
    allow_nonfinite: bool = False  # measure a draft whose weights hold NaN or inf


# rows of the automatic batch on a GPU; on a CPU (memory the OS shares) the fixed default
MAX_AUTO_ROWS = 256
CPU_BATCH_ROWS = 32


def batch_rows(conversations: int, device: str) -> int:
    """The automatic --batch-size: on a GPU every conversation of a temperature at once, up to
    MAX_AUTO_ROWS (a batch runs until its longest answer ends, so fewer batches is faster; one that
    runs out of memory is halved); on a CPU, CPU_BATCH_ROWS."""
    cap = MAX_AUTO_ROWS if str(device).startswith("cuda") else CPU_BATCH_ROWS
    return max(1, min(conversations, cap))


def check_paths(draft: str, target: str) -> None:
    """The draft's and target's paths exist (a worker would otherwise fail with a traceback)."""
    from nemo_dflash.draft.build import resolve_draft_dir
    from nemo_dflash.target.loading import resolve_target_path

    resolve_draft_dir(draft)
    if not Path(resolve_target_path(target)).exists():
        raise FileNotFoundError(f"--target {target} does not exist: pass a local HF dir, a .gguf file or pkg:smollm2")


def check_draft_files(draft: str) -> str:
    """A draft inside a complete-marked checkpoint or run is checked against its COMPLETE marker (the check
    resume and export make); returns the content hash of its weights, which keys the answers."""
    from nemo_dflash.draft.build import draft_weights_sha256, resolve_draft_dir
    from nemo_dflash.files import DamagedFilesError, verify_marked_draft

    try:
        verify_marked_draft(resolve_draft_dir(draft))
    except DamagedFilesError as e:
        raise ValueError(f"--draft {draft}: {e}: evaluate another checkpoint of the run, or copy it again") from None
    return draft_weights_sha256(draft)


def check_draft_weights(draft: str, allow_nonfinite: bool) -> None:
    """Weights cut short or NaN (`draft.build.check_draft_weights`), refused before either model loads."""
    from nemo_dflash.draft.build import check_draft_weights as check

    check(draft, allow_nonfinite)


def check_trained_on_target(draft: str, target: str, allow: bool) -> None:
    """A draft whose weights record another target's fingerprint than --target's is refused (`--any-target`
    allows it), before either model loads."""
    from nemo_dflash.draft.build import resolve_draft_dir
    from nemo_dflash.target.identity import check_trained_on

    check_trained_on(Path(resolve_draft_dir(draft)) / "model.safetensors", target, flag="--target", allow=allow)


def check_draft_fits(draft: str, target: str) -> None:
    """A draft trained for another target (hidden size, vocabulary, layer ids) is refused from the two
    configs alone, before either model loads (`load_models` checks the loaded pair again)."""
    from nemo_dflash.draft.build import check_draft_fits_target, load_draft_config
    from nemo_dflash.target.loading import load_target_config

    check_draft_fits_target(load_draft_config(draft), load_target_config(target))



@dataclass(frozen=True)
class ModelSpec:
    """What a process loads: the parent for speedup (and workers=1), each worker for its share."""

    draft: str
    target: str
    device: str
    dtype: str
    threads: Optional[int] = None
    reasoning: Optional[str] = None


def check_reasoning_switch(target: str, reasoning: Optional[str]) -> None:
    """``--reasoning`` needs a chat template with a thinking switch; checked on the tokenizer alone."""
    if reasoning is None:
        return
    from nemo_dflash.data.chat_template import has_thinking_switch, reasoning_kwargs
    from nemo_dflash.target.loading import load_tokenizer

    reasoning_kwargs(reasoning)  # a known mode
    if not has_thinking_switch(load_tokenizer(target)):
        raise ValueError(f"--reasoning {reasoning}: the chat template of {target} has no thinking switch "
                         "(enable_thinking); drop --reasoning")


def load_models(spec: ModelSpec) -> tuple[Any, Any, Any]:
    """(target, tokenizer, draft), the draft checked against the target."""
    from nemo_dflash.draft.build import load_draft_for_target
    from nemo_dflash.target.loading import load_target

    if spec.threads:
        torch.set_num_threads(spec.threads)
    target, tokenizer = load_target(spec.target, dtype=spec.dtype, device=spec.device)
    draft = load_draft_for_target(spec.draft, target.config, tokenizer, device=spec.device, dtype=spec.dtype)
    if spec.reasoning is not None:
        from nemo_dflash.data.chat_template import ReasoningTokenizer

        tokenizer = ReasoningTokenizer(tokenizer, spec.reasoning)
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


def interleave(groups: Sequence[Sequence[Any]]) -> list[Any]:
    """Item j of every group, in the groups' order, before item j + 1 of any (round robin; a group that runs out
    is passed over)."""
    return [g[j] for j in range(max((len(g) for g in groups), default=0)) for g in groups if j < len(g)]


Key = tuple[str, str, str]  # (temperature, dataset, prompt id)
_HEADER_NAMES = {"draft_sha256": "the draft's weights (draft_sha256)",
                 "target_weights": "the target's weights (target_weights)",
                 "datasets_sha256": "a dataset file's contents (datasets_sha256)"}
# Header keys a journal written before they were recorded lacks: such a journal is continued, and gains them.
_RECORDED_LATER = ("target_weights", "datasets_sha256")


def header_diffs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The header keys whose values differ between a journal on disk and this evaluation."""
    return sorted(k for k in {*old, *new} if old.get(k) != new.get(k) and not (k in _RECORDED_LATER and k not in old))


class Journal:
    """A JSONL file of finished conversations behind a header line; a re-run continues from it.

    The header holds every setting that changes an answer, so answers of another evaluation are
    refused rather than mixed in. A line cut short by a kill is dropped (and the conversation redone).
    """

    def __init__(self, path: Path, header: dict[str, Any], overwrite: bool) -> None:
        self.path, self.header, self.rows = path, header, {}
        if path.is_file() and not overwrite:
            lines = path.read_text().split("\n")
            old = _json_or_none(lines[0]) or {}
            old_header = old.get("header") if isinstance(old.get("header"), dict) else None
            diff = header_diffs(old_header or {}, header) if old_header is not None else ["header"]
            if diff:
                named = [_HEADER_NAMES.get(k, k) for k in diff]
                raise ValueError(f"{path} holds answers of another evaluation ({', '.join(named) or 'header'} "
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


def target_fingerprint(target: str) -> str:
    """The target's weights fingerprint (`target.identity`): part of what keys an evaluation's answers."""
    from nemo_dflash.target.identity import weights_fingerprint
    from nemo_dflash.target.loading import resolve_target_path

    return weights_fingerprint(resolve_target_path(target))


def lock_out(out: Path) -> Any:
    """The run lock (`train.run_dir.RunDirLock`) on --out: a second evaluate into it is refused in one line."""
    from nemo_dflash.train.run_dir import RunDirError, RunDirLock

    lock = RunDirLock(out, user="evaluate", place="--out")
    try:
        lock.acquire()
    except RunDirError as e:
        raise ValueError(str(e)) from None
    return lock


class EvalRun:
    """One evaluation: prompt sets, the journals in --out, the speedup phase, then the acceptance phase."""

    def __init__(self, options: RunOptions, protocol: EvalProtocol) -> None:
        opts = self.opts = options
        self.protocol = protocol
        self.sets: list[tuple[str, list[EvalPrompt]]] = []
        self.dataset_hashes: dict[str, str] = {}
        for name in protocol.datasets:
            display, prompts = load_prompt_set(name)
            end = None if protocol.num_prompts is None else protocol.first_prompt + protocol.num_prompts
            prompts = prompts[protocol.first_prompt:end]
            if not prompts:
                raise ValueError(f"no {display} prompts left after --first-prompt {protocol.first_prompt}")
            if display in dict(self.sets):
                raise ValueError(f"two datasets are named {display!r}: rename one file")
            self.sets.append((display, prompts))
            if Path(name).is_file():  # a prompt file: its contents key the answers, not its path
                from nemo_dflash.data.sources import source_sha256

                self.dataset_hashes[display] = source_sha256(name)
        check_paths(str(opts.draft), str(opts.target))
        self.draft_sha256 = check_draft_files(str(opts.draft))
        check_draft_weights(str(opts.draft), allow_nonfinite=opts.allow_nonfinite)  # cut short, NaN: refused now
        check_reasoning_switch(str(opts.target), opts.reasoning)
        check_draft_fits(str(opts.draft), str(opts.target))
        check_trained_on_target(str(opts.draft), str(opts.target), opts.any_target)
        self.model_spec = ModelSpec(str(opts.draft), str(opts.target), opts.device, opts.dtype, opts.threads,
                                    opts.reasoning)
        # keyed on the draft's and the target's weights and the dataset files' contents, not their paths: more
        # training into the same path, another target or an edited prompt file is another evaluation
        header = {"draft_sha256": self.draft_sha256, "target": str(opts.target),
                  "target_weights": target_fingerprint(str(opts.target)), "datasets_sha256": self.dataset_hashes,
                  "device": opts.device, "dtype": opts.dtype,
                  "seed": opts.seed, "chat_template": opts.chat_template,
                  "max_new_tokens": protocol.max_new_tokens, "turns": protocol.turns,
                  "block_size": protocol.block_size, "decode": protocol.decode}
        if opts.reasoning is not None:  # answers of another thinking mode are another evaluation
            header["reasoning"] = opts.reasoning
        if protocol.method != "sequential":  # replay's answers are the sequential decoder's only up to rounding
            header["method"] = protocol.method
        self.out = Path(opts.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = lock_out(self.out)  # one evaluation per --out: held until execute() ends (or the process)
        try:
            self.journal = Journal(self.out / "answers.jsonl", header, opts.overwrite)
            self.timed = Journal(self.out / "speedup.jsonl", header, opts.overwrite)
        except BaseException:
            self.lock.release()  # refused: --out is free again
            raise
        self.deadline = None if opts.max_minutes is None else time.monotonic() + 60 * opts.max_minutes
        self._loaded: Optional[tuple[Any, Any, Any]] = None  # (target, tokenizer, draft), loaded on first use
        self._decoders: dict = {}

    def settings(self, sampling: SamplingParams, timed: bool) -> EvalSettings:
        p = self.protocol
        return EvalSettings(max_new_tokens=p.max_new_tokens, sampling=sampling, block_size=p.block_size,
                            turns=p.turns, decode=p.decode, measure_speedup=timed, warmup=False,
                            use_chat_template=self.opts.chat_template, seed=self.opts.seed)

    def _mine(self, j: int) -> bool:
        """Whether prompt j of a set is this process's (every prompt, unless it is one part of `--gpus`: then every
        n-th, so each part holds its share of every temperature and set, the speedup prompts included)."""
        return self.opts.part is None or j % self.opts.part[1] == self.opts.part[0]

    def _keys(self, t: SamplingParams, name: str, prompts: Sequence[EvalPrompt]) -> list[tuple[Key, EvalPrompt]]:
        return [((t.key, name, p.id), p) for j, p in enumerate(prompts) if self._mine(j)]

    def _items(self, journal: Journal, timed: bool) -> list[tuple[Key, EvalSettings, EvalPrompt]]:
        """The conversations `journal` lacks. Timed ones go in turns over every (temperature, set): prompt j of
        each before prompt j + 1 of any, so a run stopped by --max-minutes has timed every set and temperature."""
        k = self.protocol.speedup_prompts if timed else None
        groups = [[(key, self.settings(t, timed), p) for key, p in self._keys(t, name, prompts[:k])
                   if key not in journal.rows] for t in self.protocol.samplings for name, prompts in self.sets]
        return interleave(groups) if timed else [item for group in groups for item in group]

    def _expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def execute(self) -> dict[str, Any]:
        """The speedup phase, then the acceptance phase, then results.json; --out is free again after it."""
        try:
            self.run_speedup()
            if not self.opts.speedup_only:
                self.run_acceptance()
            return self.write_results()
        finally:
            self.lock.release()

    def _models(self) -> tuple[Any, Any, Any]:
        if self._loaded is None:
            self._loaded = load_models(self.model_spec)
        return self._loaded

    def release_models(self) -> None:
        """Drop this process's target and draft (and the decoders built on them) from the device."""
        self._loaded, self._decoders = None, {}
        release_device_memory()

    def run_speedup(self) -> None:
        """Time the first `speedup_prompts` conversations of each set against plain decoding, alone
        on the device (no worker exists yet); journalled in speedup.jsonl."""
        timed = self._items(self.timed, True)
        if not timed:
            return
        logger.info("Timing %d conversations against plain decoding", len(timed))
        for key, s, p in timed:
            if self._expired():
                break
            self.timed.add(key, _decode(self._models(), self._decoders, s, p, warmup=True))

    def run_acceptance(self) -> None:
        """Every conversation not yet in answers.jsonl: replayed in one batch (method replay), or decoded
        one at a time in this process or in --workers processes."""
        items = self._items(self.journal, False)
        if not items or self._expired():
            return
        if self.protocol.method == "replay":
            self._replay(self._models(), items)
            return
        if self.protocol.method == "batched":
            self._batched(self._models(), items)
            return
        logger.info("Decoding %d conversations with %d worker(s), one at a time (the reference decoder; "
                    "--method replay gives T=0 and --method batched any temperature in minutes)",
                    len(items), self.opts.workers)
        if self.opts.workers == 1:
            for key, s, p in items:
                if self._expired():
                    break
                self.journal.add(key, _decode(self._models(), self._decoders, s, p))
        else:
            self.release_models()  # the parent's models leave the device before the workers load theirs
            self._run_workers(items)

    def _replay(self, models: tuple[Any, Any, Any], items: list[tuple[Key, EvalSettings, EvalPrompt]]) -> None:
        """T=0 acceptance of every conversation not yet in the journal, in one batched replay
        (`evaluation.replay`); each conversation is journalled as its walk ends."""
        from nemo_dflash.evaluation.replay import ReplayEvaluator

        target, tokenizer, draft = models
        settings = items[0][1]
        if any(not s.sampling.greedy for _, s, _ in items):  # the command refuses this first
            raise ValueError("--method replay measures T=0 only: pass --temperatures 0")
        logger.info("Replaying %d conversations (T=0): batched greedy answers, then the draft at every position",
                    len(items))
        evaluator = ReplayEvaluator(target, tokenizer, draft, settings)
        trained = int(draft.config.block_size)
        for i, answers in evaluator.run([p for _, _, p in items]):
            self.journal.add(items[i][0], {"block_size": evaluator.block_size, "trained_block_size": trained,
                                           "answers": [a.record() for a in answers]})

    def _batched(self, models: tuple[Any, Any, Any], items: list[tuple[Key, EvalSettings, EvalPrompt]]) -> None:
        """Every conversation not yet in the journal, `batch_size` at a time per temperature, by the
        batched speculative decoder; each batch is journalled as it ends. With the automatic size, a
        batch that runs out of GPU memory is run again at half the rows."""
        by_settings: dict[EvalSettings, list[tuple[Key, EvalSettings, EvalPrompt]]] = {}
        for item in items:
            by_settings.setdefault(item[1], []).append(item)
        for settings, group in by_settings.items():
            dec = ConversationDecoder(*models, settings)
            trained = int(dec.spec.draft.config.block_size)
            n = self.opts.batch_size or batch_rows(len(group), self.model_spec.device)
            logger.info("Decoding %d conversations at %s in batches of %d", len(group),
                        settings.sampling.label, n)
            start = 0
            while start < len(group):
                if self._expired():
                    return
                chunk = group[start : start + n]
                try:
                    done = dec.run_batch([p for _, _, p in chunk])
                except torch.cuda.OutOfMemoryError:
                    if self.opts.batch_size or n == 1:
                        raise
                    n = (n + 1) // 2
                    logger.warning("%d conversations at once ran out of GPU memory: again at %d a batch", len(chunk), n)
                    torch.cuda.empty_cache()
                    continue
                for (key, _, _), answers in zip(chunk, done):
                    self.journal.add(key, {"block_size": dec.block_size, "trained_block_size": trained,
                                           "answers": [a.record() for a in answers]})
                start += len(chunk)

    def _run_workers(self, items: list[tuple[Key, EvalSettings, EvalPrompt]]) -> None:
        import multiprocessing as mp

        n = self.opts.workers
        threads = self.opts.threads or max(1, (os.cpu_count() or 1) // n)
        spec = replace(self.model_spec, threads=threads)
        # module-level functions of this (importable) module: spawned workers find them by name
        with mp.get_context("spawn").Pool(n, initializer=_worker_init, initargs=(spec,)) as pool:
            # imap hands out one conversation at a time (balanced) and yields in prompt order
            for (key, _, _), row in zip(items, pool.imap(_worker_job, [(s, p) for _, s, p in items])):
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
        not_measured: list[dict[str, Any]] = []  # what a capped run left: per temperature and set, what is missing
        for t in p.samplings:
            tkey = t.key
            for name, prompts in self.sets:
                keys = [k for k, _ in self._keys(t, name, prompts)]
                done = [k for k in keys if k in self.journal.rows]
                complete &= self.opts.speedup_only or len(done) == len(keys)
                if done:
                    results.setdefault(tkey, {})[name] = dataset_result(
                        [a for k in done for a in self.journal.answers(k)], block_size=block, sampling=t,
                        max_new_tokens=p.max_new_tokens, num_prompts=len(done))
                timed = [k for k, _ in self._keys(t, name, prompts[: p.speedup_prompts])]
                tk = [k for k in timed if k in self.timed.rows]
                complete &= len(tk) == len(timed)
                missing = {"acceptance": len(keys) - len(done) if not self.opts.speedup_only else 0,
                           "speedup": len(timed) - len(tk)}
                if any(missing.values()):
                    not_measured.append({"temperature": tkey, "dataset": name, **{
                        f"{k}_prompts_missing": v for k, v in missing.items()},
                        "acceptance_prompts": len(keys), "speedup_prompts": len(timed)})
                if tk:
                    speedup.setdefault(tkey, {})[name] = {
                        "num_prompts": len(tk), **speedup_metrics([a for k in tk for a in self.timed.answers(k)], t)}
        counts = {name: {"prompts": len(ps), "answers_per_temperature": sum(min(p.turns, len(x.turns)) for x in ps)}
                  for name, ps in self.sets}
        res = {
            "draft": str(self.opts.draft), "draft_sha256": self.draft_sha256, "target": str(self.opts.target),
            "protocol": protocol_record(p, block, trained, counts),
            "settings": {"device": self.model_spec.device, "dtype": self.model_spec.dtype, "seed": self.opts.seed,
                         "workers": self.opts.workers, "chat_template": self.opts.chat_template,
                         "reasoning": self.opts.reasoning or "template default"},
            "complete": complete, "results": results, "speedup": speedup,
            **({"not_measured": not_measured} if not_measured else {}),
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
                f"{'; '.join(pr['sampling'].values()) if pr.get('sampling') else 'T = ' + ','.join(f'{t:g}' for t in pr['temperatures'])}, block {pr['block_size']}, "
                f"decode {pr['decode']}, method {pr.get('method', 'sequential')}, reasoning {res['settings'].get('reasoning', 'template default')}; {sets}")
        text = head + "\n" + format_table(res["results"], self.protocol, pr["block_size"] or 0, res["speedup"])
        for m in res.get("not_measured", ()):  # a capped run says what its figures leave out
            text += (f"\nnot measured (T={m['temperature']}, {m['dataset']}): acceptance on "
                     f"{m['acceptance_prompts_missing']} of {m['acceptance_prompts']} prompts, speedup on "
                     f"{m['speedup_prompts_missing']} of {m['speedup_prompts']}")
        return text


__all__ = ["EvalRun", "Journal", "ModelSpec", "RunOptions", "check_draft_files", "check_draft_fits", "check_paths",
           "load_models"]
