"""A regeneration's numbers: one call's counters (`RegenStats`), each rank's counts and timings, the ranks
combined, and the run's summary (what `regenerate --summary-json` writes and the pipeline reads)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

@dataclass
class RegenStats:
    """Counters of one regeneration run; ``skipped`` maps a reason to a number of conversations."""

    conversations: int = 0  # conversations given to regenerate_conversations
    written: int = 0  # conversations yielded (at least one regenerated turn)
    turns: int = 0  # assistant turns written (a halted run's unfinished conversations are not)
    prompt_tokens: int = 0  # prompt tokens of the generated turns
    generated_tokens: int = 0  # new tokens, stop token included, dropped answers and cut loops included
    answer_tokens: int = 0  # tokens of the answers written (what the draft trains on)
    answers: int = 0  # answers generated (kept or not)
    looping_before: int = 0  # answers the loop detector flagged, before the loop policy
    looping_after: int = 0  # written answers the detector flags (0 unless the policy is "keep")
    capped_before: int = 0  # answers that hit max_new_tokens without looping
    capped_after: int = 0  # of those, written
    finish: Counter = field(default_factory=Counter)  # per written conversation: its last turn's finish
    skipped: Counter = field(default_factory=Counter)  # no conversation written, by reason
    shortened: Counter = field(default_factory=Counter)  # --turns all: later turns dropped, by reason
    prefix_mismatch: int = 0  # later turns whose prompt does not start with the previous prompt + answer tokens
    prefill_tokens: int = 0  # the engine: prompt tokens prefilled (a history found in its row is not)
    reused_tokens: int = 0  # the engine: prompt tokens whose K/V was already in the row
    seconds: float = 0.0  # time spent generating
    phase_seconds: Counter = field(default_factory=Counter)  # the engine: seconds by phase (prefill, decode, ...)
    halted: bool = False  # should_stop() ended the run early: later conversations were not generated

    def summary(self) -> str:
        rate = self.generated_tokens / self.seconds if self.seconds else 0.0
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        finish = ", ".join(f"{k}={v}" for k, v in sorted(self.finish.items())) or "none"
        text = (
            f"written {self.written} conversations ({self.turns} assistant turns, {self.answer_tokens} answer tokens; "
            f"last turn finish: {finish}); skipped {sum(self.skipped.values())} ({skipped}); "
            f"looping answers {self.looping_before} -> {self.looping_after}, capped {self.capped_before} -> "
            f"{self.capped_after} of {self.answers}; generated {self.generated_tokens} tokens in {self.seconds:.1f}s "
            f"({rate:.1f} tokens/s)"
        )
        if self.prefill_tokens or self.reused_tokens:
            text += (f"; prefilled {self.prefill_tokens} prompt tokens, {self.reused_tokens} reused from the row "
                     f"({self.prefix_mismatch} later turns not a prefix extension)")
        if self.phase_seconds:
            text += "; seconds by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.phase_seconds.items()))
        if self.shortened:
            text += "; conversations cut short: " + ", ".join(f"{k}={v}" for k, v in sorted(self.shortened.items()))
        return text


_SUMMED = ("written_this_run", "turns", "answers", "answer_tokens", "looping_before", "looping_after",
           "capped_before", "capped_after", "prompt_tokens", "prefill_tokens", "reused_tokens", "prefix_mismatch",
           "generated_tokens", "todo")
_COUNTED = ("finish", "skipped_generation", "shortened")


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


def combine(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
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


def rank_stats(stats: Any, *, todo: int, rank: int, regenerate_seconds: float) -> dict[str, Any]:
    """One rank's `RegenStats` as the plain dict a rank writes beside its shard and rank 0 combines."""
    return {
        "written_this_run": stats.written, "turns": stats.turns, "answers": stats.answers,
        "answer_tokens": stats.answer_tokens, "looping_before": stats.looping_before,
        "looping_after": stats.looping_after, "capped_before": stats.capped_before, "capped_after": stats.capped_after,
        "prompt_tokens": stats.prompt_tokens, "prefill_tokens": stats.prefill_tokens,
        "reused_tokens": stats.reused_tokens, "prefix_mismatch": stats.prefix_mismatch,
        "generated_tokens": stats.generated_tokens, "finish": dict(stats.finish), "todo": todo, "rank": rank,
        "skipped_generation": dict(stats.skipped), "shortened": dict(stats.shortened),
        "generate_seconds": round(stats.seconds, 2), "regenerate_seconds": round(regenerate_seconds, 2),
        "halted": stats.halted, "capture_seconds": round(stats.phase_seconds.get("capture", 0.0), 2),
    }


