"""One optimizer step of the training loop (`TrainStep`), the hot path: this rank's share of a global batch through
the frozen target and the trainer module, the globally normalised gradients, and the update. `Trainer`
(train/trainer.py) keeps the schedule, counters, logging and checkpoints around it."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from nemo_dflash.objective.metrics import DFlashLossOutput, LossSums
from nemo_dflash.objective.trainer_module import DFlashTrainerModule
from nemo_dflash.target import HFDFlashTargetModel
from nemo_dflash.train.distributed import DistState, all_reduce_sum


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy from pinned memory without blocking the host (a pageable copy may wait for the GPU)."""
    pin = device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned()
    return (t.pin_memory() if pin else t).to(device, non_blocking=True)


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: _to(v, device) for k, v in batch.items()}


def _micro_slice(batch: dict[str, torch.Tensor], start: int, size: int) -> dict[str, torch.Tensor]:
    """Rows [start, start+size) trimmed to their own longest sequence (less padding); packed rows
    (`doc_ids`) keep their fixed length."""
    part = {k: v[start : start + size] for k, v in batch.items()}
    if "doc_ids" in part:
        return part
    length = int(part["attention_mask"].sum(dim=1).max().item())
    return {k: v[:, : max(length, 1)].contiguous() for k, v in part.items()}


def _right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row is real tokens then padding (what the collator builds); a CPU check."""
    if attention_mask.device.type != "cpu":
        return False  # deciding would cost a host sync; the masked path is always correct
    m = attention_mask.bool()
    return bool((m[:, 1:] <= m[:, :-1]).all()) if m.shape[1] > 1 else True


def row_seeds(base: int, step: int, first_row: int, bsz: int) -> list[int]:
    """Per-sample anchor seeds from (seed, step, row in the global batch): a sample gets the
    same anchors however the global batch is split, so DDP/FSDP/accumulation match one process."""
    return [((base * 1_000_003 + step) * 100_003 + first_row + j) % (2**63 - 1) for j in range(bsz)]


@dataclass
class StepResult:
    """Host-side outcome of one optimizer step (already summed over ranks)."""

    sums: LossSums
    tokens: int  # real (unpadded) tokens in the global batch
    stop: bool  # some rank asked to stop (SIGTERM, time limit): every rank stops after this step
    grad_norm: float
    loss: float
    status: str  # "ok" | "no_labels" (nothing supervised anywhere: no update) | "nonfinite" (update skipped)

    @property
    def totals(self) -> torch.Tensor:
        """The flat float64 vector: `LossSums` fields, tokens, stop (tokens at [LossSums.size()])."""
        return torch.tensor([*(getattr(self.sums, k) for k in LossSums.__dataclass_fields__), self.tokens,
                             float(self.stop)], dtype=torch.float64)

    @classmethod
    def from_host(cls, host: torch.Tensor) -> "StepResult":
        """Read the step's host vector: `LossSums` fields, tokens, stop votes, grad norm, skipped (0/1)."""
        sums = LossSums.from_vector(host)
        tokens, stops, gnorm, skipped = host[LossSums.size():].tolist()
        supervised = sums.weight_sum > 0
        gnorm, loss = (gnorm, sums.loss) if supervised else (0.0, 0.0)
        status = "no_labels" if not supervised else ("nonfinite" if skipped else "ok")
        return cls(sums=sums, tokens=int(tokens), stop=stops > 0, grad_norm=gnorm, loss=loss, status=status)


class PendingStep:
    """A launched step whose outcome may still be on its way from the GPU.

    `result()` waits for that step's one device-to-host copy only, so a loop that launches the
    next step before reading this one keeps the GPU fed across the step boundary.
    """

    def __init__(self, host: torch.Tensor, event: Optional[torch.cuda.Event] = None, deferred: bool = False) -> None:
        self._host = host
        self._event = event
        self.deferred = deferred  # the update was decided on the device; False: on the host, inside the step
        self._result: Optional[StepResult] = None

    def result(self) -> StepResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = StepResult.from_host(self._host)
        return self._result


