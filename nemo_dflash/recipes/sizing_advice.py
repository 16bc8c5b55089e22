"""The plan-time sizing warning: a run whose training budget is below the tokens that the closest measured
target's draft needed to pay gets one WARNING line before anything loads. Never a refusal: the measurements
are of other targets and other data, so they advise.

The measurements are `sizing.json` beside this file: the rows `benchmarks/sizing.py` writes from
docs/bench/ (the same rows as docs/bench/sizing.json, shown in docs/train.md "What budget pays"). A JSON file
written by the script, not a table in this module, so that one command regenerates both copies and a test
checks that they are the same. The rows' computation is here too (`target_row`, `table`): the script reads
the measurements and writes what this module computes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_dflash.config import RecipeConfig

logger = logging.getLogger(__name__)

SIZING_FILE = Path(__file__).with_name("sizing.json")
DOCS = "docs/train.md, 'What budget pays'"


def load_rows(path: Path = SIZING_FILE) -> list[dict[str, Any]]:
    """The measured targets that have a paying draft; [] when the file is missing or unreadable."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("tokens_to_speedup_1") and r.get("hidden_size")
            and r.get("num_hidden_layers")]


def tokens_text(n: float) -> str:
    """A token count as the warning prints it: millions, or the count itself below 0.1 M."""
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{int(n):,}"


def rate_text(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:g}"


def tokens_per_step(cfg: RecipeConfig, world: int) -> int:
    """Token slots one optimizer step trains on: micro batch x row length x grad accumulation x ranks. A row
    is data.pack_length tokens when packed, at most data.max_length when not (padding fills the rest)."""
    row = cfg.data.pack_length or cfg.data.max_length
    return cfg.train.micro_batch_size * row * cfg.train.grad_accum * max(world, 1)


def planned_tokens(cfg: RecipeConfig, world: int, tokens_per_s: Optional[float]) -> Optional[tuple[int, str]]:
    """The most tokens the recipe's caps let training see, and how that was counted; None when only
    train.epochs bounds it (the data's size is known only after regeneration)."""
    found: list[tuple[int, str]] = []
    per = tokens_per_step(cfg, world)
    if cfg.train.max_steps:
        found.append((cfg.train.max_steps * per, f"train.max_steps {cfg.train.max_steps} x {per:,} tokens a step"))
    if cfg.train.max_minutes is not None and tokens_per_s:  # the cap is checked after a step: one at least
        n = max(int(cfg.train.max_minutes * 60 * tokens_per_s * max(world, 1)), per)
        found.append((n, f"train.max_minutes {cfg.train.max_minutes:g} x {rate_text(tokens_per_s)} tokens/s a GPU "
                         f"x {max(world, 1)} GPU(s)"))
    return min(found) if found else None


