"""The training loop: data -> frozen target (hooks) -> trainer module -> AdamW -> checkpoints.

The loss is normalised globally: every rank and accumulation micro-step backpropagates its
*unnormalised* weighted loss sum, and the gradients are scaled once by
world_size / (global sum of weights) before clipping. The update therefore does not depend on
how the global batch is split across ranks and micro-steps, and a rank without any valid
anchor still joins every collective with zero gradients.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import OmegaConf

from nemo_dflash.config import ConfigError, RecipeConfig, resume_settings, to_yaml
from nemo_dflash.objective.metrics import DFlashLossOutput, LossSums
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.train.device import limit_host_threads
from nemo_dflash.objective.fused_loss import resolve_loss_impl
from nemo_dflash.data import build_dataloader, build_datasets
from nemo_dflash.draft.build import MaskTokenError, draft_for_recipe
from nemo_dflash.target import HFDFlashTargetModel
from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash.target.loading import load_target
from nemo_dflash.train.checkpoint import Checkpointer, check_inputs, plan_resume, run_identity, run_inputs
from nemo_dflash.train.distributed import (
    DistState,
    all_reduce_sum,
    host_share,
    init_distributed,
    launch_env,
    pick_device,
    resolve_strategy,
    shard_target_layers,
    shutdown_distributed,
    wrap_draft,
)
from nemo_dflash.train.flops import Shape, StepShapes, matmul_tflops
from nemo_dflash.train.metrics import MetricsLogger, ThroughputWindow, plot_curves
from nemo_dflash.train.optim import build_optimizer, build_scheduler
from nemo_dflash.train.run_dir import RunDirLock, claim_output_dir
from nemo_dflash.train.step import (  # noqa: F401  (_right_padded: its old import path)
    PendingStep, StepResult, TrainStep, _right_padded, row_seeds,
)

logger = logging.getLogger(__name__)

class StopReason(str, enum.Enum):
    """Why the loop ended before `total_steps` (the value is what summary.json records)."""

    SIGTERM = "SIGTERM"
    TIME_LIMIT = "train.max_minutes reached"
    NONFINITE = "consecutive non-finite steps"

    @property
    def saves(self) -> bool:
        """Whether the run checkpoints its last step: not after non-finite steps (the last good one stays)."""
        return self is not StopReason.NONFINITE


class _StopFlag:
    """Set by SIGTERM (what schedulers send before preemption): checkpoint, then exit cleanly."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        try:
            signal.signal(signal.SIGTERM, self._handler)
        except ValueError:  # not in the main thread (e.g. tests calling train() from a thread)
            pass

    def _handler(self, signum, frame) -> None:
        logger.warning("SIGTERM received: will checkpoint and stop after this step")
        self.requested = True


def endless_batches(loader) -> Iterator[dict[str, torch.Tensor]]:
    """Endless stream over epochs; the sampler advances its epoch by itself. One pass may be empty: a loader
    restored from a state saved after the last batch of its epoch (a checkpoint at an epoch's end) finishes
    that epoch before the next one starts. Two empty passes in a row are a loader with no batch at all."""
    empty = 0
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        empty = 0 if yielded else empty + 1
        if empty == 2:
            raise RuntimeError("the training data loader produced no batch")


COMPILE_MODES = ("0", "layers", "draft")


def apply_compile(module: DFlashTrainerModule, mode: str) -> DFlashTrainerModule:
    """`torch.compile` the parts of the trainer module that `mode` names (GPU only).

    "0": eager; "layers": each draft decoder layer on its own (`train.compile=true`);
    "draft": the draft's whole forward (context fusion, RoPE, all layers, final norm) as one graph.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "layers":
        for layer in module.draft.layers:
            layer.compile()
    elif mode == "draft":
        module.draft.compile()
    return module


@dataclass(frozen=True)
class _Launched:
    """A step the loop launched: its number (after it), the learning rate after it, its outcome."""

    step: int
    lr: float
    pending: PendingStep


@dataclass(frozen=True)
class RunSettings:
    """The run's "auto" settings, resolved once: train.device, distributed.strategy, loss.attn_backend, loss.impl."""

    device: torch.device
    strategy: str  # none | ddp | fsdp2
    attn_backend: str  # sdpa | eager | flex
    loss_impl: str = "chunked"  # chunked | cce | liger


