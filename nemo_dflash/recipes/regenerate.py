r"""Regenerate chat data with the target model's own answers: the data a DFlash draft trains on.

    python -m nemo_dflash.recipes.regenerate --target /models/Qwen3-8B --data sharegpt \
        --out data/regen.jsonl --num-samples 20000 --max-new-tokens 2048 --batch-size 64 --holdout 200
    python -m nemo_dflash.recipes.regenerate --target pkg:smollm2 --data sharegpt \
        --out regen.jsonl --num-samples 32 --max-new-tokens 96 --batch-size 16

    torchrun --nproc-per-node 8 -m nemo_dflash.recipes.regenerate --target /models/Qwen3-8B \
        --data sharegpt --data magpie=data/magpie.jsonl@2 --data code --out data/regen.jsonl --samples-per-prompt 2

Reads prompt sources (--data [NAME=]SOURCE[@WEIGHT], repeatable: ShareGPT/OpenAI files or the
built-ins sharegpt, chitchat, gsm_symbolic, code; docs/data.md), drops prompts that share a 13-gram
with the evaluation prompts, shuffles them with --seed, takes the first --num-samples usable ones
(each --samples-per-prompt times) and replaces their assistant turns with the target's answers.
Writes OpenAI-layout JSONL, one conversation a line:
    {"messages": [{"role": ..., "content": ...}, ...], "finish_reason": "stop"|"length", "source": "file:line",
     "dataset": NAME}
Under torchrun the ranks take conversations from one shared queue (the longest first) into
their own journals, and rank 0 merges them into the file a single process writes.
The output is written to OUT.partial and renamed when complete; rerunning the same command
after an interruption continues the partial file. --holdout N writes the prompts (no answers) of
N further conversations to OUT_STEM.holdout.jsonl, for evaluation (`evaluate --datasets`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from nemo_dflash.files import (
    FileLock, LockBusyError, LockReplacedError, Output, OutputError, guard_outputs, write_error_reason,
)
from nemo_dflash.config import RegenerateConfig
from nemo_dflash.recipes._cli import (
    add_device_args, count_or_auto, fail, resolve_device_dtype, section_defaults, set_threads, setup_logging,
    user_errors,
)
from nemo_dflash.recipes._regen_server import add_server_args, validate_server_args
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.engine.sampling import check_sampling as check_sampling_values

logger = logging.getLogger("nemo_dflash.regenerate")

# Settings that change which conversations are picked or what is generated: a partial output
# may only be continued with the same values.
_RESUME_KEYS = ("target", "data", "num_samples", "seed", "turns", "max_prompt_tokens", "max_new_tokens",
                "temperature", "top_p", "holdout", "engine", "loops", "capped", "after_cut", "samples_per_prompt",
                "decontaminate", "backend", "model")
# Keys added later, with the value a partial output written before them was made with.
_RESUME_DEFAULTS = {"after_cut": "end", "samples_per_prompt": 1, "decontaminate": "off", "backend": "engine",
                    "model": None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nemo_dflash.recipes.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: local HF dir, .gguf file or pkg:smollm2")
    p.add_argument("--data", action="append", required=True, metavar="[NAME=]SOURCE[@WEIGHT]",
                   help="a prompt source, repeatable: a file of conversations (.jsonl/.json/.parquet, ShareGPT or "
                        "OpenAI layout) or a built-in: sharegpt, chitchat, gsm_symbolic[:COUNT], code[:COUNT]; "
                        "NAME (default: the built-in's name or the file's stem) is written to each record's "
                        "'dataset'; WEIGHT (default 1) repeats (2) or subsamples (0.5) the source in the pool")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="answers sampled per selected conversation, each with its own sampling key")
    p.add_argument("--decontaminate", choices=("on", "off"), default="on",
                   help="drop prompts sharing a 13-gram with the MT-Bench or HumanEval prompts that evaluate uses")
    p.add_argument("--eval-file", action="append", default=[], metavar="FILE",
                   help="also decontaminate against this prompt file (one you evaluate on: evaluate --datasets FILE); "
                        "repeatable")
    p.add_argument("--summary-json", default=None,
                   help="also write the run's summary (per-source counts, decontamination, speed) to this JSON file")
    p.add_argument("--out", required=True, help="output FILE.jsonl")
    p.add_argument("--num-samples", type=int, default=None,
                   help="regenerate the first N usable conversations after the seeded shuffle (default: all)")
    p.add_argument("--seed", type=int, default=0, help="shuffle (and sampling) seed")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="first: [system?, user, assistant] only; all: answer every user turn, feeding the "
                        "regenerated answers back as context")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip conversations whose prompt is longer (default: the model's context minus "
                        "--max-new-tokens); with --turns all a conversation ends at the first turn over it")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn")
    p.add_argument("--sampling", choices=("target", "given", "greedy"), default="target",
                   help="target: the target's generation_config sampling settings when it has them, else "
                        "--temperature/--top-p; given: --temperature/--top-p; greedy: temperature 0")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (see --sampling); 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (see --sampling)")
    p.add_argument("--engine", choices=("slots", "generate"), default="slots",
                   help="slots: the decoding engine, continuous batching, a finished answer's row refilled as it "
                        "ends (full-attention models); generate: model.generate batch after batch (any model)")
    p.add_argument("--batch-size", type=count_or_auto, default=8,
                   help="answers in flight (slots: rows of the KV cache; generate: prompts per call); auto: as "
                        "many as the GPU's free memory holds, at most 2,048 (on a CPU or with "
                        "--engine generate: 8)")
    p.add_argument("--prepare-ahead", type=int, default=64,
                   help="conversations whose first prompt is templated and tokenised ahead on a background "
                        "thread, overlapping the GPU (0: inline); the output does not depend on it")
    p.add_argument("--schedule", choices=("most_turns_first", "given"), default="most_turns_first",
                   help="--turns all: the order conversations start in; starting those with the most turns "
                        "first shortens the tail where the batch empties; the output does not depend on it")
    p.add_argument("--loops", choices=("cut", "drop", "keep"), default="cut",
                   help="an answer that degenerates into repetition: cut at the loop's start (the conversation "
                        "ends there), drop the turn, or keep it")
    p.add_argument("--capped", choices=("keep", "drop"), default="keep",
                   help="an answer that hits --max-new-tokens without looping: keep it (the conversation ends "
                        "there) or drop the turn")
    p.add_argument("--after-cut", choices=("end", "continue"), default="end",
                   help="--turns all: an answer cut by --loops cut or by the token cap ends its conversation "
                        "(end), or the next turn is asked with the cut answer in its history (continue)")
    add_device_args(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, every core)")
    p.add_argument("--reasoning", choices=("on", "off", "both"), default=None,
                   help="thinking mode of targets whose chat template has a switch (Qwen3, Qwen3.5 enable_thinking); "
                        "both: every prompt answered in each mode. Each record says its mode, and training masks "
                        "it as the template renders that mode (default: the template's default, unrecorded)")
    p.add_argument("--holdout", type=int, default=0,
                   help="also write N more conversations' prompts (no answers) to OUT_STEM.holdout.jsonl")
    p.add_argument("--max-bad-lines", type=int, default=100, help="malformed input records tolerated")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (and any partial one)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop generating after this long and finish OUT with the conversations done so far "
                        "(default: no limit)")
    add_server_args(p)  # --backend openai: regeneration on an OpenAI-compatible server
    section_defaults(p, RegenerateConfig)  # the recipe's `regenerate` section is the source of the defaults
    return p


# --samples-per-prompt at most: each copy of a conversation is held in memory before the first answer
MAX_SAMPLES_PER_PROMPT = 1024


def _validate(args: argparse.Namespace) -> None:
    from nemo_dflash.engine.plain import AUTO_ROWS_CAP

    for name in ("num_samples", "max_new_tokens", "batch_size", "max_prompt_tokens", "samples_per_prompt"):
        value = getattr(args, name)
        if value is not None and value != "auto" and value < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.batch_size != "auto" and args.batch_size > AUTO_ROWS_CAP:
        fail(f"--batch-size {args.batch_size} is more answers in flight than any GPU holds: give at most "
             f"{AUTO_ROWS_CAP}, or auto (what the GPU's free memory holds)")
    if args.samples_per_prompt > MAX_SAMPLES_PER_PROMPT:
        fail(f"--samples-per-prompt {args.samples_per_prompt}: give at most {MAX_SAMPLES_PER_PROMPT} (each copy is "
             "held in memory); for more data add prompts (--num-samples, more --data)")
    if args.prepare_ahead < 0:
        fail(f"--prepare-ahead must be >= 0 (got {args.prepare_ahead})")
    if args.max_minutes is not None and not (math.isfinite(args.max_minutes) and args.max_minutes > 0):  # nan too
        fail(f"--max-minutes must be a number of minutes > 0 (got {args.max_minutes})")
    if args.max_bad_lines < 0:
        fail(f"--max-bad-lines must be >= 0 (got {args.max_bad_lines})")
    if args.holdout < 0:
        fail(f"--holdout must be >= 0 (got {args.holdout})")
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    if not args.out.endswith(".jsonl"):
        fail(f"--out must be a .jsonl file (got {args.out!r}); the data reader picks the format by extension")
    validate_server_args(args)


def check_fits_target(args: argparse.Namespace, device: str, dtype: str) -> None:
    """What the target's config.json (read as a file) and this machine bound, before the target loads: new tokens
    within its context, and the answers in flight's KV cache (at least --batch-size rows x --max-new-tokens
    positions) within the device's free memory: a one-line ValueError. A target whose config cannot be read here
    (a .gguf) is checked once it has loaded."""
    from types import SimpleNamespace

    import torch

    from nemo_dflash.train.device import free_memory_bytes
    from nemo_dflash.engine.batched_static import plain_cache_length
    from nemo_dflash.engine.plain import check_rows_fit, row_bytes, window_for
    from nemo_dflash.target.loading import target_text_config

    config = target_text_config(args.target)
    if config is None:
        return
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and args.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens: give at most {context - 1}")
    if args.backend == "openai" or args.batch_size == "auto":  # the server's memory; auto fits what is free
        return
    try:
        per_row = row_bytes(SimpleNamespace(**config), 1, getattr(torch, TORCH_DTYPES[dtype]))
    except (AttributeError, TypeError, ZeroDivisionError):
        return  # a config without the attention sizes: the engine's own check after the load
    length = plain_cache_length(1, args.max_new_tokens, window_for(torch.device(device)))
    free = free_memory_bytes(device)
    if free is not None:
        check_rows_fit(args.batch_size, length, per_row * length, free)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_sampling(temperature: Any, top_p: Any, t_name: str, p_name: str) -> None:
    """Refuse a sampling configuration that makes no sense: `engine.sampling.check_sampling`'s line, exit 2."""
    with user_errors(ValueError):
        check_sampling_values(temperature, top_p, names=(t_name, p_name, "top-k"))