def _gguf_dims(path: str) -> Optional[dict[str, int]]:
    """Layers, width and vocabulary from a GGUF file's header (memory-mapped: no weights are read)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        fields = reader.fields

        def scalar(key: str) -> Optional[int]:
            f = fields.get(key)
            return int(f.parts[f.data[0]][0]) if f is not None else None

        arch = bytes(fields["general.architecture"].parts[-1]).decode()
        tokens = fields.get("tokenizer.ggml.tokens")
        dims = {"num_hidden_layers": scalar(f"{arch}.block_count"), "hidden_size": scalar(f"{arch}.embedding_length"),
                "vocab_size": len(tokens.data) if tokens is not None else None}
    except Exception:  # noqa: BLE001 - any unreadable header: the advice is skipped, the load reports the file
        return None
    return {k: v for k, v in dims.items() if v}


def target_dims(path: str) -> Optional[dict[str, int]]:
    """The target's layers, width and vocabulary, read as files before any load (config.json, or a GGUF's
    header); None when neither can be read here."""
    from nemo_dflash.target.loading import resolve_target_path, target_text_config

    config = target_text_config(path)
    if config is None:
        try:
            resolved = resolve_target_path(path)
        except FileNotFoundError:
            return None
        return _gguf_dims(resolved) if resolved.endswith(".gguf") and Path(resolved).is_file() else None
    dims = {k: config.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    if not isinstance(dims["num_hidden_layers"], int) or not isinstance(dims["hidden_size"], int):
        return None
    return {k: int(v) for k, v in dims.items() if isinstance(v, int)}


def approx_params(dims: dict[str, Any]) -> float:
    """Parameters of a dense decoder of these dimensions: 12 L H^2 for the layers, V H for the embedding."""
    return 12 * dims["num_hidden_layers"] * dims["hidden_size"] ** 2 + (dims.get("vocab_size") or 0) * dims["hidden_size"]


def closest(rows: list[dict[str, Any]], dims: dict[str, int]) -> dict[str, Any]:
    """The measured target nearest in size (ratio of approximate parameter counts)."""
    size = approx_params(dims)
    return min(rows, key=lambda r: abs(math.log(approx_params(r) / size)))


def sizing_warning(cfg: RecipeConfig, world: int, rows: Optional[list[dict[str, Any]]] = None,
                   dims: Optional[dict[str, int]] = None) -> Optional[str]:
    """The warning's text when the planned training tokens are below a paying draft's; None otherwise."""
    rows = load_rows() if rows is None else rows
    if not rows:
        return None
    by_path = {r.get("target_path"): r for r in rows}
    if dims is None:
        dims = target_dims(cfg.target.path)
    if dims is None and cfg.target.path not in by_path:
        logger.debug("sizing advice skipped: the target's config cannot be read before it loads")
        return None
    row = by_path[cfg.target.path] if dims is None else closest(rows, dims)
    planned = planned_tokens(cfg, world, row.get("train_tokens_per_s"))
    need = int(row["tokens_to_speedup_1"])
    if planned is None or planned[0] >= need:
        return None
    tokens, how = planned
    minutes = row.get("minutes_per_gpu_to_speedup_1")
    ratio = approx_params(dims) / approx_params(row) if dims is not None else 1.0
    size = f"; this target is about {ratio:.1f}x its size" if not 0.5 <= ratio <= 2 else ""
    return (f"this run trains on at most {tokens_text(tokens)} tokens ({how}); the closest measured target, "
            f"{row['target']} ({row['num_hidden_layers']} layers x {row['hidden_size']}{size}), first had a draft that pays "
            f"(T=0 speedup >= 1.0 at batch 1) at {tokens_text(need)} training tokens"
            + (f", about {minutes:.0f} minutes of one GPU to regenerate and train" if minutes else "")
            + f" ({DOCS}): a smaller budget gives a draft that may slow its target down")


def warn_small_budget(cfg: RecipeConfig, world: int) -> None:
    """Log the sizing warning, if any: one line, at plan time."""
    message = sizing_warning(cfg, world)
    if message:
        logger.warning("%s", message)


# ---- the rows themselves: what `benchmarks/sizing.py` computes from the measurements in docs/bench/

PAYS = (1.0, 1.5)  # the speedups a summary row names the smallest measured token count for


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def draft_points(rows: list[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """The target's measured drafts, by training tokens: tau and T=0 speedup on both sets. A later row of the
    same draft (same tokens, same `draft` name) replaces an earlier one: a continued evaluation supersedes it."""
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if r.get("target") not in names or not _num(r.get("train_tokens")):
            continue
        if r.get("variant") not in (None, "dflash"):
            continue  # another draft architecture than the one the pipeline trains by default
        point = {"train_tokens": int(r["train_tokens"]), "draft": r.get("draft"), "date": r.get("date"),
                 "commit": r.get("commit"), "device": r.get("device"),
                 "mtbench_t0_tau": _num(r.get("mtbench_t0_tau")), "humaneval_t0_tau": _num(r.get("humaneval_t0_tau")),
                 "mtbench_t0_speedup": _num(r.get("mtbench_t0_speedup")),
                 "humaneval_t0_speedup": _num(r.get("humaneval_t0_speedup")),
                 "mtbench_t0_speedup_no_loop": _num(r.get("mtbench_t0_speedup_no_loop")),
                 "humaneval_t0_speedup_no_loop": _num(r.get("humaneval_t0_speedup_no_loop"))}
        both = (point["mtbench_t0_speedup"], point["humaneval_t0_speedup"])
        point["speedup_t0_min"] = min(both) if None not in both else None  # type: ignore[type-var]
        free = (point["mtbench_t0_speedup_no_loop"], point["humaneval_t0_speedup_no_loop"])
        point["speedup_t0_no_loop_min"] = min(free) if None not in free else None  # type: ignore[type-var]
        by_key[(point["train_tokens"], point["draft"])] = point
    return sorted(by_key.values(), key=lambda p: p["train_tokens"])


def tokens_to_pay(points: list[dict[str, Any]], speedup: float, key: str = "speedup_t0_min") -> Optional[int]:
    """The smallest measured training-token count whose draft reached `speedup` on both sets (`key`: over all
    answers, or over the answers without loops)."""
    paying = [p["train_tokens"] for p in points if p[key] is not None and p[key] >= speedup]
    return min(paying) if paying else None


def latest(rows: list[dict[str, Any]], keep: Any, size: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The current figure among the rows `keep` accepts: the latest date, then (when `size` is named) the
    largest value of that key, then the last row written."""
    kept = [r for r in rows if keep(r) and _num(r.get("tokens_per_s"))]
    if not kept:
        return None
    day = max(str(r.get("date")) for r in kept)
    kept = [r for r in kept if str(r.get("date")) == day]
    if size:
        top = max(_num(r.get(size)) or 0 for r in kept)
        kept = [r for r in kept if (_num(r.get(size)) or 0) == top]
    return kept[-1]


