"""Which conversations a regeneration answers: the prompt sources read and decontaminated, the seeded
selection of usable prompts, their copies (samples, thinking modes) and the held-out prompts.

Every step is deterministic given the seed (forked workers examine blocks in order), so a resumed or
multi-rank run selects exactly what one uninterrupted process selects. A problem the user fixes (a
missing source, a source left empty, a mix that cannot be filled) is a `DataError` naming the fix.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_dflash.data.sources import DataError

logger = logging.getLogger("nemo_dflash.regenerate")


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
    from nemo_dflash.data.sources import BadRecordCounter, Conversation, apply_weight
    from nemo_dflash.data.prompts import parse_source, read_source

    index = None
    if decontaminate:
        from nemo_dflash.data.decontaminate import evaluation_index

        try:
            index = evaluation_index(eval_files)
        except FileNotFoundError as e:
            raise DataError(f"cannot decontaminate: {e}; install the evaluation packages (make install) or pass "
                            "--decontaminate off") from None
    bad = BadRecordCounter(max_bad)
    specs = [parse_source(e) for e in entries]
    names = [s.name for s in specs]
    for n in names:
        if names.count(n) > 1:
            raise DataError(f"two --data entries are named {n!r}; name them apart with NAME=...")
    read: list[tuple[str, list[Any]]] = []
    for spec in specs:
        try:
            read.append(read_source(spec, bad))
        except OSError as e:  # a missing or unreadable file: one line naming it
            raise DataError(str(e)) from e
    seen_paths: set[str] = set()
    for spec, (what, _) in zip(specs, read):
        key = os.path.realpath(what) if os.path.exists(what) else what
        if key in seen_paths:
            raise DataError(f"--data {spec.what} is given twice; pass each source once")
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
            raise DataError(f"--data {spec.name}: no usable conversations in {what}; check its layout (ShareGPT or "
                            "OpenAI)")
        dropped = 0
        if index is not None:
            kept = [c for c, hit in zip(convs, contaminated(convs, index, workers)) if not hit]
            dropped = len(convs) - len(kept)
            if not kept:
                raise DataError(f"--data {spec.name}: every one of its {len(convs)} prompts shares a {index.n}-gram "
                                f"with the {index.name}; it cannot train a draft evaluated on them: remove the source")
            convs = kept
        weighted = apply_weight(convs, spec.weight, seed=seed * 1000 + si)
        copies: dict[str, int] = {}
        for conv in weighted:
            k = copies.get(conv.location, 0)
            copies[conv.location] = k + 1
            if k:
                conv = Conversation(conv.messages, f"{conv.location}~{k}")
            if conv.location in dataset:
                raise DataError(f"--data {spec.name}: {conv.location} is also in source "
                                f"{dataset[conv.location]!r}; pass each source once")
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


def holdout_record(conv: Any, turns: str) -> dict[str, Any]:
    from nemo_dflash.data.regenerate import split_prompt

    system, users = split_prompt(conv.messages, turns)
    return {"messages": system + [{"role": "user", "content": u} for u in users], "source": conv.location}


def holdout_path(out: Path) -> Path:
    """``regen.jsonl`` -> ``regen.holdout.jsonl``."""
    return out.with_name(out.name[: -len(".jsonl")] + ".holdout.jsonl")


def in_modes(conversations: Sequence[Any], modes: Sequence[Optional[str]]) -> list[Any]:
    """Each conversation once per mode, its source tagged with the mode (``#reasoning=off``) so a
    resumed run and the output order tell the copies apart."""
    from nemo_dflash.data.sources import Conversation

    if modes == [None]:
        return list(conversations)
    return [Conversation(messages=c.messages, location=f"{c.location}#reasoning={m}", reasoning=m)
            for m in modes for c in conversations]



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
            raise DataError(f"--data {r['name']}: {r['pool']} conversations cannot fill its share ({r['weight']:g} "
                            f"of {total:g}) of the {batch_size} answers in flight under --max-minutes (half of it is "
                            f"{need:.0f}): add prompts to it, lower its weight, or lower --batch-size")


def choose_conversations(pool: list[Any], tokenizer: Any, dataset: dict[str, str], modes: Sequence[Optional[str]], *,
                         num_samples: Optional[int], holdout: int, samples_per_prompt: int, seed: int, turns: str,
                         max_prompt_tokens: Optional[int], workers: int, target: str
                         ) -> tuple[list[Any], list[Any], dict[str, int]]:
    """(the conversations to answer, the held-out ones, the selection's skip reasons): the first
    ``num_samples`` usable ones (default: all) and ``holdout`` more, each answered once per thinking mode and
    ``samples_per_prompt`` times; ``dataset`` learns the copies' source names. Nothing usable is a `DataError`."""
    want = (num_samples if num_samples is not None else len(pool)) + holdout
    chosen, skipped, examined = select(pool, tokenizer, count=want, seed=seed, turns=turns,
                                       max_prompt_tokens=max_prompt_tokens, workers=workers)
    if not chosen:
        raise DataError(no_usable_conversations(skipped, target))
    if len(chosen) <= holdout:
        raise DataError(f"only {len(chosen)} usable conversations (skipped: {skipped}); lower --holdout {holdout}")
    if len(chosen) < want:
        logger.warning("only %d usable conversations of %d wanted (skipped: %s)", len(chosen), want, skipped)
    train, held = chosen[: len(chosen) - holdout], chosen[len(chosen) - holdout:]
    train = in_modes(train, modes)
    for conv in train:  # a thinking-mode copy belongs to its original's source
        dataset.setdefault(conv.location, dataset.get(conv.location.split("#reasoning=")[0]))
    logger.info("selected %d conversations to regenerate and %d held out (examined %d; skipped %s)",
                len(train), len(held), examined, skipped or "none")
    train = with_samples(train, samples_per_prompt)
    for i, conv in enumerate(train):  # the copies of --samples-per-prompt belong to their original's source
        dataset[conv.location] = dataset[train[i - i % samples_per_prompt].location]
    return train, held, skipped