def resolve_sampling(args: argparse.Namespace, model: Any) -> tuple[SamplingParams, str]:
    """(the sampling, where it came from): the target's recommended sampling when it has
    one (``generation_config`` with ``do_sample``), else the command line's."""
    if args.sampling == "greedy":
        return GREEDY, "greedy"
    gen = getattr(model, "generation_config", None)
    if args.sampling == "target" and gen is not None and getattr(gen, "do_sample", False):
        temperature = getattr(gen, "temperature", None)
        top_p = getattr(gen, "top_p", None)
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        check_sampling(temperature, top_p, "the target's generation_config temperature",
                       "the target's generation_config top_p")
        return SamplingParams(float(temperature), top_p=float(top_p)), "target generation_config"
    check_sampling(args.temperature, args.top_p, "--temperature", "--top-p")
    return SamplingParams(float(args.temperature), top_p=float(args.top_p)), "command line"


def holdout_path(out: Path) -> Path:
    """``regen.jsonl`` -> ``regen.holdout.jsonl``."""
    return out.with_name(out.name[: -len(".jsonl")] + ".holdout.jsonl")


_HITS: dict[str, Any] = {}  # what contaminated()'s forked workers read (the conversations and the index)


def _hits_block(span: tuple[int, int]) -> list[bool]:
    convs, index = _HITS["convs"], _HITS["index"]
    return [index.conversation_hits(c.messages, ("system", "user")) for c in convs[span[0]:span[1]]]


def contaminated(convs: list[Any], index: Any, workers: int = 1) -> list[bool]:
    """Whether each conversation's system or user turns share an n-gram with ``index``, in order; ``workers``
    forked processes check blocks side by side (50 s for 378,000 conversations on one core)."""
    from nemo_dflash.data.workers import fork_pool

    spans = [(a, min(a + 4096, len(convs))) for a in range(0, len(convs), 4096)]
    _HITS.update(convs=convs, index=index)
    try:
        with fork_pool(min(workers, len(spans))) as executor:
            parts = executor.map(_hits_block, spans) if executor is not None else map(_hits_block, spans)
            return [hit for part in parts for hit in part]
    finally:
        _HITS.clear()


