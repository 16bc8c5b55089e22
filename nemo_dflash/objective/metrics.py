"""What a training step measures: the loss output's sums (`DFlashLossOutput`, reduced over micro-steps and
ranks as `LossSums`), the simulated acceptance length and the speculative-sampling accept probability per slot.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import nn

from nemo_dflash.engine.acceptance import accepted_prefix
from nemo_dflash.engine.sampling import SamplingParams


@dataclass(frozen=True)
class LossSums:
    """The loss output's sums on the host, after reducing over micro-steps and ranks.

    Rates (loss, accuracy, acceptance length) are formed only from these global sums, so they
    do not depend on how a batch was split between ranks and accumulation micro-steps.
    """

    weight_sum: float = 0.0
    loss_sum: float = 0.0
    correct: float = 0.0
    num_labels: float = 0.0
    accept_sum: float = 0.0
    num_blocks: float = 0.0
    sampled_accept_sum: float = 0.0  # expected block length under speculative sampling (held-out only)
    greedy_draft_accept_sum: float = 0.0  # the same with the draft proposing its argmax (one-hot q)
    sampled_blocks: float = 0.0
    # what a step's model FLOPs follow from (train/flops.py): blocks with a valid anchor, the keys their queries
    # see (block x (anchor's position in its document + block)), context tokens the target runs, and its causal
    # attention pairs (sum over documents of L(L+1)/2; unpacked rows count the batch's longest row, as padded)
    valid_blocks: float = 0.0
    visible_keys: float = 0.0
    context_tokens: float = 0.0
    context_pairs: float = 0.0
    # the acceptance loss term's accept probability a = sum_x min(p_T, q), summed over valid label slots, and
    # those slots' count (0 when `loss.accept_weight` is off)
    accept_prob_sum: float = 0.0
    accept_prob_slots: float = 0.0
    # a candidate selector's (DFlash2): its loss term (weighted like the unary loss), the unary argmax's simulated
    # acceptance beside the walk's (accept_sum is the walk's then), top-K recall, and the oracle walk that picks
    # the true token whenever it is a candidate
    selector_loss_sum: float = 0.0
    unary_accept_sum: float = 0.0
    topk_hits: float = 0.0
    oracle_accept_sum: float = 0.0
    # where the T=0 -> T>0 loss sits, held-out only (beside the sampled acceptance): per valid label slot, the
    # proposal's T=0 hit (teacher-forced: conditional on the slots before) and its accept probability under
    # speculative sampling, summed separately for the first label slot and the later ones
    slot1_greedy_sum: float = 0.0
    slot1_sampled_sum: float = 0.0
    slot1_slots: float = 0.0
    later_greedy_sum: float = 0.0
    later_sampled_sum: float = 0.0
    later_slots: float = 0.0

    @classmethod
    def size(cls) -> int:
        """Length of the vector `DFlashLossOutput.sums()` returns."""
        return len(fields(cls))

    @classmethod
    def from_vector(cls, vec: torch.Tensor) -> "LossSums":
        """Read back a (reduced) `DFlashLossOutput.sums()` vector."""
        return cls(*(float(x) for x in vec[: cls.size()].tolist()))

    @staticmethod
    def weight_of(vec: torch.Tensor) -> torch.Tensor:
        """The weight sum inside a sums vector, left on its device (the step decides on it without a sync)."""
        return vec[0]

    @staticmethod
    def loss_sum_of(vec: torch.Tensor) -> torch.Tensor:
        """The loss sum inside a sums vector, left on its device."""
        return vec[1]

    @property
    def loss(self) -> float:
        return self.loss_sum / self.weight_sum if self.weight_sum > 0 else 0.0

    def rates(self, prefix: str = "") -> dict[str, float]:
        """Loss per unit weight, label accuracy and simulated acceptance length per block; where the
        sampled acceptance was measured, its expected block length (draft sampled, and draft argmax)."""
        out = {
            f"{prefix}loss": self.loss,
            f"{prefix}accuracy": self.correct / max(self.num_labels, 1.0),
            f"{prefix}accept_len": self.accept_sum / max(self.num_blocks, 1.0),
        }
        if self.sampled_blocks > 0:
            out[f"{prefix}sampled_accept_len"] = self.sampled_accept_sum / self.sampled_blocks
            out[f"{prefix}sampled_accept_len_greedy_draft"] = self.greedy_draft_accept_sum / self.sampled_blocks
        if self.accept_prob_slots > 0:
            out[f"{prefix}accept_prob"] = self.accept_prob_sum / self.accept_prob_slots
        if self.topk_hits > 0 or self.selector_loss_sum > 0:
            out[f"{prefix}selector_loss"] = self.selector_loss_sum / self.weight_sum if self.weight_sum > 0 else 0.0
            out[f"{prefix}unary_accept_len"] = self.unary_accept_sum / max(self.num_blocks, 1.0)
            out[f"{prefix}topk_recall"] = self.topk_hits / max(self.num_labels, 1.0)
            out[f"{prefix}oracle_accept_len"] = self.oracle_accept_sum / max(self.num_blocks, 1.0)
        if self.slot1_slots > 0:
            out[f"{prefix}slot1_accept"] = self.slot1_greedy_sum / self.slot1_slots
            out[f"{prefix}sampled_slot1_accept"] = self.slot1_sampled_sum / self.slot1_slots
            if self.later_slots > 0:
                out[f"{prefix}later_accept"] = self.later_greedy_sum / self.later_slots
                out[f"{prefix}sampled_later_accept"] = self.later_sampled_sum / self.later_slots
        return out


@dataclass
class DFlashLossOutput:
    """Sums, so ranks and accumulation micro-steps can be reduced before normalising."""

    loss_sum: torch.Tensor  # sum_k w_k * loss_k (differentiable)
    weight_sum: torch.Tensor  # sum_k w_k
    correct: torch.Tensor  # argmax == label on valid label slots
    num_labels: torch.Tensor
    accept_sum: torch.Tensor  # sum over valid blocks of the simulated acceptance length
    num_blocks: torch.Tensor
    sampled_accept_sum: Optional[torch.Tensor] = None  # `expected_acceptance` summed over blocks, when measured
    greedy_draft_accept_sum: Optional[torch.Tensor] = None
    sampled_blocks: Optional[torch.Tensor] = None
    valid_blocks: Optional[torch.Tensor] = None
    visible_keys: Optional[torch.Tensor] = None
    context_tokens: Optional[torch.Tensor] = None
    context_pairs: Optional[torch.Tensor] = None
    accept_prob_sum: Optional[torch.Tensor] = None  # the acceptance term's a summed over valid label slots, when on
    accept_prob_slots: Optional[torch.Tensor] = None
    selector_loss_sum: Optional[torch.Tensor] = None  # a candidate selector's (DFlash2), as in `LossSums`
    unary_accept_sum: Optional[torch.Tensor] = None
    topk_hits: Optional[torch.Tensor] = None
    oracle_accept_sum: Optional[torch.Tensor] = None
    slot1_greedy_sum: Optional[torch.Tensor] = None  # the T=0 / T>0 split by slot, as in `LossSums`
    slot1_sampled_sum: Optional[torch.Tensor] = None
    slot1_slots: Optional[torch.Tensor] = None
    later_greedy_sum: Optional[torch.Tensor] = None
    later_sampled_sum: Optional[torch.Tensor] = None
    later_slots: Optional[torch.Tensor] = None

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.weight_sum.clamp(min=1e-12)

    def sums(self) -> torch.Tensor:
        """The detached sums as one float64 vector in `LossSums` order, on the loss's device:
        added over micro-steps and all-reduced in one call, then read with `LossSums.from_vector`."""
        zero = self.weight_sum.new_zeros(())
        return torch.stack([(getattr(self, f.name) if getattr(self, f.name) is not None else zero).detach().double()
                            for f in fields(LossSums)])


def acceptance_lengths(correct: torch.Tensor, label_valid: torch.Tensor) -> torch.Tensor:
    """[B, A, block] -> [B, A]: 1 + length of the run of correct slots from slot 1."""
    return 1 + accepted_prefix((correct & label_valid)[..., 1:])


def slot_acceptance(
    draft_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_head: nn.Module, sampling: SamplingParams,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per label slot, the probability speculative sampling accepts it: (sum_x min(p, q), p(argmax q)).

    p is the target's distribution at the slot (from its final hidden state there, through the shared
    lm_head), q the draft's, both at `sampling`'s temperature and filtered by its top-k / top-p; the
    second figure is the accept probability when the draft proposes its argmax as a one-hot q. Rows of
    [N, H] in, [N] fp32 out; `chunk_size` rows of logits at a time, no gradient.
    """
    a_sampled = torch.empty(draft_hidden.shape[0], dtype=torch.float32, device=draft_hidden.device)
    a_greedy = torch.empty_like(a_sampled)
    w = lm_head.weight
    with torch.no_grad():
        for s in range(0, draft_hidden.shape[0], chunk_size):
            q_logits = lm_head(draft_hidden[s : s + chunk_size].to(w.dtype)).float()
            p = sampling.probs(lm_head(teacher_hidden[s : s + chunk_size].to(w.dtype)))
            a_sampled[s : s + chunk_size] = torch.minimum(p, sampling.probs(q_logits)).sum(-1)
            a_greedy[s : s + chunk_size] = p.gather(-1, q_logits.argmax(-1, keepdim=True)).squeeze(-1)
    return a_sampled, a_greedy