class TrainStep:
    """One optimizer step over this rank's share of a global batch: the training loop's hot path.

    Shared with benchmarks/train_throughput.py so the benchmark times exactly what training
    runs. The scheduler, counters, logging and checkpoints stay with `Trainer`.

    The GPU never waits for the host mid-step: anchors and label slots are planned on the CPU
    from the loader's batch (`DFlashTrainerModule.plan`) and copied with it from pinned memory,
    the target runs without the padding mask (rows are right-padded), and the gradient scale,
    clipping and statistics stay on the GPU. With a fused AdamW (the default on GPUs) the
    skip of a non-finite or unsupervised update is decided on the device too (the optimizer's
    `found_inf`, as GradScaler uses it), so the step ends without waiting for the GPU and
    returns a `PendingStep`. Otherwise (FSDP2's DTensor gradients, an unfused optimizer) the
    step reads its statistics to the host once, before the update, and returns them read.
    """

    def __init__(
        self,
        target: HFDFlashTargetModel,
        model: torch.nn.Module,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        state: DistState,
        *,
        micro_batch_size: int,
        seed: int,
        grad_clip: float,
        use_bf16: bool,
        return_logits: bool = False,
        defer: Optional[bool] = None,
    ) -> None:
        self.target = target
        self.model = model
        self.module: DFlashTrainerModule = getattr(model, "module", model)  # unwrapped (DDP keeps it in .module)
        self.params = params
        self.optimizer = optimizer
        self.state = state
        self.device = state.device
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.grad_clip = grad_clip
        self.use_bf16 = use_bf16
        self.return_logits = return_logits
        fused = bool(optimizer.defaults.get("fused"))
        # defer=None: decide on the device whenever the optimizer can (fused AdamW takes found_inf)
        self.defer = fused if defer is None else defer
        if self.defer and not fused:
            raise ValueError("TrainStep(defer=True) needs a fused optimizer (found_inf skips its update)")

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.use_bf16 else nullcontext()

    def forward(self, batch: dict[str, torch.Tensor], module, seeds: list[int],
                final_hidden: bool = False) -> DFlashLossOutput:
        """Target features, then the trainer module, for one CPU (or device) batch (`final_hidden`: also the
        target's last hidden states, which held-out evaluation's sampled acceptance reads)."""
        plan = self.module.plan(batch["input_ids"], batch["loss_mask"], batch["attention_mask"], row_seeds=seeds,
                                doc_ids=batch.get("doc_ids"), position_ids=batch.get("position_ids"))
        right_padded = "doc_ids" not in batch and _right_padded(batch["attention_mask"])
        batch = _to_device(batch, self.device)
        plan = plan.to(self.device, non_blocking=True)
        # distillation and the acceptance term: the target's final hidden states; the loss forms its logits chunk by chunk
        tb = self.target.generate_batch(
            batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
            return_final_hidden=self.return_logits or final_hidden,
            right_padded=right_padded, position_ids=batch.get("position_ids"), doc_ids=batch.get("doc_ids"),
        )
        with self.autocast():
            return module(tb, plan=plan)

    def __call__(self, step: int, step_batch: dict[str, torch.Tensor], stop: bool = False) -> PendingStep:
        parts, n_tok = [], 0.0
        rows = step_batch["input_ids"].shape[0]
        mbs = self.micro_batch_size
        n_micro = -(-rows // mbs)
        for micro in range(n_micro):
            batch = _micro_slice(step_batch, micro * mbs, mbs)
            n_tok += float(batch["attention_mask"].sum())  # on the CPU
            sync = micro == n_micro - 1
            ctx = self.model.no_sync() if (not sync and hasattr(self.model, "no_sync")) else nullcontext()
            with ctx:
                first_row = self.state.rank * rows + micro * mbs
                seeds = row_seeds(self.seed, step, first_row, batch["input_ids"].shape[0])
                out = self.forward(batch, self.model, seeds)
                out.loss_sum.backward()
            parts.append(out.sums())
        extra = torch.tensor([n_tok, 1.0 if stop else 0.0], dtype=torch.float64)
        totals = torch.cat([torch.stack(parts).sum(0), _to(extra, self.device)])  # LossSums, tokens, stop votes
        all_reduce_sum(totals, self.state)

        grads = [p.grad for p in self.params if p.grad is not None]
        if any(hasattr(g, "full_tensor") for g in grads):  # FSDP2 DTensors: scale with a host float
            totals = totals.cpu()
            weight = float(LossSums.weight_of(totals))
            if weight > 0:
                scale = self.state.world_size / weight
                for g in grads:
                    g.mul_(scale)
                gnorm_t = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip).full_tensor()
            else:
                gnorm_t = torch.zeros((), device=self.device)
            return self._update_on_host(torch.cat([totals, gnorm_t.double().cpu().view(1)]))
        # No-op on zero gradients when nothing is supervised (W = 0): the update is skipped then.
        weight = LossSums.weight_of(totals)
        scale = self.state.world_size / weight.clamp(min=1e-30)
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))
        gnorm_t = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        if not self.defer:
            return self._update_on_host(torch.cat([totals, gnorm_t.double().view(1)]).cpu())  # the one host sync
        skip = ~(torch.isfinite(gnorm_t) & torch.isfinite(LossSums.loss_sum_of(totals)) & (weight > 0))
        self.optimizer.found_inf = skip.float()  # fused AdamW leaves params and state alone where it is 1
        self.optimizer.grad_scale = None
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale
        self.optimizer.zero_grad(set_to_none=True)
        vec = torch.cat([totals, gnorm_t.double().view(1), skip.double().view(1)])
        if self.device.type != "cuda":
            return PendingStep(vec.cpu(), deferred=True)
        host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
        host.copy_(vec, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(host, event, deferred=True)

    def _update_on_host(self, host: torch.Tensor) -> PendingStep:
        """Decide the update from statistics already on the host (host: sums, tokens, stops, grad norm)."""
        sums = LossSums.from_vector(host)
        gnorm = float(host[-1])
        finite = math.isfinite(gnorm) and math.isfinite(sums.loss)
        supervised = sums.weight_sum > 0
        if finite and supervised:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        skipped = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64)
        return PendingStep(torch.cat([host.double(), skipped]))