def read_sources(entries: Sequence[str], max_bad: int, *, decontaminate: bool = False, seed: int = 0,
                 eval_files: Sequence[str] = (), workers: int = 1) -> tuple[list[Any], dict[str, str], list[dict[str, Any]]]:
    """Read every ``--data`` entry: (the pool, each conversation's source name by location, a report
    per source). Locations are unique across the pool (they key sampling and resuming); a copy
    added by a weight > 1 is located ``LOCATION~K``. ``decontaminate`` drops the conversations whose
    system or user turns share a 13-gram with the evaluation prompts. A missing, empty or unreadable
    source, or one left with nothing, is one line naming it (exit 2): all before a model loads."""
    from nemo_dflash.data import BadRecordCounter, Conversation, DataError, apply_weight
    from nemo_dflash.data.prompts import parse_source, read_source

    index = None
    if decontaminate:
        from nemo_dflash.data.decontaminate import evaluation_index

        try:
            index = evaluation_index(eval_files)
        except FileNotFoundError as e:
            fail(f"cannot decontaminate: {e}; install the evaluation packages (make install) or pass "
                 "--decontaminate off")
    bad = BadRecordCounter(max_bad)
    with user_errors(DataError):
        specs = [parse_source(e) for e in entries]
    names = [s.name for s in specs]
    for n in names:
        if names.count(n) > 1:
            fail(f"two --data entries are named {n!r}; name them apart with NAME=...")
    read: list[tuple[str, list[Any]]] = []
    for spec in specs:
        with user_errors(DataError, FileNotFoundError, OSError):
            read.append(read_source(spec, bad))
    seen_paths: set[str] = set()
    for spec, (what, _) in zip(specs, read):
        key = os.path.realpath(what) if os.path.exists(what) else what
        if key in seen_paths:
            fail(f"--data {spec.what} is given twice; pass each source once")
        seen_paths.add(key)
    basenames = [os.path.basename(what) for what, _ in read]
    pool: list[Any] = []
    dataset: dict[str, str] = {}
    report: list[dict[str, Any]] = []
    for si, (spec, (what, convs)) in enumerate(zip(specs, read)):
        if basenames.count(basenames[si]) > 1:  # same file name in two folders: spell the location with the path
            for conv in convs:
                conv.location = what + conv.location[len(basenames[si]):]
        if not convs:
            fail(f"--data {spec.name}: no usable conversations in {what}; check its layout (ShareGPT or OpenAI)")
        dropped = 0
        if index is not None:
            kept = [c for c, hit in zip(convs, contaminated(convs, index, workers)) if not hit]
            dropped = len(convs) - len(kept)
            if not kept:
                fail(f"--data {spec.name}: every one of its {len(convs)} prompts shares a {index.n}-gram with the "
                     f"{index.name}; it cannot train a draft evaluated on them: remove the source")
            convs = kept
        weighted = apply_weight(convs, spec.weight, seed=seed * 1000 + si)
        copies: dict[str, int] = {}
        for conv in weighted:
            k = copies.get(conv.location, 0)
            copies[conv.location] = k + 1
            if k:
                conv = Conversation(conv.messages, f"{conv.location}~{k}")
            if conv.location in dataset:
                fail(f"--data {spec.name}: {conv.location} is also in source {dataset[conv.location]!r}; "
                     "pass each source once")
            dataset[conv.location] = spec.name
            pool.append(conv)
        report.append({"name": spec.name, "source": what, "weight": spec.weight, "read": len(convs) + dropped,
                       "contaminated": dropped, "pool": len(weighted)})
        logger.info("%s (%s): %d conversations, %d dropped by decontamination, %d in the pool (weight %g)",
                    spec.name, what, len(convs) + dropped, dropped, len(weighted), spec.weight)
    return pool, dataset, report


def read_pool(paths: Sequence[str], max_bad: int) -> list[Any]:
    """All conversations of ``paths`` (``--data`` entries), with locations unique across files."""
    return read_sources(paths, max_bad)[0]


def with_samples(conversations: Sequence[Any], samples: int) -> list[Any]:
    """Each conversation ``samples`` times, the K-th copy (K >= 1) located ``LOCATION#K``: its own
    sampling key, so the answers differ and a run with more samples keeps the first one's answers."""
    import dataclasses

    return [c if k == 0 else dataclasses.replace(c, location=f"{c.location}#{k}")
            for c in conversations for k in range(samples)]


_SELECT: dict[str, Any] = {}  # what select's forked workers read (the pool and the tokenizer are not sent per job)


def _first_prompt_problem(i: int) -> Optional[str]:
    """Why conversation ``i`` of the pool cannot be a prompt (None: usable): a unit of :func:`select`."""
    from nemo_dflash.data.regenerate import prompt_problem, split_prompt

    system, users = split_prompt(_SELECT["pool"][i].messages, _SELECT["turns"])
    if not users:
        return "no_user_turn"
    return prompt_problem(_SELECT["tokenizer"], system + [{"role": "user", "content": users[0]}],
                          max_prompt_tokens=_SELECT["max_prompt_tokens"], specials=_SELECT["specials"])[1]


def select(pool: list[Any], tokenizer: Any, *, count: int, seed: int, turns: str,
           max_prompt_tokens: Optional[int], workers: int = 1) -> tuple[list[Any], dict[str, int], int]:
    """The first ``count`` usable conversations after a seeded shuffle, the skip reasons of the
    unusable ones seen on the way, and how many were examined. Rendering and tokenising each first
    prompt took 136 s for 175,000 conversations on one core, so ``workers`` forked processes examine
    them side by side, in order blocks: the result is the one-process result."""
    from collections import Counter

    from nemo_dflash.data.regenerate import special_token_strings
    from nemo_dflash.data.workers import fork_pool

    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    _SELECT.update(pool=pool, tokenizer=tokenizer, turns=turns, max_prompt_tokens=max_prompt_tokens,
                   specials=special_token_strings(tokenizer))
    chosen, skipped, examined = [], Counter(), 0
    try:
        with fork_pool(workers if len(pool) > 4096 else 1) as executor:
            while len(chosen) < count and examined < len(order):
                block = order[examined:examined + max(4096, 2 * (count - len(chosen)))]  # a little past what is needed
                reasons = (list(executor.map(_first_prompt_problem, block, chunksize=256)) if executor is not None
                           else map(_first_prompt_problem, block))
                for i, reason in zip(block, reasons):
                    if len(chosen) >= count:
                        break
                    examined += 1
                    if reason is not None:
                        skipped[reason] += 1
                    else:
                        chosen.append(pool[i])
    finally:
        _SELECT.clear()
    return chosen, dict(skipped), examined


# Why no conversation could be a prompt, by `select`'s skip reason: what to change.
_SKIP_FIXES = {
    "template_error": "the chat template of {target} fails to render them: fix the template (or point --target at a "
                      "model whose template renders)",
    "prompt_too_long": "every prompt is longer than --max-prompt-tokens (default: the context minus "
                       "--max-new-tokens): raise --max-prompt-tokens or lower --max-new-tokens",
    "special_tokens_in_prompt": "the prompts hold the tokenizer's special tokens: clean the data",
    "no_user_turn": "the records have no user turn: check the data's layout (ShareGPT or OpenAI)",
}


def no_usable_conversations(skipped: dict[str, int], target: str) -> str:
    """The one line for a selection that found nothing usable, naming the most common cause's fix."""
    if not skipped:
        return "no conversations to regenerate: check --data"
    reason = max(skipped, key=skipped.get)
    fix = _SKIP_FIXES.get(reason, "check --data and --target").format(target=target)
    return f"no usable conversations (skipped: {skipped}): {fix}"


def _holdout_record(conv: Any, turns: str) -> dict[str, Any]:
    from nemo_dflash.data.regenerate import split_prompt

    system, users = split_prompt(conv.messages, turns)
    return {"messages": system + [{"role": "user", "content": u} for u in users], "source": conv.location}


