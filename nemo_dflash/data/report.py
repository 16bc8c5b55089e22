"""What a regenerated file will teach a draft, per source: a JSON report and a picture.

Per source (each record's ``dataset``, as ``regenerate`` writes it) and for all together:
conversations, answered turns, supervised tokens (each answer's tokens plus its end-of-turn
token, as ``train`` counts them; with a tokenizer), the unique 13-gram share of the answers
(distinct 13-grams of words over all 13-grams: low means the answers repeat each other),
loops, and answer length percentiles (nearest rank: the value at position ceil(p/100 x n) of
the sorted lengths; tokens with a tokenizer, words without).

Loops: a record carries only its conversation's last finish reason. With regenerate's defaults
(``--loops cut --after-cut end``) an answer cut at a loop ends its conversation, so the
conversations ending in ``"loop"`` count the looping answers kept; answers dropped
(``--loops drop``) or continued after (``--after-cut continue``) are not in the records: the
run's summary (``looping_before``) counts every one.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from nemo_dflash.data.decontaminate import NGRAM, words
from nemo_dflash.data.sources import DataError

logger = logging.getLogger(__name__)

REPORT_JSON = "data_report.json"
REPORT_PNG = "data_report.png"
PERCENTILES = (10, 50, 90, 99)
DEFAULT_SOURCE = "data"  # a record without ``dataset``
SCATTER_POINTS = 2000  # at most this many (prompt, answer) points per source in the picture
LOOP_NOTE = ("records carry each conversation's last finish reason only: with --loops cut --after-cut end (the "
             "defaults) a loop cut ends its conversation, so loop_cut_answers counts the looping answers kept (less "
             "any cut to nothing); the run summary's looping_before counts every answer before cutting")

Counter_ = Callable[[list[str]], list[int]]


def report_dir(out: Union[str, Path]) -> Path:
    """Where the report of the regenerated ``out`` goes: ``OUT_STEM_report/`` beside it."""
    out = Path(out)
    return out.with_name(out.stem + "_report")


def nearest_rank(sorted_values: Sequence[int], p: float) -> Optional[int]:
    """The nearest-rank percentile ``p`` of ``sorted_values`` (None when empty)."""
    if not sorted_values:
        return None
    return sorted_values[max(1, math.ceil(p / 100 * len(sorted_values))) - 1]


def token_counter(tokenizer: Any, batch: int = 2048) -> Counter_:
    """Token counts of texts (no special tokens added), tokenised in batches."""
    def count(texts: list[str]) -> list[int]:
        out: list[int] = []
        for i in range(0, len(texts), batch):
            out += [len(ids) for ids in tokenizer(texts[i:i + batch], add_special_tokens=False)["input_ids"]]
        return out

    return count


def _word_count(texts: list[str]) -> list[int]:
    return [len(words(t)) for t in texts]


class _Source:
    """The running counts of one source."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.conversations = 0
        self.loop_cut = 0
        self.answers: list[str] = []
        self.prompts: list[str] = []  # the user turn each answer follows

    def add(self, record: dict[str, Any]) -> None:
        self.conversations += 1
        self.loop_cut += record.get("finish_reason") == "loop"
        last_user = ""
        for m in record["messages"]:
            if m.get("role") == "user":
                last_user = m.get("content") or ""
            elif m.get("role") == "assistant":
                self.answers.append(m.get("content") or "")
                self.prompts.append(last_user)


_GRAM_MULT = 0x100000001B3  # odd: the running product spreads each word's hash over 64 bits


def gram_hashes(texts: Sequence[str], n: int = NGRAM, chunk: int = 4096) -> Any:
    """One 64-bit hash per word ``n``-gram inside each text (none across texts), as an int64 array.
    Vectorised over many texts at once: a file of 150 M tokens took minutes word by word in Python.
    Equal n-grams get equal hashes; distinct ones collide with probability ~ count^2 / 2^64."""
    import numpy as np

    out = []
    for start in range(0, len(texts), chunk):
        per = [np.fromiter(map(hash, words(t)), dtype=np.int64) for t in texts[start:start + chunk]]
        lens = np.array([len(w) for w in per], dtype=np.int64)
        if not lens.size or int(lens.max()) < n:
            continue
        flat = np.concatenate(per).view(np.uint64)
        windows = len(flat) - n + 1
        h = np.zeros(windows, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(n):
                h = h * np.uint64(_GRAM_MULT) + flat[j:j + windows]
        owner = np.repeat(np.arange(len(per)), lens)
        out.append(h[owner[:windows] == owner[n - 1:]].view(np.int64))  # windows inside one text
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def distinct_count(values: Any) -> int:
    """How many distinct values an int64 array holds: sorted and compared with its neighbours (numpy's
    hash-based `unique` took 10 s for 9 M hashes, the sort 1 s)."""
    import numpy as np

    if len(values) == 0:
        return 0
    ordered = np.sort(values)
    return 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))