def train_rate(rows: list[dict[str, Any]], shape: Optional[str]) -> Optional[dict[str, Any]]:
    """Training tokens/s a GPU: the current one-GPU H200 row of the target's shape (the default draft)."""
    return latest(rows, lambda r: r.get("shape") == shape and r.get("world") == 1
                  and "H200" in str(r.get("device")) and r.get("variant") in (None, "dflash"))


def regen_rate(rows: list[dict[str, Any]], target: Optional[str]) -> Optional[dict[str, Any]]:
    """Regeneration tokens/s a GPU: the current one-GPU H200 row of the target, at its largest prompt count."""
    return latest(rows, lambda r: r.get("target") == target and r.get("world", 1) == 1
                  and "H200" in str(r.get("device")), size="prompts")


def minutes_per_gpu(tokens: Optional[int], train_tps: Optional[float], regen_tps: Optional[float]) -> Optional[float]:
    if tokens is None or not train_tps or not regen_tps:
        return None
    return tokens / train_tps / 60 + tokens / regen_tps / 60


def _cite(row: Optional[dict[str, Any]], path: str) -> Optional[dict[str, Any]]:
    if row is None:
        return None
    return {"file": path, "date": row.get("date"), "commit": row.get("commit"), "device": row.get("device"),
            "command": row.get("command"), "tokens_per_s": row.get("tokens_per_s")}


def target_row(spec: dict[str, Any], drafter: list[dict[str, Any]], train: list[dict[str, Any]],
               regen: list[dict[str, Any]], dims: Optional[dict[str, int]], draft_layers: Optional[int],
               paths: dict[str, str]) -> dict[str, Any]:
    """One target's summary: its measured drafts, the tokens to a paying draft, the minutes a GPU needs."""
    points = draft_points(drafter, spec["names"])
    tr, rg = train_rate(train, spec["shape"]), regen_rate(regen, spec["regen_target"])
    train_tps = _num(tr.get("tokens_per_s")) if tr else None
    regen_tps = _num(rg.get("tokens_per_s")) if rg else None
    row: dict[str, Any] = {"target": spec["target"], "target_path": spec["target_path"],
                           "num_hidden_layers": (dims or {}).get("num_hidden_layers"),
                           "hidden_size": (dims or {}).get("hidden_size"), "vocab_size": (dims or {}).get("vocab_size"),
                           "draft_layers": draft_layers, "draft_width": (dims or {}).get("hidden_size"),
                           "recipe": spec["recipe"], "measured_drafts": len(points),
                           "max_measured_tokens": max((p["train_tokens"] for p in points), default=None),
                           "train_tokens_per_s": train_tps, "regen_tokens_per_s": regen_tps,
                           "train_rate_source": _cite(tr, paths["train"]),
                           "regen_rate_source": _cite(rg, paths["regen"]),
                           "drafts_source": paths["drafter"], "points": points}
    for s in PAYS:
        key = f"{s:g}".replace(".", "_")
        tokens = tokens_to_pay(points, s)
        row[f"tokens_to_speedup_{key}"] = tokens
        row[f"minutes_per_gpu_to_speedup_{key}"] = minutes_per_gpu(tokens, train_tps, regen_tps)
        row[f"tokens_to_speedup_{key}_no_loop"] = tokens_to_pay(points, s, "speedup_t0_no_loop_min")
    free = [p["train_tokens"] for p in points if p["speedup_t0_no_loop_min"] is not None]
    row["measured_no_loop_drafts"], row["max_measured_no_loop_tokens"] = len(free), max(free, default=None)
    return row