def write_jsonl_atomic(path: Path, records: Sequence[dict[str, Any]]) -> None:
    write_text_atomic(path, (json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_text_atomic(path: Path, chunks: Iterable[str]) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, flushed, renamed into place. A write that
    fails (a full disk, permissions) removes the temp file and is one line (exit 2); ``path`` keeps what it
    held."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        reason = write_error_reason(e)
        if reason is None:
            raise
        fail(f"cannot write {path} ({reason}): free space or fix the permissions, then run the same command again; "
             "what was written before is kept")


def _check_settings(partial: Path, meta: Path, settings: dict[str, Any]) -> None:
    """Refuse to continue ``partial`` unless its ``meta`` says it was made with ``settings``."""
    hint = f"pass --overwrite to start over, or delete {partial}"
    try:
        saved = json.loads(meta.read_text())
    except (OSError, ValueError):
        fail(f"{partial} is a partial output without readable settings ({meta}); {hint}")
    saved = {k: saved.get(k, _RESUME_DEFAULTS.get(k)) for k in _RESUME_KEYS}
    diff = [k for k in _RESUME_KEYS if saved[k] != settings.get(k)]
    if diff:
        details = ", ".join(f"{k}: {saved[k]!r} -> {settings.get(k)!r}" for k in diff)
        fail(f"{partial} was started with other settings ({details}); rerun with the same settings to "
             f"continue it, or {hint}")


def _journal_sources(path: Path, known: set[str], *, cut: bool, hint: str) -> set[str]:
    """The sources of the whole lines of journal ``path``; a torn last line (a kill mid-write) is cut
    off when ``cut`` (the journal is this process's), else skipped. A line that is not a record of
    this run (``known``), or a conversation twice, is one line naming ``hint``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # removed as stale by its rank
        return set()
    keep = data.rfind(b"\n") + 1
    if keep < len(data) and cut:
        logger.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
        with open(path, "r+b") as f:
            f.truncate(keep)
    done: set[str] = set()
    for lineno, line in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        try:
            source = json.loads(line)["source"]
        except (ValueError, KeyError, TypeError):
            source = None
        if source not in known or source in done:
            fail(f"{path}:{lineno} is not a record of this run; {hint}")
        done.add(source)
    return done


def _resume_done(partial: Path, meta: Path, settings: dict[str, Any], train: list[Any]) -> set[str]:
    """Sources of the conversations ``partial`` already holds, after checking it was made with ``settings``.

    A torn last line (killed mid-write) is cut off. Conversations are written as they end, so the
    ones not in the file (in flight at the kill) are simply redone: with keyed sampling a redone
    answer is the one the interrupted run would have written.
    """
    _check_settings(partial, meta, settings)
    return _journal_sources(partial, {c.location for c in train}, cut=True,
                            hint=f"pass --overwrite to start over, or delete {partial}")


def ranks_done(out: Path, rank: int, world: int, settings: dict[str, Any], known: set[str]) -> set[str]:
    """Sources of the conversations every rank's journal of ``out`` holds (journals being written and
    finished ones), each checked to be made with ``settings``: what no rank of this run redoes.
    Only this rank's own torn last line is cut; another rank's is skipped (never truncated here).
    A conversation in two ranks' journals is refused: the merge could not tell which to keep."""
    hint = f"pass --overwrite to start over (the journals are {out}.rank*-of-{world}.*)"
    owner: dict[str, int] = {}
    for r in range(world):
        f = rank_files(out, r, world)
        mine: set[str] = set()
        for path in (f["done"], f["partial"]):  # a partial left beside its finished file repeats it
            if path.exists():
                _check_settings(path, f["meta"], settings)
                mine |= _journal_sources(path, known, cut=r == rank and path == f["partial"], hint=hint)
        for source in mine:
            if owner.setdefault(source, r) != r:
                fail(f"{source} is in the journals of ranks {owner[source]} and {r}; {hint}")
    return set(owner)


def _drop_stale_partial(files: dict[str, Path]) -> None:
    """Remove this rank's journal when its finished file already holds every line of it (a kill
    between writing the finished file and removing the journal)."""
    partial, done = files["partial"], files["done"]
    if not (partial.exists() and done.exists()):
        return
    finished = set(done.read_text(encoding="utf-8").split("\n"))
    if all(line in finished for line in partial.read_text(encoding="utf-8").split("\n")):
        partial.unlink()


# A rank's files: OUT.rank{R}-of-{W}.partial / .partial.json / .jsonl / .stats.json (locks excluded).
_RANK_FILE = r"\.rank(\d+)-of-(\d+)\.(?:partial|partial\.json|jsonl|stats\.json)$"


def journal_worlds(out: Path) -> dict[int, list[Path]]:
    """The journals of ``out`` by the number of processes that wrote them: 1 for a single process's
    ``OUT.partial``, W for the ``OUT.rankR-of-W.*`` files of a torchrun run."""
    found: dict[int, list[Path]] = {}
    single = [p for p in (out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json"))
              if p.exists()]
    if single:
        found[1] = single
    if out.parent.is_dir():
        pattern = re.compile(re.escape(out.name) + _RANK_FILE)
        for p in sorted(out.parent.iterdir()):
            m = pattern.match(p.name)
            if m:
                found.setdefault(int(m.group(2)), []).append(p)
    return found


def check_world(out: Path, world: int, rank: int, overwrite: bool) -> None:
    """Refuse to continue journals written by another number of processes (their ranks' shares
    cannot be told apart); with ``overwrite`` rank 0 removes them instead."""
    others = {w: paths for w, paths in journal_worlds(out).items() if w != world}
    if not others:
        return
    if overwrite:
        if rank == 0:
            for paths in others.values():
                for p in paths:
                    p.unlink(missing_ok=True)
        return
    w = max(others)
    how = "one process (no torchrun)" if w == 1 else f"{w} ranks (torchrun --nproc-per-node {w})"
    now = "one process" if world == 1 else f"{world} ranks"
    fail(f"{out} has the journals of a run on {how}, not {now}: continue it on {how}, or pass --overwrite to "
         "start over")


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        fail("RANK, WORLD_SIZE and LOCAL_RANK must be integers; launch several ranks with torchrun")
    if world < 1 or not 0 <= rank < world:
        fail(f"RANK {rank} is not in [0, WORLD_SIZE {world}); launch several ranks with torchrun")
    return rank, world, local


def rank_files(out: Path, rank: int, world: int) -> dict[str, Path]:
    """Where rank ``rank`` of ``world`` journals its shard: ``partial`` (written as answers end),
    ``meta`` (its settings), ``done`` (the finished shard), ``stats`` and ``lock`` (held while it runs:
    one writer per output; rank 0 holds ``out``'s own). One rank writes ``out``'s own partial files and
    ``out`` itself."""
    if world == 1:
        return {"partial": out.with_name(out.name + ".partial"), "meta": out.with_name(out.name + ".partial.json"),
                "done": out, "stats": out.with_name(out.name + ".stats.json"), "lock": out.with_name(out.name + ".lock")}
    stem = f"{out.name}.rank{rank}-of-{world}"
    return {"partial": out.with_name(stem + ".partial"), "meta": out.with_name(stem + ".partial.json"),
            "done": out.with_name(stem + ".jsonl"), "stats": out.with_name(stem + ".stats.json"),
            "lock": out.with_name((out.name if rank == 0 else stem) + ".lock")}


def _finish_output(partial: Path, out: Path, order: dict[str, int]) -> int:
    """Write ``out`` atomically from ``partial``, in selection order (so a resumed run's file is the
    uninterrupted run's); the number of conversations."""
    lines = [line for line in partial.read_text(encoding="utf-8").split("\n") if line]
    lines.sort(key=lambda line: order[json.loads(line)["source"]])
    write_text_atomic(out, (line + "\n" for line in lines))
    partial.unlink()
    return len(lines)


def reasoning_modes(reasoning: Optional[str], target: str) -> list[Optional[str]]:
    """The thinking modes to answer in; refuses ``--reasoning`` for a template without a switch
    (checked on the tokenizer alone, before the model loads)."""
    if reasoning is None:
        return [None]
    from nemo_dflash.data.chat_template import has_thinking_switch
    from nemo_dflash.target.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(target)
    except (OSError, ValueError) as e:
        fail(f"cannot load the tokenizer of --target {target}: {e}")
    if not has_thinking_switch(tokenizer):
        fail(f"--reasoning {reasoning}: the chat template of {target} has no thinking switch (enable_thinking); "
             "drop --reasoning")
    return ["on", "off"] if reasoning == "both" else [reasoning]


def in_modes(conversations: Sequence[Any], modes: Sequence[Optional[str]]) -> list[Any]:
    """Each conversation once per mode, its source tagged with the mode (``#reasoning=off``) so a
    resumed run and the output order tell the copies apart."""
    from nemo_dflash.data.sources import Conversation

    if modes == [None]:
        return list(conversations)
    return [Conversation(messages=c.messages, location=f"{c.location}#reasoning={m}", reasoning=m)
            for m in modes for c in conversations]


def regenerate_in_modes(regenerate: Any, modes: Sequence[Optional[str]], model: Any, tokenizer: Any,
                        conversations: Union[Sequence[Any], Callable[[Optional[str]], Iterable[Any]]],
                        **kwargs: Any) -> Any:
    """``regenerate(model, tokenizer, conversations, **kwargs)`` once per thinking mode, the
    tokenizer rendering every prompt in that mode; each record gets ``"reasoning"``.
    ``conversations`` may be a function of the mode giving that mode's conversations (a rank's
    share of a queue, claimed as the engine admits them)."""
    def of_mode(mode: Optional[str]) -> Iterable[Any]:
        if callable(conversations):
            return conversations(mode)
        return [c for c in conversations if getattr(c, "reasoning", None) == mode]

    if modes == [None]:
        return regenerate(model, tokenizer, conversations(None) if callable(conversations) else conversations,
                          **kwargs)
    from nemo_dflash.data.chat_template import ReasoningTokenizer

    def run() -> Any:
        for mode in modes:
            mine = of_mode(mode)
            if isinstance(mine, list) and not mine:
                continue
            for record in regenerate(model, ReasoningTokenizer(tokenizer, mode), mine, **kwargs):
                record["reasoning"] = mode
                yield record

    return run()


_SUMMED = ("written_this_run", "turns", "answers", "answer_tokens", "looping_before", "looping_after",
           "capped_before", "capped_after", "prompt_tokens", "prefill_tokens", "reused_tokens", "prefix_mismatch",
           "generated_tokens", "todo")
_COUNTED = ("finish", "skipped_generation", "shortened")


def _merge_ranks(out: Path, world: int, order: dict[str, int]) -> list[dict[str, Any]]:
    """Rank 0: write ``out`` from the ranks' finished shards, in selection order (the bytes a
    single-process run writes), then remove the rank files; the ranks' stats."""
    files = [rank_files(out, r, world) for r in range(world)]
    missing = [r for r, f in enumerate(files) if not f["done"].exists() or f["partial"].exists()]
    if missing:
        fail(f"rank(s) {missing} of {world} have not finished their share; rerun the same command to continue them")
    lines: list[str] = []
    for f in files:
        lines.extend(line for line in f["done"].read_text(encoding="utf-8").split("\n") if line)
    keyed = sorted((order[json.loads(line)["source"]], line) for line in lines)
    if len({k for k, _ in keyed}) != len(keyed):
        fail(f"the rank shards of {out} hold a conversation twice; pass --overwrite to start over")
    write_text_atomic(out, (line + "\n" for _, line in keyed))
    stats = []
    for f in files:
        stats.append(json.loads(f["stats"].read_text()))
        for key in ("done", "meta", "stats"):
            f[key].unlink(missing_ok=True)
    return stats


def _finish_rank(partial: Path, done: Path, order: dict[str, int]) -> int:
    """Write this rank's finished file atomically from its journal and what an earlier run of it
    finished, in selection order, then remove the journal; the number of conversations."""
    lines: list[str] = []
    for path in (done, partial):
        if path.exists():
            lines.extend(line for line in path.read_text(encoding="utf-8").split("\n") if line)
    keyed = sorted((order[json.loads(line)["source"]], line) for line in lines)
    if len({k for k, _ in keyed}) != len(keyed):
        fail(f"{partial} repeats a conversation of {done}; pass --overwrite to start over")
    write_text_atomic(done, (line + "\n" for _, line in keyed))
    partial.unlink(missing_ok=True)
    return len(keyed)


def rank_balance(parts: Sequence[dict[str, Any]], idle: Sequence[Optional[float]]) -> tuple[list[dict[str, Any]], Optional[float]]:
    """Per rank (this run): conversations written, turns, generated tokens, seconds generating and
    seconds idle at the final barrier (None without one); and the ranks' imbalance, the slowest
    rank's generation seconds over the fastest's (None when a rank generated nothing)."""
    detail = [{"rank": p.get("rank", r), "conversations": p["written_this_run"], "turns": p["turns"],
               "generated_tokens": p["generated_tokens"], "generate_seconds": p["generate_seconds"],
               "idle_seconds": idle[r]} for r, p in enumerate(parts)]
    seconds = [d["generate_seconds"] for d in detail]
    imbalance = round(max(seconds) / min(seconds), 3) if min(seconds) > 0 else None
    return detail, imbalance


def _combine(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' stats as one: counts summed, seconds the slowest rank's."""
    from collections import Counter

    total: dict[str, Any] = {k: sum(p[k] for p in parts) for k in _SUMMED}
    for k in _COUNTED:
        c: Counter = Counter()
        for p in parts:
            c.update(p[k])
        total[k] = dict(c)
    total["regenerate_seconds"] = max(p["regenerate_seconds"] for p in parts)
    total["generate_seconds"] = max(p["generate_seconds"] for p in parts)
    # the slowest rank's regeneration without its one-time compile and capture (start-up, not throughput)
    total["after_capture_seconds"] = max(p["regenerate_seconds"] - p.get("capture_seconds", 0.0) for p in parts)
    total["capture_seconds"] = max(p.get("capture_seconds", 0.0) for p in parts)
    total["halted"] = any(p["halted"] for p in parts)
    return total


def per_source_counts(report: dict[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per source of the data report (:func:`nemo_dflash.data.report.data_report`, made with the
    tokenizer): conversations, answered turns and supervised tokens (each answer's tokens plus its
    end-of-turn token), in ``names`` order; a source left with no conversation counts zeros."""
    rows = {r["name"]: r for r in report["sources"]}
    return [{"name": n, **{k: rows[n][k] if n in rows else 0 for k in ("conversations", "turns", "supervised_tokens")}}
            for n in names]


def check_shares(report: Sequence[dict[str, Any]], batch_size: int, *, capped: bool) -> None:
    """Refuse a time-capped mix one of whose sources cannot fill its share (exit 2, before any answer): a
    source with fewer conversations than half its weight's share of the answers in flight runs out in the
    engine's first fill, and the rest of the budget goes to the others. Uncapped runs answer every
    selected prompt: their mix is the pool's (the weights repeat or subsample each source)."""
    if not capped or len(report) < 2:
        return
    total = sum(r["weight"] for r in report)
    for r in report:
        need = 0.5 * r["weight"] / total * batch_size
        if r["pool"] < need:
            fail(f"--data {r['name']}: {r['pool']} conversations cannot fill its share ({r['weight']:g} of "
                 f"{total:g}) of the {batch_size} answers in flight under --max-minutes (half of it is "
                 f"{need:.0f}): add prompts to it, lower its weight, or lower --batch-size")


def achieved_mix(counts: Sequence[dict[str, Any]], report: Sequence[dict[str, Any]], *,
                 interleaved: bool) -> dict[str, Any]:
    """The mix written against the one asked, by supervised tokens: per source its weight's share, its share
    of the supervised tokens and whether that is under half the asked share (the run warns)."""
    total_w = sum(r["weight"] for r in report)
    tokens = {c["name"]: c["supervised_tokens"] for c in counts}
    total_t = sum(tokens.values())
    rows = []
    for r in report:
        asked = r["weight"] / total_w
        achieved = tokens.get(r["name"], 0) / total_t if total_t else 0.0
        rows.append({"name": r["name"], "weight": r["weight"], "asked": round(asked, 4),
                     "achieved": round(achieved, 4), "supervised_tokens": tokens.get(r["name"], 0),
                     "under_half": len(report) > 1 and achieved < 0.5 * asked})
    return {"by": "supervised_tokens", "interleaved": interleaved, "sources": rows}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    setup_logging()
    _validate(args)
    set_threads(args.threads)
    rank, world, local_rank = dist_env()
    if args.backend == "openai" and world > 1:
        fail("--backend openai runs in one process (the server spreads the work): drop torchrun and raise "
             "--concurrency instead")
    with user_errors():  # --device cuda without a GPU: refused before any file is read
        device, dtype = resolve_device_dtype(args.device, args.dtype)
    # new tokens within the target's context, the KV cache within this rank's device's free memory
    with user_errors(ValueError):
        check_fits_target(args, f"cuda:{local_rank}" if device == "cuda" and world > 1 else device, dtype)
    from nemo_dflash.data import DataError

    wall0 = time.perf_counter()
    out = Path(args.out)
    files = rank_files(out, rank, world)
    held = holdout_path(out) if args.holdout else None
    # every file this run writes, checked at once: never an input, replaced only with --overwrite, writable
    with user_errors(OutputError, DataError, OSError):
        guard_outputs(output_places(args, files, held, world), input_places(args), args.overwrite)
    lock = FileLock(files["lock"])
    with user_errors(OSError):  # an --out folder that cannot be made (permissions, a file in the way)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire()
        except (LockBusyError, LockReplacedError) as e:
            holder = f" (pid {e.holder})" if isinstance(e, LockBusyError) else ""
            raise OSError(f"--out {out} is being written by another regenerate{holder}: wait for it to end, or "
                          "choose another --out") from None
    try:
        return _run(args, out, files, held, rank, world, local_rank, device, dtype, wall0)
    finally:
        lock.release(remove=True)


def output_places(args: argparse.Namespace, files: dict[str, Path], held: Optional[Path],
                  world: int) -> list[Output]:
    """What a run writes: --out, the holdout file and --summary-json (each replaced only with --overwrite;
    the holdout file of a partial output being continued is kept), and its journal (continued)."""
    resuming = world in journal_worlds(Path(args.out))
    places = [Output(Path(args.out), "--out")]
    if held is not None:
        places.append(Output(held, "--holdout's file", may_exist=resuming))
    if args.summary_json:
        places.append(Output(Path(args.summary_json), "--summary-json"))
    journal = ("partial", "meta", "stats") if world == 1 else ("partial", "meta", "stats", "done")
    places += [Output(files[k], "--out's journal", may_exist=True) for k in journal]
    return places


def input_places(args: argparse.Namespace) -> list[tuple[str, str]]:
    """What a run reads, as files: each --data entry's file (its NAME= and @WEIGHT taken off) and a local
    --target."""
    from nemo_dflash.data.prompts import parse_source

    found = [("--target", args.target)] if os.path.exists(args.target) else []
    for entry in args.data:
        spec = parse_source(entry)
        if spec.builtin is None:
            found.append(("--data", spec.what))
    return found


def _run(args: argparse.Namespace, out: Path, files: dict[str, Path], held: Optional[Path], rank: int, world: int,
         local_rank: int, device: str, dtype: str, wall0: float) -> dict[str, Any]:
    """The run, once its outputs are checked and locked."""
    from tqdm import tqdm

    from nemo_dflash.data import DataError
    from nemo_dflash.data.regenerate import RegenStats, regenerate_conversations
    from nemo_dflash.target.loading import load_target

    partial, meta = files["partial"], files["meta"]
    check_world(out, world, rank, args.overwrite)
    server = None
    if args.backend == "openai":  # the endpoint checked before anything is read, removed or sent
        from nemo_dflash.recipes._regen_server import connect_server

        server = connect_server(args)
    if args.overwrite:
        for key in ("partial", "meta", "stats") if world == 1 else ("partial", "meta", "stats", "done"):
            files[key].unlink(missing_ok=True)

    with user_errors(DataError, FileNotFoundError):  # ... or `--data sharegpt` without its package
        from nemo_dflash.data.workers import default_workers

        pool, dataset, report = read_sources(args.data, args.max_bad_lines, decontaminate=args.decontaminate == "on",
                                             seed=args.seed, eval_files=args.eval_file,
                                             workers=default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if args.batch_size != "auto":  # before the target loads (auto is known once it has)
        check_shares(report, args.batch_size, capped=args.max_minutes is not None)
    modes = reasoning_modes(args.reasoning, args.target)
    group = world > 1 and "MASTER_ADDR" in os.environ
    if group:  # only for the barrier before rank 0 merges: ranks exchange files, not tensors
        import datetime

        import torch.distributed as dist

        from nemo_dflash.train.distributed import init_process_group

        init_process_group("gloo", datetime.timedelta(days=7))
    if device == "cuda" and world > 1:
        import torch

        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if server is not None:  # the answers come from the server: the target's tokenizer and config only
        from nemo_dflash.recipes._regen_server import server_target

        model, tokenizer = server_target(args, *server)
    else:
        logger.info("loading target %s (%s, %s)", args.target, device, dtype)
        try:
            model, tokenizer = load_target(args.target, dtype=dtype, device=device)
        except (FileNotFoundError, OSError, ValueError) as e:
            fail(f"cannot load --target {args.target}: {e}")
    if not getattr(tokenizer, "chat_template", None):
        fail(f"the tokenizer of {args.target} has no chat template; regeneration prompts the target with its own "
             "template: point --target at the instruct model")

    max_prompt = args.max_prompt_tokens
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:
        if args.max_new_tokens >= context:
            fail(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's context of "
                 f"{context} tokens: give at most {context - 1}")
        if max_prompt is None:
            max_prompt = context - args.max_new_tokens
        if max_prompt + args.max_new_tokens > context:
            fail(f"--max-prompt-tokens {max_prompt} + --max-new-tokens {args.max_new_tokens} exceeds the model's "
                 f"context of {context} tokens; lower one of them")

    if server is not None:
        args.batch_size = args.concurrency  # answers in flight: the server's requests
    elif args.batch_size == "auto":
        from nemo_dflash.engine.plain import auto_rows, max_rows

        fit = (max_rows(model, max_prompt, args.max_new_tokens)
               if args.engine == "slots" and max_prompt is not None else None)
        args.batch_size = auto_rows(fit)
        logger.info("--batch-size auto: %d answers in flight%s", args.batch_size,
                    f" ({fit} fit in the GPU's free memory)" if fit is not None else "")
    elif args.engine == "slots" and max_prompt is not None:
        from nemo_dflash.engine.plain import max_rows

        fit = max_rows(model, max_prompt, args.max_new_tokens)
        if fit is not None and args.batch_size > fit:
            fail(f"--batch-size {args.batch_size}: the KV cache of only {fit} answers fits in the GPU's free memory; "
                 "lower it, or pass --batch-size auto")

    check_shares(report, args.batch_size, capped=args.max_minutes is not None)
    want = (args.num_samples if args.num_samples is not None else len(pool)) + args.holdout
    from nemo_dflash.data.workers import default_workers

    workers = default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # every rank on the host selects
    chosen, select_skipped, examined = select(pool, tokenizer, count=want, seed=args.seed, turns=args.turns,
                                              max_prompt_tokens=max_prompt, workers=workers)
    del pool
    if not chosen:
        fail(no_usable_conversations(select_skipped, args.target))
    if len(chosen) <= args.holdout:
        fail(f"only {len(chosen)} usable conversations (skipped: {select_skipped}); lower --holdout {args.holdout}")
    if len(chosen) < want:
        logger.warning("only %d usable conversations of %d wanted (skipped: %s)", len(chosen), want, select_skipped)
    train, holdout = chosen[: len(chosen) - args.holdout], chosen[len(chosen) - args.holdout:]
    train = in_modes(train, modes)
    for conv in train:  # a thinking-mode copy belongs to its original's source
        dataset.setdefault(conv.location, dataset.get(conv.location.split("#reasoning=")[0]))
    logger.info("selected %d conversations to regenerate and %d held out (examined %d; skipped %s)",
                len(train), len(holdout), examined, select_skipped or "none")
    train = with_samples(train, args.samples_per_prompt)
    for i, conv in enumerate(train):  # the copies of --samples-per-prompt belong to their original's source
        dataset[conv.location] = dataset[train[i - i % args.samples_per_prompt].location]

    sampling, sampling_from = resolve_sampling(args, model)
    temperature, top_p = sampling.temperature, sampling.top_p
    logger.info("sampling: %s (%s)", sampling.label, sampling_from)
    settings = {k: getattr(args, k) for k in _RESUME_KEYS}
    settings.update(data=[[r["name"], os.path.realpath(r["source"]) if os.path.exists(r["source"]) else r["source"],
                           r["weight"]] for r in report],
                    max_prompt_tokens=max_prompt, temperature=temperature, top_p=top_p)
    if server is not None:
        settings["model"] = model.endpoint.model  # the served name, also when --model left it to the server
    order = {c.location: i for i, c in enumerate(train)}
    done: set[str] = set()
    queues: dict[Optional[str], Any] = {}
    if world == 1:
        if partial.exists():
            done = _resume_done(partial, meta, settings, train)
            logger.warning("continuing %s: %d of %d conversations already done", partial, len(done), len(train))
        else:
            write_jsonl_atomic(meta, [settings])  # one JSON line: readable with json.loads
    else:
        if not args.overwrite:  # every rank reads every rank's journals: what is done is done by no one again
            done = ranks_done(out, rank, world, settings, set(order))
        if not (partial.exists() or files["done"].exists()):
            write_jsonl_atomic(meta, [settings])
        if group:
            dist.barrier()  # all journals read before any rank writes to its own
        _drop_stale_partial(files)
        if done:
            logger.warning("continuing %s: %d of %d conversations already done (journals of %d ranks)", out,
                           len(done), len(train), world)
    schedule = args.schedule
    if group:  # the ranks share one queue per thinking mode, in start order (the longest chains first)
        import torch
        from nemo_dflash.data.regenerate import start_order
        from nemo_dflash.data.work_queue import (SharedQueue, call_prefix, process_group_store, queue_block,
                                                 queue_chunk)

        store, chunk = process_group_store(), queue_chunk(args.batch_size)
        prefix = call_prefix(store, world)
        # a block of the queue is every rank's first fill (slots differ by rank with --batch-size auto): the sum
        fills = torch.tensor([2 * args.batch_size + args.prepare_ahead], dtype=torch.int64)
        dist.all_reduce(fills)
        block = queue_block(int(fills.item()), chunk)
        for mode in modes:
            left = [c for c in train if c.location not in done and getattr(c, "reasoning", None) == mode]
            if args.max_minutes is not None and len(report) > 1:  # a static interleave: see the warning below
                from nemo_dflash.data.regenerate import SourceMix

                fresh = SourceMix({r["name"]: r["weight"] for r in report}, dataset, prior_tokens=1.0)
                ordered = [c for _, c in fresh.order(left, args.turns)]
            else:
                ordered = start_order(left, args.schedule, args.turns)
            queues[mode] = SharedQueue(store, f"{prefix}next/{mode}", ordered, chunk, block, rank, world)
        todo: Any = lambda mode: queues[mode]  # noqa: E731
        schedule = "given"
        logger.info("%d ranks share a queue of %d conversations (%d taken at a time, cross-sections of blocks of "
                    "%d; the first block dealt, the others claimed)", world, len(train) - len(done), chunk, block * chunk)
    else:  # one process, or a rank started alone: its static shard
        todo = [c for c in train[rank::world] if c.location not in done]
        if world > 1:
            logger.warning("rank %d of %d alone (no process group): its static shard, %d conversations left",
                           rank, world, len(todo))

    stats = RegenStats()
    bar = tqdm(total=None if queues else len(todo), unit="conv", desc="regenerate", file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 15.0, disable=rank != 0)
    t0 = time.perf_counter()

    def progress(finished: int, new_tokens: int) -> None:
        if finished:
            bar.update(finished)
        elapsed = max(time.perf_counter() - t0, 1e-6)
        bar.set_postfix(tok_s=f"{stats.generated_tokens / elapsed:.1f}", tokens=stats.generated_tokens,
                        refresh=False)

    budget_s = None if args.max_minutes is None else args.max_minutes * 60.0

    def out_of_time() -> bool:
        """Checked as answers end: once the budget is spent no new conversation or turn starts, and
        the conversations that are complete are written."""
        return budget_s is not None and time.perf_counter() - wall0 >= budget_s

    mix = None
    if args.max_minutes is not None and len(report) > 1:  # a time cap keeps the asked mix (SourceMix)
        if queues:
            logger.warning("--max-minutes with %d ranks sharing a queue: the sources are interleaved by weight in user "
                           "turns, not in supervised tokens (answer lengths are not known when the queue is made; one "
                           "process interleaves by tokens); the achieved mix is reported", world)
        else:
            from nemo_dflash.data.regenerate import SourceMix

            mix = SourceMix({r["name"]: r["weight"] for r in report}, dataset, prior_tokens=args.max_new_tokens / 2)
            logger.info("--max-minutes: the sources are interleaved by weight in supervised tokens (%s)",
                        ", ".join(f"{r['name']} {r['weight']:g}" for r in report))
    generate: Callable[..., Any] = regenerate_conversations
    if server is not None:  # the same arguments, the answers from the server
        from nemo_dflash.data.openai_backend import regenerate_on_server as generate
    with user_errors(ValueError):  # the engine cannot run this target (checked at the call)
        records = regenerate_in_modes(
            generate, modes, model, tokenizer, todo, max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            batch_size=args.batch_size, turns=args.turns, seed=args.seed, max_prompt_tokens=max_prompt,
            engine=args.engine, loops=args.loops, capped=args.capped, after_cut=args.after_cut,
            prepare_ahead=args.prepare_ahead, schedule=schedule,
            stats=stats, progress=progress, should_stop=out_of_time, **({"mix": mix} if mix is not None else {}),
        )
    try:
        with open(partial, "a", encoding="utf-8") as f:
            for record in records:
                record["dataset"] = dataset[record["source"]]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        bar.close()
        from nemo_dflash.data.openai_backend import ServerUnavailable

        if isinstance(e, ServerUnavailable):  # every conversation finished is in the journal
            fail(f"the server stopped answering: {e}; {partial} keeps the conversations finished: restart the "
                 "server and run the same command to continue")
        reason = write_error_reason(e)
        if reason is not None:  # a full disk: the whole lines written are kept, a torn last one is cut on resume
            fail(f"cannot write {partial} ({reason}): free space or fix the permissions, then run the same "
                 "command again to continue it")
        logger.error("regeneration stopped; %s keeps what was written: rerun the same command to continue it",
                     partial)
        raise
    bar.close()
    if stats.halted:
        logger.warning("--max-minutes %.1f reached: finishing %s with the conversations done (%d this run)",
                       args.max_minutes, files["done"], stats.written)
    gen_time = time.perf_counter() - t0
    mine = {
        "written_this_run": stats.written, "turns": stats.turns, "answers": stats.answers,
        "answer_tokens": stats.answer_tokens, "looping_before": stats.looping_before,
        "looping_after": stats.looping_after, "capped_before": stats.capped_before, "capped_after": stats.capped_after,
        "prompt_tokens": stats.prompt_tokens, "prefill_tokens": stats.prefill_tokens,
        "reused_tokens": stats.reused_tokens, "prefix_mismatch": stats.prefix_mismatch,
        "generated_tokens": stats.generated_tokens, "finish": dict(stats.finish),
        "todo": sum(q.claimed for q in queues.values()) if queues else len(todo), "rank": rank,
        "skipped_generation": dict(stats.skipped), "shortened": dict(stats.shortened),
        "generate_seconds": round(stats.seconds, 2), "regenerate_seconds": round(gen_time, 2), "halted": stats.halted,
        "capture_seconds": round(stats.phase_seconds.get("capture", 0.0), 2),
    }
    idle: list[Optional[float]] = [None] * world
    if world == 1:
        _finish_output(partial, files["done"], order)
        meta.unlink(missing_ok=True)
        parts = [mine]
    else:
        _finish_rank(partial, files["done"], order)
        write_jsonl_atomic(files["stats"], [mine])
        if group:
            waited = time.perf_counter()
            dist.barrier()  # every rank's finished file is written
            dist.all_gather_object(idle, round(time.perf_counter() - waited, 2))
            dist.destroy_process_group()
        if rank != 0:
            logger.warning("rank %d: %d conversations written to %s; rank 0 merges", rank, stats.written,
                           files["done"])
            return {"shard": str(files["done"]), **mine, "idle_seconds": idle[rank]}
        parts = _merge_ranks(out, world, order)
    if held is not None and rank == 0:
        write_jsonl_atomic(held, [_holdout_record(c, args.turns) for c in holdout])
    total = _combine(parts)
    ranks_detail, imbalance = rank_balance(parts, idle if world > 1 else [0.0])
    for d in ranks_detail:
        logger.info("rank %d: %d conversations, %d turns, %d generated tokens, %.1fs generating, %s idle at the "
                    "final barrier", d["rank"], d["conversations"], d["turns"], d["generated_tokens"],
                    d["generate_seconds"], "-" if d["idle_seconds"] is None else f"{d['idle_seconds']:.1f}s")
    with open(out, encoding="utf-8") as f:
        total_written = sum(1 for _ in f)

    wall = time.perf_counter() - wall0
    gen_time = total["regenerate_seconds"]
    summary = {
        "out": str(out),
        "written": total_written,
        "written_this_run": total["written_this_run"],
        "resumed_done": total_written - total["written_this_run"],
        "stopped_at_max_minutes": total["halted"],
        "ranks": world,
        "holdout": str(held) if held is not None else None,
        "holdout_written": len(holdout),
        "samples_per_prompt": args.samples_per_prompt,
        "decontamination": {"checked": sum(r["read"] for r in report) if args.decontaminate == "on" else 0,
                            "dropped": sum(r["contaminated"] for r in report)},
        "data_sources": report,
        **{k: total[k] for k in ("turns", "answers", "answer_tokens", "looping_before", "looping_after",
                                 "capped_before", "capped_after")},
        "sampling": {"temperature": temperature, "top_p": top_p, "from": sampling_from},
        "engine": args.engine,
        "backend": args.backend,
        **({"server": model.summary()} if server is not None else {}),
        "loops": args.loops,
        "capped": args.capped,
        "after_cut": args.after_cut,
        "reasoning": args.reasoning,
        "finish": total["finish"],
        "skipped_selection": select_skipped,
        "skipped_generation": total["skipped_generation"],
        "shortened": total["shortened"],
        **{k: total[k] for k in ("prompt_tokens", "prefill_tokens", "reused_tokens", "prefix_mismatch",
                                 "generated_tokens", "generate_seconds")},
        "regenerate_seconds": round(gen_time, 2),
        "wall_seconds": round(wall, 2),
        "tokens_per_s": round(total["generated_tokens"] / gen_time, 2) if gen_time > 0 else 0.0,
        "capture_seconds": total["capture_seconds"],
        "tokens_per_s_after_capture": (round(total["generated_tokens"] / total["after_capture_seconds"], 2)
                                       if total["after_capture_seconds"] > 0 else 0.0),
        "end_to_end_tokens_per_s": round(total["generated_tokens"] / wall, 2) if wall > 0 else 0.0,
        "conversations_per_s": round(total["todo"] / gen_time, 3) if gen_time > 0 else 0.0,
        "ranks_detail": ranks_detail,
        "rank_imbalance": imbalance,
    }
    from nemo_dflash.data.report import report_dir, write_report

    summary["report"] = write_report(out, report_dir(out), tokenizer=tokenizer)
    made = json.loads(Path(summary["report"]["json"]).read_text(encoding="utf-8"))  # tokenised every answer once
    summary["sources"] = per_source_counts(made, [r["name"] for r in report])
    summary["mix"] = achieved_mix(summary["sources"], report, interleaved=mix is not None)
    short = [m for m in summary["mix"]["sources"] if m["under_half"]]
    if short:
        logger.warning("data mix: %s got under half of its share of the supervised tokens (%s): add prompts to "
                       "it, or lower its weight", ", ".join(m["name"] for m in short),
                       "; ".join(f"{m['name']} {m['achieved']:.1%} of {m['asked']:.1%} asked" for m in short))
    if args.summary_json:
        write_jsonl_atomic(Path(args.summary_json), [summary])
    logger.info("%s", stats.summary())
    logger.info("wrote %d conversations to %s%s in %.1fs (regeneration %.1fs: %.2f conv/s, %.1f tokens/s; "
                "%.1f tokens/s end to end)", total_written, out,
                f" and {len(holdout)} held-out prompts to {held}" if held else "", wall, gen_time,
                summary["conversations_per_s"], summary["tokens_per_s"], summary["end_to_end_tokens_per_s"])
    return summary


if __name__ == "__main__":
    main()