def _row(name: str, conversations: int, loop_cut: int, lengths: list[int], grams: Any, unit: str,
         tokens: bool) -> dict[str, Any]:
    ordered = sorted(lengths)
    return {
        "name": name,
        "conversations": conversations,
        "turns": len(lengths),
        "supervised_tokens": sum(lengths) + len(lengths) if tokens else None,
        "unique_13gram_share": round(distinct_count(grams) / len(grams), 6) if len(grams) else None,
        "loop_share_before_cutting": None,  # not in the records: LOOP_NOTE
        "loop_cut_answers": loop_cut,
        "loop_cut_share": round(loop_cut / len(lengths), 6) if lengths else None,
        "length_unit": unit,
        "answer_length_mean": round(sum(lengths) / len(lengths), 3) if lengths else None,
        "answer_length_percentiles": {f"p{p}": nearest_rank(ordered, p) for p in PERCENTILES},
        "answer_length_max": ordered[-1] if ordered else None,
    }


def data_report(path: Union[str, Path], tokenizer: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the report, the points of its picture) of the regenerated JSONL ``path``. A line that is not
    a record with ``messages`` is a DataError naming it."""
    sources: dict[str, _Source] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno} is not JSON ({e}); give a file regenerate wrote") from None
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                raise DataError(f"{path}:{lineno} has no 'messages' list; give a file regenerate wrote")
            name = str(record.get("dataset", DEFAULT_SOURCE))
            sources.setdefault(name, _Source(name)).add(record)
    if not sources:
        raise DataError(f"{path} holds no conversations; give a file regenerate wrote")
    tokens = tokenizer is not None
    count = token_counter(tokenizer) if tokens else _word_count
    unit = "tokens" if tokens else "words"
    import numpy as np

    rows, points, all_lengths, all_grams = [], {}, [], []
    for name in sorted(sources):
        src = sources[name]
        answers = count(src.answers)
        grams = gram_hashes(src.answers)
        rows.append(_row(name, src.conversations, src.loop_cut, answers, grams, unit, tokens))
        step = max(1, len(answers) // SCATTER_POINTS)
        points[name] = {"answers": answers, "prompts": count(src.prompts[::step]), "answers_sampled": answers[::step]}
        all_lengths += answers
        all_grams.append(grams)
    total = _row("all", sum(r["conversations"] for r in rows), sum(r["loop_cut_answers"] for r in rows), all_lengths,
                 np.concatenate(all_grams), unit, tokens)
    report = {"data": str(path), "length_unit": unit, "sources": rows, "all": total, "loop_note": LOOP_NOTE}
    if not tokens:
        report["tokens_note"] = "no tokenizer given: lengths are in words and supervised_tokens is null"
    return report, points


def plot_report(report: dict[str, Any], points: dict[str, Any], path: Union[str, Path]) -> None:
    """A PNG of the source mix (share of answered turns and, with a tokenizer, of supervised
    tokens), the answer lengths per source, and where the prompts lie (prompt against answer
    length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = report["length_unit"]
    names = [r["name"] for r in report["sources"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    turns = [r["turns"] for r in report["sources"]]
    ax.barh(names, [t / max(sum(turns), 1) for t in turns], label="answered turns")
    if report["all"]["supervised_tokens"]:
        sup = [r["supervised_tokens"] for r in report["sources"]]
        ax.barh(names, [s / max(sum(sup), 1) for s in sup], height=0.4, label="supervised tokens")
    ax.set_xlabel("share of the data")
    ax.set_title("source mix")
    ax.legend(fontsize=8)
    ax = axes[1]
    longest = max([max(p["answers"], default=1) for p in points.values()] + [1])
    bins = [0] + [2 ** (k / 2) for k in range(0, int(2 * math.log2(longest + 1)) + 2)]
    for name in names:
        ax.hist(points[name]["answers"], bins=bins, histtype="step", label=name)
    ax.set_xscale("symlog")
    ax.set_xlabel(f"answer length ({unit})")
    ax.set_ylabel("answers")
    ax.set_title("answer lengths")
    ax.legend(fontsize=8)
    ax = axes[2]
    for name in names:
        ax.scatter([x + 1 for x in points[name]["prompts"]], [y + 1 for y in points[name]["answers_sampled"]], s=4,
                   alpha=0.4, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"user turn length + 1 ({unit})")
    ax.set_ylabel(f"answer length + 1 ({unit})")
    ax.set_title("where the prompts lie")
    ax.legend(fontsize=8, markerscale=3)
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_report(data: Union[str, Path], out_dir: Union[str, Path], tokenizer: Any = None) -> dict[str, Any]:
    """Write ``data_report.json`` and ``data_report.png`` of ``data`` into ``out_dir`` (each
    atomically); returns their paths. A picture that cannot be drawn is logged, not fatal: the
    numbers are the report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report, points = data_report(data, tokenizer)
    json_path, png_path = out_dir / REPORT_JSON, out_dir / REPORT_PNG
    _write_json_atomic(json_path, report)
    try:
        plot_report(report, points, png_path)
    except Exception as e:  # noqa: BLE001 - no matplotlib, no fonts: the JSON stands alone
        logger.warning("data report: the picture was not drawn (%s); %s holds the numbers", e, json_path)
        png_path = None
    for row in report["sources"] + [report["all"]]:
        logger.info("data report %s: %d conversations, %d turns, %s supervised tokens, unique 13-gram share %s, "
                    "answer length p50 %s %s", row["name"], row["conversations"], row["turns"],
                    row["supervised_tokens"], row["unique_13gram_share"], row["answer_length_percentiles"]["p50"],
                    report["length_unit"])
    return {"json": str(json_path), "png": None if png_path is None else str(png_path)}
