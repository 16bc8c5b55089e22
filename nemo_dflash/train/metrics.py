"""Where training metrics go: a tqdm bar on rank 0, metrics.jsonl, wandb, and a PNG curve; what a run's rows say
at each epoch's end (`epoch_gaps`: held-out minus training loss)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)


def _has_network(host: str = "api.wandb.ai", port: int = 443, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a ``metrics.jsonl`` and how many lines were cut short (a run killed mid-write): those are
    dropped, not fatal."""
    rows, torn = [], 0
    for line in Path(path).read_text(errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            torn += 1
    return rows, torn


class MetricsLogger:
    """Rank-0 sink. wandb runs offline when asked for online without a network."""

    def __init__(self, output_dir: Path, wandb_cfg: Any, config_dict: dict, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True, disable=os.environ.get("NEMO_DFLASH_NO_BAR") == "1")
        mode = os.environ.get("WANDB_MODE", wandb_cfg.mode)
        if mode == "online" and not _has_network():
            logger.warning("wandb.mode=online but api.wandb.ai is unreachable: logging offline instead")
            mode = "offline"
        if mode != "disabled":
            try:
                import wandb

                self.wandb = wandb.init(
                    project=wandb_cfg.project, name=wandb_cfg.name, mode=mode, dir=str(output_dir), config=config_dict,
                    reinit="finish_previous",
                )
            except Exception as e:  # a logging backend must never kill training
                logger.warning("wandb disabled (%s)", e)

    def resume_at(self, step: int) -> None:
        """Keep the rows of steps <= ``step`` (atomically) and plot them too: the steps after the
        checkpoint are redone, so their old rows would appear twice. A line cut short by a kill is dropped."""
        if not self.enabled or not self.path.is_file():
            return
        rows, torn = read_metrics(self.path)
        if torn:
            logger.warning("metrics.jsonl: dropped %d line(s) cut short (a run killed while writing)", torn)
        kept = [r for r in rows if isinstance(r.get("step", 0), (int, float)) and r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self.records = kept + self.records
        if len(kept) < len(rows):
            logger.info("metrics.jsonl: dropped %d rows past the resumed step %d", len(rows) - len(kept), step)

    @property
    def bar_visible(self) -> bool:
        return self.bar is not None and not self.bar.disable

    def set_progress(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log(self, step: int, metrics: dict[str, float], bar: bool = True) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}}
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None and bar:
            self.bar.n = step
            shown = {k: metrics[k] for k in ("loss", "accuracy", "accept_len", "tok_s") if k in metrics}
            self.bar.set_postfix({k: (f"{v:.3g}" if k != "tok_s" else f"{v:.0f}") for k, v in shown.items()})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


class ThroughputWindow:
    """Tokens, model FLOPs and wall time since the last logged step: `tok_s`, `tflops` and `step_s` of that
    window (FLOPs of every rank: train/flops.py)."""

    def __init__(self, step: int) -> None:
        self.reset(step)

    def reset(self, step: int) -> None:
        self.start, self.tokens, self.flops, self.first_step = time.perf_counter(), 0, 0.0, step

    def rates(self, step: int) -> dict[str, float]:
        """The window's rates up to `step`; the next window starts there."""
        dt = max(time.perf_counter() - self.start, 1e-9)
        out = {"tok_s": self.tokens / dt, "tflops": self.flops / dt / 1e12,
               "step_s": dt / max(step - self.first_step, 1)}
        self.reset(step)
        return out


def plot_curves(records: list[dict[str, Any]], out_png: Path) -> Optional[Path]:
    """Loss and simulated acceptance length against training tokens."""
    train = [r for r in records if "loss" in r and "tokens" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["tokens"] for r in train]
    ax1.plot(x, [r["loss"] for r in train], lw=1)
    ax1.set_xlabel("training tokens")
    ax1.set_ylabel("loss")
    ax2.plot(x, [r["accept_len"] for r in train], lw=1, label="train (simulated)")
    ev = [r for r in records if "eval_accept_len" in r]
    if ev:
        ax2.plot([r["tokens"] for r in ev], [r["eval_accept_len"] for r in ev], "o-", label="held-out (simulated)")
    ev = [r for r in records if "eval_sampled_accept_len" in r]
    if ev:  # the expected acceptance under speculative sampling at train.eval_temperature
        ax2.plot([r["tokens"] for r in ev], [r["eval_sampled_accept_len"] for r in ev], "s--",
                 label="held-out, sampled (expected)")
        ax2.plot([r["tokens"] for r in ev], [r["eval_sampled_accept_len_greedy_draft"] for r in ev], "^:",
                 label="held-out, sampled, draft argmax")
    ax2.set_xlabel("training tokens")
    ax2.set_ylabel("acceptance length")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def epoch_gaps(rows: list[dict[str, Any]], summary: dict[str, Any], tail: float = 0.1
               ) -> Optional[dict[str, Any]]:
    """Held-out loss against training loss at each epoch's end, from a run's metrics.jsonl `rows` and its
    summary.json (`summary`; None without the steps, a training or a held-out row): the training loss
    is the mean of the steps logged in the epoch's last `tail` fraction, the held-out loss the evaluation
    nearest the epoch's end (and the run's end, for a last partial epoch). The epoch length is the run's
    summary's `steps_per_epoch`; for runs whose summary predates it, the train split's tokens over the tokens a
    step (`estimated`: the train split's share of the tokens taken as its share of the samples)."""
    if not summary.get("steps"):
        return None
    train = [r for r in rows if "loss" in r and "eval_loss" not in r]
    evals = [r for r in rows if "eval_loss" in r]
    steps = summary["steps"]
    spe, estimated = summary.get("steps_per_epoch"), False
    if not spe:
        data = summary.get("data") or {}
        if not data.get("samples") or not summary.get("tokens_seen"):
            return None
        train_tokens = data["tokens"] * data["train_samples"] / data["samples"]
        spe, estimated = train_tokens / (summary["tokens_seen"] / steps), True
    if not train or not evals or not spe:
        return None
    ends = [e * spe for e in range(1, int(steps // spe) + 1)]
    if not ends or steps - ends[-1] > tail * spe:
        ends.append(float(steps))
    points = []
    for end in ends:
        window = [r["loss"] for r in train if end - tail * spe < r["step"] <= end]
        near = min(evals, key=lambda r: abs(r["step"] - end))
        if not window or abs(near["step"] - end) > tail * spe:
            continue
        mean = sum(window) / len(window)
        points.append({"epoch": round(end / spe, 2), "step": round(end), "train_loss": round(mean, 4),
                       "train_loss_steps": len(window), "eval_step": near["step"],
                       "eval_loss": round(near["eval_loss"], 4),
                       "gap": round(near["eval_loss"] - mean, 4)})
    return {"steps_per_epoch": round(spe, 1), "estimated": estimated, "points": points}