def resolve_settings(cfg: RecipeConfig, world_size: int, local_rank: int) -> RunSettings:
    """Every "auto" in the recipe decided in one place, and the combinations refused before any load
    (`ConfigError`: the train command reports it in one line)."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu (or auto)")
    device = pick_device(cfg.train.device, local_rank)
    strategy = resolve_strategy(cfg.distributed.strategy, world_size)
    backend = cfg.loss.attn_backend
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type != "cuda":
        raise ConfigError("loss.attn_backend=flex needs a GPU for backward; use sdpa on CPU")
    if cfg.distributed.shard_target and strategy != "fsdp2":
        raise ConfigError("distributed.shard_target=true needs distributed.strategy=fsdp2 under torchrun")
    loss_impl = resolve_loss_impl(cfg.loss.impl, device)  # a package that cannot run here: chunked, one warning
    return RunSettings(device=device, strategy=strategy, attn_backend=backend, loss_impl=loss_impl)


class Trainer:
    """Holds the pieces of one run; `fit()` trains, `train_step()` is one step of it, `evaluate()`
    measures held-out acceptance, and `checkpointer` owns the run's directory and resume."""

    def __init__(self, cfg: RecipeConfig, *, overwrite: bool = False) -> None:
        """`overwrite`: replace a run already in `output_dir` (the train command's --overwrite)."""
        self.run_lock: Optional[RunDirLock] = None
        try:
            self._build(cfg, overwrite)
        except BaseException:
            self.release_output_dir()  # a refused or failed start leaves the directory free
            raise

    def _build(self, cfg: RecipeConfig, overwrite: bool) -> None:
        """Everything a run needs, in the order its refusals must come: the settings and the run directory before
        the target loads, the data's mask-token check before the module is built."""
        self.cfg = cfg
        self._init_device(cfg)
        resume_plan = self._claim_run(cfg, overwrite)
        self._load_models(cfg)
        self._load_data(cfg)
        self._build_module(cfg)
        self._build_optimizer(cfg, resume_plan)
        self.step = 0
        self.tokens_seen = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self._stop = _StopFlag()  # fit() installs it as the SIGTERM handler

    def _init_device(self, cfg: RecipeConfig) -> None:
        """The run's "auto" settings, the process group and the seed."""
        _, local_rank, world_size = launch_env()
        self.settings = resolve_settings(cfg, world_size, local_rank)
        self.state: DistState = init_distributed(
            self.settings.device, cfg.distributed.backend, cfg.distributed.timeout_minutes
        )
        self.device = self.state.device
        limit_host_threads(self.device)
        self.strategy = self.settings.strategy
        if self.state.is_main:
            logger.info("device %s, distributed.strategy %s, loss.attn_backend %s, loss.impl %s",
                        self.device, self.strategy, self.settings.attn_backend, self.settings.loss_impl)
        torch.manual_seed(cfg.train.seed)

    def _claim_run(self, cfg: RecipeConfig, overwrite: bool) -> list[Path]:
        """The output directory claimed and the checkpoint to resume from checked, before the target loads;
        returns the resume plan."""
        self.out = Path(cfg.output_dir)
        # Busy, holding another run, or not writable: refused here, before the target loads.
        self.run_lock = claim_output_dir(cfg.output_dir, cfg.checkpoint.resume, overwrite, self.state)
        # The checkpoint to resume from, its files checked now: none intact is refused before the target loads.
        resume_plan = plan_resume(self.out, cfg.checkpoint.resume, self.state)
        # What the run trains on (target weights, data contents): recorded in every checkpoint, and a resume
        # with other weights or data at the same paths is refused here, before the target loads.
        self.inputs = run_inputs(cfg.target.path, [s.path for s in cfg.data.sources], random_init=cfg.target.random_init)
        self.inputs["settings"] = resume_settings(cfg)  # the keys that change outputs: a resume under others refused
        if resume_plan:
            check_inputs(resume_plan[0], self.inputs, cfg.draft.kind)
        return resume_plan

    def _load_models(self, cfg: RecipeConfig) -> None:
        """The frozen target, the draft built for it, and the step's shapes (for MFU)."""
        target_dtype = cfg.target.dtype
        self.target_model, self.tokenizer = load_target(
            cfg.target.path, dtype=target_dtype, device=self.device, attn_implementation=cfg.target.attn_implementation,
            random_init=cfg.target.random_init, seed=cfg.train.seed,
        )
        self.draft = draft_for_recipe(cfg.draft, self.target_model, self.tokenizer).to(self.device)
        self.target = HFDFlashTargetModel(self.target_model, self.draft.config.target_layer_ids)
        self.step_shapes = StepShapes(
            target=Shape.of(self.target_model.config), target_layers_run=max(self.draft.config.target_layer_ids) + 1,
            draft_layers=self.draft.config.num_hidden_layers, context_layers=len(self.draft.config.target_layer_ids),
            block=self.draft.config.block_size)
        # MFU's denominator: the bf16 matmul rate of this GPU, measured once (CPU runs log no MFU)
        self.peak_tflops = matmul_tflops(self.device) if self.device.type == "cuda" else None

    def _load_data(self, cfg: RecipeConfig) -> None:
        """The datasets (a mask token the data holds is refused), this rank's loader and the run's length."""
        self.train_ds, self.holdout_ds = build_datasets(cfg.data, self.tokenizer, share=host_share(self.state))
        self._eval_done: Optional[tuple[int, dict[str, float]]] = None  # (step, figures): one eval a step
        self._t_start, self._start_step, self._time_checked = 0.0, 0, False  # fit()'s clock, for the budget check
        mask_id = self.draft.config.mask_token_id
        uses = self.train_ds.count_token(mask_id)
        if uses and not cfg.draft.allow_mask_token_in_data:
            raise MaskTokenError(
                f"the mask token {mask_id} ({self.tokenizer.convert_ids_to_tokens(mask_id)!r}) occurs {uses} times in the "
                "training data, so the draft cannot tell a masked slot from that token: set draft.mask_token_id to a "
                "reserved/unused row (or draft.mask_token_id=null), or draft.allow_mask_token_in_data=true"
            )
        # One loader batch = this rank's share of a global step (micro_batch_size x grad_accum rows),
        # split into micro-batches in the loop: the global batch is then the same samples however
        # it is divided between ranks and accumulation micro-steps.
        self.loader = build_dataloader(
            self.train_ds, cfg.train.micro_batch_size * cfg.train.grad_accum, rank=self.state.rank,
            world_size=self.state.world_size,
            seed=cfg.data.seed, batching=cfg.data.batching, num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda", pack_length=cfg.data.pack_length,
        )
        self.steps_per_epoch = steps_per_epoch = max(1, len(self.loader))
        self.total_steps = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))

    def _build_module(self, cfg: RecipeConfig) -> None:
        """The trainer module over target and draft, its attention and compilation, and the distributed wrap."""
        eval_sampling = SamplingParams(cfg.train.eval_temperature, cfg.train.eval_top_p, cfg.train.eval_top_k)
        self.module = DFlashTrainerModule(
            self.draft, self.target.get_input_embeddings(), self.target.get_output_embeddings(),
            num_anchors=cfg.loss.num_anchors, loss_decay_gamma=cfg.loss.gamma, attn_backend=self.settings.attn_backend,
            distill_weight=cfg.loss.distill_weight, ce_chunk_size=cfg.loss.ce_chunk_size,
            fused_ce=cfg.loss.fused_ce, loss_impl=self.settings.loss_impl,
            accept_weight=cfg.loss.accept_weight, accept_temperature=cfg.loss.accept_temperature,
            accept_form=cfg.loss.accept_form,
            selector_weight=cfg.loss.selector_weight, selector_outside=cfg.loss.selector_outside,
            position_weights=cfg.loss.position_weights, dpace_alpha=cfg.loss.dpace_alpha,
            accept_sampling=eval_sampling if not eval_sampling.greedy else None,
        )
        # bf16 autocast on GPU, and on CPUs too when asked (AVX512-BF16/AMX make it ~4x faster than fp32)
        self.use_bf16 = cfg.train.precision == "bf16"
        if cfg.data.pack_length and self.settings.attn_backend == "flex":
            if cfg.target.packed_attention == "varlen":
                self.target.use_varlen_attention()  # one flash varlen call over the packed documents
            else:
                self.target.use_flex_attention()  # document-causal BlockMask over packed rows
        if self.device.type == "cuda":
            # packed rows have one shape: the whole draft compiles as one graph, once
            mode = ("draft" if cfg.data.pack_length else "layers") if cfg.train.compile else "0"
            self.module = apply_compile(self.module, mode)
            if cfg.train.compile_target:
                self.target.compile_layers()
        if cfg.distributed.shard_target:
            shard_target_layers(self.target.layers)
            logger.info("FSDP2: sharded the target's %d decoder layers over %d ranks", len(self.target.layers),
                        self.state.world_size)
        param_dtype = torch.bfloat16 if self.use_bf16 and self.device.type == "cuda" else None
        self.model = wrap_draft(self.module, self.strategy, self.state, param_dtype)

    def _build_optimizer(self, cfg: RecipeConfig, resume_plan: list[Path]) -> None:
        """The optimizer, its schedule, the step that drives them, and the checkpointer."""
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.stepper = TrainStep(
            self.target, self.model, self.params, self.optimizer, self.state,
            micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, grad_clip=cfg.optim.grad_clip,
            use_bf16=self.use_bf16,
            return_logits=cfg.loss.distill_weight > 0 or cfg.loss.accept_weight > 0,
        )
        self.checkpointer = Checkpointer(
            self.out, every_steps=cfg.checkpoint.every_steps, keep_last=cfg.checkpoint.keep_last,
            resume=cfg.checkpoint.resume, draft=self.draft, optimizer=self.optimizer, dataloader=self.loader,
            identity={**run_identity(self.draft.config, self.target_model.config), **self.inputs}, state=self.state,
            resume_plan=resume_plan,
        )

    # ------------------------------------------------------------------ pieces

    _row_seeds = staticmethod(row_seeds)

    def _forward(self, batch: dict[str, torch.Tensor], module, row_seeds: list[int],
                 final_hidden: bool = False) -> DFlashLossOutput:
        return self.stepper.forward(batch, module, row_seeds, final_hidden)

    def resume(self) -> None:
        """Continue from the checkpoint `checkpoint.resume` names, if any (the step, tokens, schedule)."""
        saved = self.checkpointer.resume()
        if saved is None:
            return
        self.step = int(saved["step"])
        self.tokens_seen = int(saved.get("tokens_seen", 0))
        for _ in range(self.step):  # the schedule is a pure function of the step
            self.scheduler.step()

    def save(self) -> Path:
        return self.checkpointer.save(self.step, self.tokens_seen)

    def _write_config(self) -> None:
        """The resolved recipe, written only once the run is accepted: a refused run leaves the old one."""
        if self.state.is_main:
            tmp = self.out / "config.yaml.tmp"
            tmp.write_text(to_yaml(self.cfg))
            os.replace(tmp, self.out / "config.yaml")

    @torch.no_grad()
    def evaluate(self, max_batches: Optional[int] = None) -> dict[str, float]:
        """Simulated acceptance length on held-out data, with a fixed anchor seed; with `train.eval_temperature`
        > 0 also the expected acceptance under speculative sampling there (`objective.metrics.slot_acceptance`)."""
        if self.holdout_ds is None:
            return {}
        loader = build_dataloader(
            self.holdout_ds, self.cfg.train.micro_batch_size, rank=self.state.rank,
            world_size=self.state.world_size, seed=12345, batching="random", pack_length=self.cfg.data.pack_length,
        )
        totals = torch.zeros(LossSums.size(), dtype=torch.float64, device=self.device)
        was_training = self.draft.training
        self.draft.eval()
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            bsz = batch["input_ids"].shape[0]
            seeds = self._row_seeds(777, i, self.state.rank * bsz, bsz)
            totals += self._forward(batch, self.module, seeds, self.module.accept_sampling is not None).sums()
        self.draft.train(was_training)
        all_reduce_sum(totals, self.state)
        return LossSums.from_vector(totals.cpu()).rates(prefix="eval_")

    def _log_eval(self, metrics: MetricsLogger) -> dict[str, float]:
        """Evaluate the current weights once: a step already evaluated (the last step on an
        `eval_every` multiple) reuses its figures, so the curve holds one row a step."""
        if self._eval_done is not None and self._eval_done[0] == self.step:
            return self._eval_done[1]
        ev = self.evaluate(self.cfg.train.eval_batches)
        if ev:
            metrics.log(self.step, {**ev, "tokens": float(self.tokens_seen), "epoch": self.step / self.steps_per_epoch},
                        bar=False)
        self._eval_done = (self.step, ev)
        return ev

    # ------------------------------------------------------------------ loop

    def train_step(self, step_batch: dict[str, torch.Tensor], stop: bool = False) -> "_Launched":
        """Launch one optimizer step and advance the step counter and the schedule.

        Its outcome (loss, skipped or not) is read later by `_account`: on GPUs the loop launches
        the next step first, so the GPU never waits for the host between steps.
        """
        pending = self.stepper(self.step, step_batch, stop=stop)
        self.scheduler.step()
        self.step += 1
        return _Launched(self.step, float(self.scheduler.get_last_lr()[0]), pending)

    def _boundary(self, step: int) -> bool:
        """Steps whose outcome is read before the next one is launched: the last one, and those an
        evaluation or a checkpoint follows (they must see this step's weights, not the next's).
        A function of the step number alone, so every rank agrees without talking."""
        every = self.cfg.train.eval_every
        return (step >= self.total_steps or bool(every and step % every == 0)
                or self.checkpointer.due(step))

    def _account(self, launched: "_Launched", metrics: MetricsLogger, window: ThroughputWindow,
                 last: dict[str, float]) -> Optional[StopReason]:
        """Read a launched step's outcome; count, log, evaluate and checkpoint as its step number asks.

        A non-finite step was skipped on the device but counts as a step; more than
        `train.max_bad_steps` of them in a row stop the run (its last good checkpoint is kept).
        """
        cfg = self.cfg
        res = launched.pending.result()
        step = launched.step
        self.tokens_seen += res.tokens
        window.tokens += res.tokens
        window.flops += self.step_shapes.flops(res.sums)["total"]
        if res.status == "nonfinite":
            self.bad_steps += 1
            self.skipped_steps += 1
            logger.warning("non-finite loss/grad at step %d: skipped (%d in a row)", step, self.bad_steps)
            if self.bad_steps > cfg.train.max_bad_steps:
                logger.error("Stopping: %d %s. The last good checkpoint is kept.", self.bad_steps,
                             StopReason.NONFINITE.value)
                return StopReason.NONFINITE
            return self._stop_reason(res)
        self.bad_steps = 0
        if res.status == "no_labels":
            self.skipped_steps += 1
        last.clear()
        last.update({**res.sums.rates(), "grad_norm": res.grad_norm, "lr": launched.lr,
                     "tokens": float(self.tokens_seen), "epoch": step / self.steps_per_epoch})
        if step % cfg.train.log_every == 0 or step == self.total_steps:
            last.update(window.rates(step))
            if self.peak_tflops:
                last["mfu"] = last["tflops"] / (self.peak_tflops * self.state.world_size)
            if self.device.type == "cuda":
                last["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            metrics.log(step, last)
            self._check_time_budget(step, last.get("step_s"))
            if not metrics.bar_visible:
                logger.info("step %d/%d %s", step, self.total_steps, " ".join(f"{k}={v:.4g}" for k, v in last.items()))
        else:
            metrics.set_progress(step)
        if step == self.step:  # nothing launched after it: evaluation and checkpoint see its weights
            if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                self._log_eval(metrics)
            self.checkpointer.maybe_save(step, self.tokens_seen)
        return self._stop_reason(res)

    def _check_time_budget(self, step: int, step_s: Optional[float]) -> None:
        """Once, after two logging windows: warn when `train.max_minutes` will stop the run before
        `total_steps` (the learning-rate schedule would not reach its end), with the limit that fits."""
        cfg = self.cfg.train
        if (self._time_checked or cfg.max_minutes is None or not step_s
                or step - self._start_step < 2 * cfg.log_every):
            return
        self._time_checked = True
        elapsed = time.perf_counter() - self._t_start
        need = elapsed + (self.total_steps - step) * step_s
        if need > cfg.max_minutes * 60:
            stop_near = step + max(0.0, cfg.max_minutes * 60 - elapsed) / step_s
            logger.warning(
                "At %.0f ms a step, train.max_minutes=%g stops this run near step %d of %d, before its learning-rate "
                "schedule ends: raise train.max_minutes to %.1f or lower train.max_steps to %d.",
                step_s * 1e3, cfg.max_minutes, stop_near, self.total_steps, need / 60 * 1.05, stop_near)

    def _stop_reason(self, res: StepResult) -> Optional[StopReason]:
        """A stop some rank voted for in this step (all ranks read the same vote)."""
        if not res.stop:
            return None
        reason = StopReason.SIGTERM if self._stop.requested else StopReason.TIME_LIMIT
        logger.warning("Stopping at step %d (%s)", self.step, reason.value)
        return reason

    def fit(self) -> dict[str, Any]:
        """Resume, train to `total_steps` or a stop, then save, evaluate and summarise.

        Step n+1 is launched before step n's outcome is read (unless step n ends with an
        evaluation or a checkpoint). A stop (SIGTERM, the time limit, non-finite steps) seen in
        step n's outcome therefore ends the run after step n+1, on every rank alike.
        """
        cfg = self.cfg
        stop = self._stop
        stop.install()
        self.resume()
        self._write_config()
        metrics = MetricsLogger(
            self.out, cfg.wandb, OmegaConf.to_container(OmegaConf.structured(cfg)), self.total_steps, self.state.is_main
        )
        if self.step > 0:
            metrics.resume_at(self.step)
        metrics.set_progress(self.step)
        data = endless_batches(self.loader)
        self.draft.train()
        t_start = self._t_start = time.perf_counter()
        self._start_step, self._time_checked = self.step, False
        window = ThroughputWindow(self.step)
        last: dict[str, float] = {}
        reason: Optional[StopReason] = None
        if self.step == 0 and cfg.train.eval_every:
            self._log_eval(metrics)
        in_flight: Optional[_Launched] = None
        while self.step < self.total_steps and reason is None:
            step_batch = next(data)
            minutes = (time.perf_counter() - t_start) / 60
            timed_out = cfg.train.max_minutes is not None and minutes >= cfg.train.max_minutes
            launched = self.train_step(step_batch, stop=stop.requested or timed_out)
            if in_flight is not None:
                reason = self._account(in_flight, metrics, window, last)
            in_flight = launched
            if reason is None and (not launched.pending.deferred or self._boundary(launched.step)):
                in_flight = None
                reason = self._account(launched, metrics, window, last)
        if in_flight is not None:  # launched before the stop was seen: it ran, so it counts
            later = self._account(in_flight, metrics, window, last)
            reason = StopReason.NONFINITE if later is StopReason.NONFINITE else reason
        return self._finish(metrics, reason, last, time.perf_counter() - t_start)

    def _finish(
        self, metrics: MetricsLogger, reason: Optional[StopReason], last: dict[str, float], seconds: float
    ) -> dict[str, Any]:
        """The last checkpoint, the final draft and eval, summary.json and the curves."""
        if reason is None or reason.saves:
            # a stop the same command continues (preemption, the time cap) saves whatever the schedule
            self.checkpointer.save_last(self.step, self.tokens_seen,
                                        always=reason in (StopReason.SIGTERM, StopReason.TIME_LIMIT))
        final_eval = self._log_eval(metrics) if self.holdout_ds is not None else {}
        try:
            final_draft = self.checkpointer.save_final(self.step)  # refused for NaN/inf weights (a diverged run)
        finally:
            metrics.close()
        summary = {
            "steps": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "world": self.state.world_size,
            "steps_per_epoch": self.steps_per_epoch,
            "skipped_steps": self.skipped_steps,
            "stopped_early": reason.value if reason is not None else None,
            "train_seconds": seconds,
            "final_draft": str(final_draft),
            "data": {k: v for k, v in self.train_ds.stats.items() if k != "sources"},
            **{f"last_{k}": v for k, v in last.items()},
            **final_eval,
        }
        if self.state.is_main:
            plot_curves(metrics.records, self.out / "curves.png")
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def release_output_dir(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None

    def close(self) -> None:
        self.release_output_dir()
        shutdown_distributed()


def train(cfg: RecipeConfig, *, overwrite: bool = False) -> dict[str, Any]:
    trainer = Trainer(cfg, overwrite=overwrite)
    try:
        return trainer.fit()
    finally:
        trainer.close()


__all__ = ["PendingStep", "RunSettings", "StepResult", "StopReason", "TrainStep", "Trainer", "resolve_settings", "train"]