def pay_cell(row: dict[str, Any], key: str) -> str:
    """'21.2 M' or, where no measured draft pays, what the measurements do say."""
    if row[f"tokens_to_speedup_{key}"] is not None:
        return f"{row[f'tokens_to_speedup_{key}'] / 1e6:.1f} M"
    if not row["measured_drafts"] or (key.endswith("no_loop") and not row["measured_no_loop_drafts"]):
        return "no run recorded"
    top = row["max_measured_no_loop_tokens" if key.endswith("no_loop") else "max_measured_tokens"]
    return f"> {top / 1e6:.1f} M (no measured run pays)"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown tables docs/train.md shows: every measured draft, then one line per target."""
    out = ["| target | draft | training tokens | tau MT-Bench / HumanEval (T=0) | speedup MT-Bench / HumanEval "
           "(T=0, batch 1) | without loops | current figure measured |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]

    def pair(a: Optional[float], b: Optional[float], fmt: str) -> str:
        return "-" if a is None and b is None else " / ".join("-" if v is None else format(v, fmt) for v in (a, b))

    for row in rows:
        for p in row["points"]:
            out.append(f"| {row['target']} | {p['draft'] or 'main'} | {p['train_tokens'] / 1e6:.1f} M | "
                       f"{pair(p['mtbench_t0_tau'], p['humaneval_t0_tau'], '.2f')} | "
                       f"{pair(p['mtbench_t0_speedup'], p['humaneval_t0_speedup'], '.2f')} | "
                       f"{pair(p['mtbench_t0_speedup_no_loop'], p['humaneval_t0_speedup_no_loop'], '.2f')} | "
                       f"{p['date']}, {p['commit']}, {p['device']} |")
    out += ["", "| target | vocab | draft layers x width | tokens to speedup >= 1.0 | minutes a GPU | "
            "tokens to speedup >= 1.5 | minutes a GPU | the same without loops (>= 1.0 / >= 1.5) | "
            "training / regeneration tokens/s a GPU |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        shape = f"{row['draft_layers']} x {row['draft_width']}" if row["draft_layers"] else "-"
        vocab = f"{row['vocab_size']:,}" if row["vocab_size"] else "-"
        minutes = [row[f"minutes_per_gpu_to_speedup_{k}"] for k in ("1", "1_5")]
        mins = ["-" if m is None else f"{m:.1f}" for m in minutes]
        rates = ("-" if not row["train_tokens_per_s"] or not row["regen_tokens_per_s"]
                 else f"{row['train_tokens_per_s'] / 1e3:.1f}k / {row['regen_tokens_per_s'] / 1e3:.1f}k")
        out.append(f"| {row['target']} | {vocab} | {shape} | {pay_cell(row, '1')} | {mins[0]} | "
                   f"{pay_cell(row, '1_5')} | {mins[1]} | "
                   f"{pay_cell(row, '1_no_loop')} / {pay_cell(row, '1_5_no_loop')} | "
                   f"{rates} |")
    return out