def _rate(count: float, seconds: float, digits: int = 2) -> float:
    return round(count / seconds, digits) if seconds > 0 else 0.0


def run_summary(total: dict[str, Any], *, written: int, flags: dict[str, Any], report: Sequence[dict[str, Any]],
                sampling: dict[str, Any], select_skipped: dict[str, int], wall: float,
                ranks_detail: list[dict[str, Any]], imbalance: Optional[float]) -> dict[str, Any]:
    """The run's summary: ``total`` (`combine` of the ranks' stats), the file's ``written`` conversations,
    the settings in ``flags`` (out, ranks, holdout, samples_per_prompt, decontaminate, engine, backend, loops,
    capped, after_cut, reasoning, server) and the rates."""
    gen_time = total["regenerate_seconds"]
    flags = dict(flags)
    decontaminate = flags.pop("decontaminate")
    server = flags.pop("server", None)
    head = {k: flags.pop(k) for k in ("out",)}
    return {
        **head,
        "written": written,
        "written_this_run": total["written_this_run"],
        "resumed_done": written - total["written_this_run"],
        "stopped_at_max_minutes": total["halted"],
        **{k: flags.pop(k) for k in ("ranks", "holdout", "holdout_written", "samples_per_prompt")},
        "decontamination": {"checked": sum(r["read"] for r in report) if decontaminate == "on" else 0,
                            "dropped": sum(r["contaminated"] for r in report)},
        "data_sources": list(report),
        **{k: total[k] for k in ("turns", "answers", "answer_tokens", "looping_before", "looping_after",
                                 "capped_before", "capped_after")},
        "sampling": sampling,
        **{k: flags.pop(k) for k in ("engine", "backend")},
        **({"server": server} if server is not None else {}),
        **flags,  # loops, capped, after_cut, reasoning
        "finish": total["finish"],
        "skipped_selection": select_skipped,
        "skipped_generation": total["skipped_generation"],
        "shortened": total["shortened"],
        **{k: total[k] for k in ("prompt_tokens", "prefill_tokens", "reused_tokens", "prefix_mismatch",
                                 "generated_tokens", "generate_seconds")},
        "regenerate_seconds": round(gen_time, 2),
        "wall_seconds": round(wall, 2),
        "tokens_per_s": _rate(total["generated_tokens"], gen_time),
        "capture_seconds": total["capture_seconds"],
        "tokens_per_s_after_capture": _rate(total["generated_tokens"], total["after_capture_seconds"]),
        "end_to_end_tokens_per_s": _rate(total["generated_tokens"], wall),
        "conversations_per_s": _rate(total["todo"], gen_time, 3),
        "ranks_detail": ranks_detail,
        "rank_imbalance": imbalance,
    }


def add_data_report(summary: dict[str, Any], out: Any, report: Sequence[dict[str, Any]], tokenizer: Any, *,
                    interleaved: bool) -> None:
    """Write the data report of ``out`` (every answer tokenised once) and add to ``summary`` its path, the
    per-source counts and the mix achieved against the one asked; warn of a source under half its share."""
    import json
    import logging
    from pathlib import Path

    from nemo_dflash.data.report import report_dir, write_report

    summary["report"] = write_report(out, report_dir(out), tokenizer=tokenizer)
    made = json.loads(Path(summary["report"]["json"]).read_text(encoding="utf-8"))
    summary["sources"] = per_source_counts(made, [r["name"] for r in report])
    summary["mix"] = achieved_mix(summary["sources"], report, interleaved=interleaved)
    short = [m for m in summary["mix"]["sources"] if m["under_half"]]
    if short:
        logging.getLogger("nemo_dflash.regenerate").warning(
            "data mix: %s got under half of its share of the supervised tokens (%s): add prompts to it, or lower "
            "its weight", ", ".join(m["name"] for m in short),
            "; ".join(f"{m['name']} {m['achieved']:.1%} of {m['asked']:.1%} asked" for m in short))
