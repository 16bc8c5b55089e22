"""The DFlash trainer module: anchors -> block inputs -> block attention mask -> draft -> loss.

Training runs many blocks per sequence in one draft forward. Each block i starts at an
anchor a_i (a supervised token), holds `[token[a_i], MASK, ..., MASK]` at positions
a_i..a_i+B-1, sees the target context strictly before a_i plus its own block
(bidirectionally), and slot k >= 1 predicts token[a_i + k] with weight exp(-(k-1)/gamma).
This batched formulation must equal running each block alone, the way inference does
(tests/test_core.py checks exactly that).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nemo_dflash.engine.acceptance import expected_block_length
from nemo_dflash.engine.sampling import SamplingParams
from nemo_dflash.objective.accept_loss import accept_chunk, accept_lm_loss, check_accept
from nemo_dflash.objective.anchors import (
    BlockPlan, block_positions, build_block_input_ids, loss_decay_weights, plan_blocks,
)
from nemo_dflash.objective.block_mask import build_dense_block_mask, build_flex_block_mask
from nemo_dflash.objective.cross_entropy import (
    _compiled_on_cuda, _fusable, chunked_lm_loss, teacher_expected_embedding,
)
from nemo_dflash.objective.fused_loss import LOSS_IMPLS, argmax_chunk, fused_lm_loss, resolve_loss_impl
from nemo_dflash.objective.metrics import DFlashLossOutput, acceptance_lengths, slot_acceptance
from nemo_dflash.objective.selector_loss import (
    SELECTOR_OUTSIDE, dpace_weights, selector_lm_loss, selector_slot_acceptance,
)
from nemo_dflash.target import DFlashTargetBatch


def _rows_at(source: torch.Tensor, src: torch.Tensor, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, S, H] per-position rows -> [N, H] for the loss's label slots: the rows at `src` [B, L] (the position
    each slot's token is predicted from), then `sel`'s valid slots when the plan selects them."""
    rows = source.gather(1, src.unsqueeze(-1).expand(-1, -1, source.shape[-1])).reshape(-1, source.shape[-1])
    return rows if sel is None else rows.index_select(0, sel)


def draft_block_hidden(
    draft: nn.Module,
    embed_tokens: nn.Module,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    key_valid: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    *,
    backend: str = "sdpa",
    ctx_pos: Optional[torch.Tensor] = None,
    anchor_pos: Optional[torch.Tensor] = None,
    ctx_start: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The draft's final hidden states of every block, [B, A*block, H]: block i is `[token[a_i], MASK...]`
    at positions a_i.., seeing the target features strictly before a_i and its own block.

    The training step's forward; evaluation's replay (`evaluation.replay`) runs the same one to read the
    draft's greedy block at every answer position. `ctx_pos` / `anchor_pos` default to absolute positions.
    """
    bsz, seq = input_ids.shape
    block_ids = build_block_input_ids(input_ids, anchors, block_size, mask_token_id)
    with torch.no_grad():
        noise = embed_tokens(block_ids.flatten(1))  # [B, A*blk, H], frozen
    if ctx_pos is None:
        ctx_pos = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
    anchor_pos = anchor_pos if anchor_pos is not None else anchors
    pos = torch.cat([ctx_pos, block_positions(anchor_pos, block_size).flatten(1)], dim=1)
    if backend == "flex":
        mask = build_flex_block_mask(anchors, valid, key_valid, block_size, ctx_start=ctx_start)
    else:
        mask = build_dense_block_mask(anchors, valid, key_valid, block_size, ctx_start=ctx_start)
    return draft(noise_embedding=noise, target_hidden=target_hidden, position_ids=pos, attention_mask=mask,
                 backend=backend, block_size=block_size)


class DFlashTrainerModule(nn.Module):
    """Wraps the draft with the target's frozen embedding and lm_head for one training step.

    The embedding and lm_head are held by reference (not registered as submodules), so
    DDP/FSDP wrapping, optimizers and checkpoints of this module see the draft only.
    """

    def __init__(
        self,
        draft: nn.Module,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        *,
        num_anchors: int = 512,
        loss_decay_gamma: Optional[float] = None,
        attn_backend: str = "sdpa",
        distill_weight: float = 0.0,
        ce_chunk_size: int = 4096,
        fused_ce: bool = True,
        accept_sampling: Optional[SamplingParams] = None,
        loss_impl: str = "chunked",
        accept_weight: float = 0.0,
        accept_temperature: float = 1.0,
        accept_form: str = "log",
        selector_weight: float = 1.0,
        selector_outside: str = "inject",
        position_weights: str = "decay",
        dpace_alpha: float = 0.5,
    ) -> None:
        super().__init__()
        if attn_backend not in ("sdpa", "eager", "flex"):
            raise ValueError(f"attn_backend must be 'sdpa', 'eager' or 'flex', got {attn_backend!r}")
        self.draft = draft
        self._frozen = (embed_tokens, lm_head)
        self.block_size = int(draft.config.block_size)
        self.mask_token_id = int(draft.config.mask_token_id)
        self.num_anchors = int(num_anchors)
        self.gamma = loss_decay_gamma
        self.attn_backend = attn_backend
        self.distill_weight = float(distill_weight)
        self.ce_chunk_size = int(ce_chunk_size)
        self.fused_ce = bool(fused_ce)
        if loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {list(LOSS_IMPLS)}, got {loss_impl!r}")
        self.loss_impl = loss_impl  # chunked | cce | liger | auto (`fused_loss`), resolved per device when run
        # held-out only (no grad, final hidden states given): the expected acceptance under speculative sampling
        self.accept_sampling = accept_sampling
        # the acceptance loss term (`accept_loss`): loss = (1 - d - w) hard CE + d soft CE + w accept term
        check_accept(float(accept_weight), float(accept_temperature), accept_form)
        if float(accept_weight) + self.distill_weight > 1.0 + 1e-9:
            raise ValueError(f"distill_weight + accept_weight must be <= 1, got {self.distill_weight} + "
                             f"{accept_weight}")
        self.accept_weight = float(accept_weight)
        self.accept_temperature = float(accept_temperature)
        self.accept_form = accept_form
        # DFlash2: the candidate selector's term, and the per-slot weights of every term
        if selector_outside not in SELECTOR_OUTSIDE:
            raise ValueError(f"selector_outside must be one of {list(SELECTOR_OUTSIDE)}, got {selector_outside!r}")
        if position_weights not in ("decay", "dpace"):
            raise ValueError(f"position_weights must be 'decay' or 'dpace', got {position_weights!r}")
        self.selector_weight = float(selector_weight)
        self.selector_outside = selector_outside
        self.position_weights = position_weights
        self.dpace_alpha = float(dpace_alpha)
        cfg = draft.config
        self.output_multiplier = float(getattr(cfg, "output_multiplier", 1.0))
        self.softcap = float(getattr(cfg, "final_logit_softcapping", 0.0) or 0.0)
        if self.softcap > 0:
            raise ValueError("training a draft with final_logit_softcapping > 0 is not supported (the fused "
                             "cross-entropy has no soft-cap): set draft.dflash2.final_logit_softcapping=0")
        if self.output_multiplier != 1.0 and (self.distill_weight > 0 or self.accept_weight > 0):
            raise ValueError("draft.dflash2.output_multiplier != 1 trains with hard cross-entropy only: set "
                             "loss.distill_weight=0 and loss.accept_weight=0, or output_multiplier=1")

    @property
    def embed_tokens(self) -> nn.Module:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._frozen[1]

    def _fused_kernel(self, device: torch.device, expected_teacher: bool) -> Optional[str]:
        """The fused CE kernel (cce | liger) this step's loss runs with, or None for `chunked_lm_loss`:
        training steps only (held-out evaluation keeps the reference path), a frozen bias-free Linear
        lm_head, and distillation (if on) through the target's expected embeddings."""
        if self.loss_impl == "chunked" or not torch.is_grad_enabled() or not expected_teacher:
            return None
        if not _fusable(self.lm_head, None, 0.0):
            return None
        impl = resolve_loss_impl(self.loss_impl, device)
        return None if impl == "chunked" else impl

    def _accept_term(self, batch: DFlashTargetBatch, h_sel: torch.Tensor, src: torch.Tensor,
                     sel: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance loss term and a per loss row (`accept_loss.accept_lm_loss`): each row scored against
        the target's state (or logits) at `src` [B, L], the position that predicts the same token; the target's
        rows are gathered by index chunk by chunk, never copied out whole."""
        if batch.final_hidden is None and batch.logits is None:
            raise ValueError("accept_weight > 0 needs the target's distribution: call "
                             "generate_batch(return_final_hidden=True) (or return_logits=True)")
        if not _fusable(self.lm_head, None, 0.0):
            raise ValueError("accept_weight > 0 needs a frozen, bias-free Linear lm_head (the target's)")
        source = batch.final_hidden if batch.final_hidden is not None else batch.logits
        bsz, seq = source.shape[:2]
        index = (torch.arange(bsz, device=src.device).unsqueeze(1) * seq + src).flatten()
        if sel is not None:
            index = index.index_select(0, sel)
        return accept_lm_loss(
            h_sel, self.lm_head.weight, source.reshape(bsz * seq, -1), self.ce_chunk_size, index=index,
            teacher_is_logits=batch.final_hidden is None, temperature=self.accept_temperature, form=self.accept_form,
            compiled=_compiled_on_cuda(accept_chunk, h_sel.device),
        )

    def plan(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        row_seeds: Optional[Sequence[int]] = None,
        doc_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> BlockPlan:
        """This module's `plan_blocks` (its block size and anchor count), e.g. on the CPU batch."""
        return plan_blocks(input_ids, loss_mask, attention_mask, self.block_size, self.num_anchors, generator, row_seeds,
                           doc_ids=doc_ids, position_ids=position_ids)

    def forward(
        self,
        batch: DFlashTargetBatch,
        generator: Optional[torch.Generator] = None,
        anchors: Optional[torch.Tensor] = None,
        valid: Optional[torch.Tensor] = None,
        row_seeds: Optional[Sequence[int]] = None,
        plan: Optional[BlockPlan] = None,
    ) -> DFlashLossOutput:
        """The draft's blocks over the target batch, their weighted loss sums and the step's metrics."""
        input_ids, attn, loss_mask = batch.input_ids, batch.attention_mask, batch.loss_mask
        bsz, seq = input_ids.shape
        blk = self.block_size
        if plan is None:
            plan = plan_blocks(input_ids, loss_mask, attn, blk, self.num_anchors, generator, row_seeds, anchors, valid,
                               doc_ids=batch.doc_ids, position_ids=batch.position_ids)
        anchors, valid, label_valid, sel = plan.anchors, plan.valid, plan.label_valid, plan.sel
        n_blk = anchors.shape[1]

        hidden = draft_block_hidden(
            self.draft, self.embed_tokens, input_ids, batch.hidden_states, attn, anchors, valid, blk,
            self.mask_token_id, backend=self.attn_backend, ctx_pos=batch.position_ids, anchor_pos=plan.anchor_pos,
            ctx_start=plan.ctx_start,
        )  # [B, A*blk, H]
        w_sel, h_sel, src = self._loss_rows(hidden, plan, seq, input_ids.device)
        # with the acceptance term on, the CE part is (1 - w) * [(1 - d') hard + d' soft], d' = d / (1 - w)
        w_acc = self.accept_weight
        d_ce = self.distill_weight
        if w_acc > 0:
            d_ce = min(1.0, self.distill_weight / (1.0 - w_acc)) if w_acc < 1 else 0.0
        teacher = teacher_h = teacher_e = None
        if d_ce > 0:
            src = _label_sources(src, anchors, blk, seq)
            teacher, teacher_h, teacher_e = self._teacher_rows(batch, src, sel)
        # the unary logits are output_multiplier * lm_head(h) (DFlash2's; 1 for DFlash-1): scale the rows
        h_ce = h_sel if self.output_multiplier == 1.0 else h_sel * self.output_multiplier
        selector = self.draft.candidate_selector if getattr(self.draft, "has_selector", False) else None
        tok_loss, pred, candidates, candidate_logits = self._token_loss(h_sel, h_ce, plan.labels, teacher, teacher_h,
                                                                        teacher_e, d_ce, selector)
        accept = None
        if w_acc > 0:
            src = _label_sources(src, anchors, blk, seq)
            acc_term, accept = self._accept_term(batch, h_sel, src, sel)
            tok_loss = (1.0 - w_acc) * tok_loss + w_acc * acc_term
        weight_sum = w_sel.sum()
        if self.position_weights == "dpace":
            w_sel = _to_rows(dpace_weights(_to_slots(tok_loss.detach(), sel, bsz, n_blk, blk), label_valid[..., 1:],
                                           self.dpace_alpha), sel)
            weight_sum = label_valid.sum().to(w_sel.dtype)  # D-PACE normalises by the valid slots
        term = None
        if selector is not None:
            term = selector_lm_loss(
                h_sel, self.lm_head.weight, selector, plan.labels,
                _rows_at(input_ids.unsqueeze(-1), _predecessor_positions(anchors, blk, seq, sel), sel).squeeze(-1),
                self.ce_chunk_size, multiplier=self.output_multiplier, outside=self.selector_outside,
                candidates=candidates, candidate_logits=candidate_logits,
            )
        sampled = None
        if (self.accept_sampling is not None and not self.accept_sampling.greedy and not torch.is_grad_enabled()
                and batch.final_hidden is not None):
            src = _label_sources(src, anchors, blk, seq)
            sampled = self._sampled_acceptance(batch, h_ce, src, sel, term)
        # `0 * hidden.sum()` keeps every draft parameter in the graph when no label is valid,
        # so DDP/FSDP gradient collectives still run on this rank (no hang).
        loss_sum = (tok_loss * w_sel).sum() + 0.0 * hidden.sum()
        sel_sum = None
        if term is not None:
            sel_sum = (term.loss * w_sel).sum()
            loss_sum = loss_sum + self.selector_weight * sel_sum
            if h_sel.shape[0] == 0:  # no loss rows: the selector's parameters still join the gradient collectives
                loss_sum = loss_sum + 0.0 * sum(p.sum() for p in self.draft.candidate_selector.parameters())
        with torch.no_grad():
            return self._loss_output(batch, plan, loss_sum, weight_sum, pred, term, sel_sum, accept, sampled)

    def _loss_rows(self, hidden: torch.Tensor, plan: BlockPlan, seq: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The loss rows of the draft's hidden states: (their decay weights, the rows, and for packed rows the
        positions the target predicts each label from; None otherwise, formed when a term needs them)."""
        bsz, blk = hidden.shape[0], self.block_size
        anchors, label_valid, sel = plan.anchors, plan.label_valid, plan.sel
        n_blk = anchors.shape[1]
        decay = loss_decay_weights(blk, self.gamma, device)
        if sel is None:
            # packed: every block's slots 1.. (fixed shape); invalid ones weigh 0
            w_sel = (decay[1:] * label_valid[..., 1:]).flatten()
            h_sel = hidden.view(bsz, n_blk, blk, -1)[:, :, 1:].reshape(bsz * n_blk * (blk - 1), -1)
            # The target predicts token[a+k] from position a+k-1, k = 1..blk-1.
            src = (anchors.unsqueeze(-1) + torch.arange(blk - 1, device=anchors.device)).clamp(max=seq - 1).flatten(1)
            return w_sel, h_sel, src
        # sel holds only valid label slots, whose weight is the slot's decay weight
        w_sel = decay[sel % blk]
        h_sel = hidden.reshape(bsz * n_blk * blk, -1).index_select(0, sel)
        return w_sel, h_sel, None

    def _teacher_rows(self, batch: DFlashTargetBatch, src: torch.Tensor, sel: Optional[torch.Tensor]
                      ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The target's distribution at each loss row, for distillation: (its logits, or its final hidden states,
        or its expected embedding under the shared frozen head), one of the three set."""
        teacher = teacher_h = teacher_e = None
        if batch.logits is None and batch.final_hidden is None:
            raise ValueError("distill_weight > 0 needs the target's distribution: call "
                             "generate_batch(return_final_hidden=True) (or return_logits=True)")
        source = batch.final_hidden if batch.final_hidden is not None else batch.logits
        # through the shared frozen head, the target's distribution at a position enters the loss
        # only as its expected embedding: formed once per position, then gathered per block slot
        expected = batch.final_hidden is not None and _fusable(self.lm_head, None, 0.0)
        if expected:
            source = teacher_expected_embedding(source, self.lm_head.weight, self.ce_chunk_size)
        rows = _rows_at(source, src, sel)
        if expected:
            teacher_e = rows
        elif batch.final_hidden is not None:
            teacher_h = rows
        else:
            teacher = rows
        return teacher, teacher_h, teacher_e

    def _token_loss(self, h_sel: torch.Tensor, h_ce: torch.Tensor, labels: torch.Tensor,
                    teacher: Optional[torch.Tensor], teacher_h: Optional[torch.Tensor],
                    teacher_e: Optional[torch.Tensor], d_ce: float, selector: Any) -> tuple[Any, Any, Any, Any]:
        """The CE of each loss row over the frozen head: (losses, argmax predictions, and for a selector draft the
        top-K unary candidates and their logits, from the CE's own logits where it forms them; else None)."""
        kernel = self._fused_kernel(h_sel.device, teacher is None and teacher_h is None)
        if kernel is not None:
            tok_loss, pred = fused_lm_loss(
                kernel, h_ce, self.lm_head.weight, labels, self.ce_chunk_size, teacher_e, d_ce,
                compiled_argmax=_compiled_on_cuda(argmax_chunk, h_sel.device),
            )
            return tok_loss, pred, None, None
        if selector is not None:
            return chunked_lm_loss(
                h_ce, labels, self.lm_head, self.ce_chunk_size, teacher, d_ce, fused=self.fused_ce,
                teacher_hidden=teacher_h, teacher_embedding=teacher_e, top_k=selector.top_k,
            )
        tok_loss, pred = chunked_lm_loss(
            h_ce, labels, self.lm_head, self.ce_chunk_size, teacher, d_ce, fused=self.fused_ce,
            teacher_hidden=teacher_h, teacher_embedding=teacher_e,
        )
        return tok_loss, pred, None, None

    def _sampled_acceptance(self, batch: DFlashTargetBatch, h_ce: torch.Tensor, src: torch.Tensor,
                            sel: Optional[torch.Tensor], term: Any) -> Any:
        """Held-out evaluation's per-slot accept probabilities under `accept_sampling` (the draft's sampled and
        greedy proposals)."""
        t_rows = _rows_at(batch.final_hidden, src, sel)
        if term is not None:  # q from the walk given the true predecessor, as decoding proposes
            return selector_slot_acceptance(term.scores, term.candidates, term.pick, t_rows, self.lm_head,
                                            self.accept_sampling, self.ce_chunk_size)
        return slot_acceptance(h_ce, t_rows, self.lm_head, self.accept_sampling, self.ce_chunk_size)

    def _loss_output(self, batch: DFlashTargetBatch, plan: BlockPlan, loss_sum: torch.Tensor,
                     weight_sum: torch.Tensor, pred: torch.Tensor, term: Any, sel_sum: Optional[torch.Tensor],
                     accept: Optional[torch.Tensor], sampled: Any) -> DFlashLossOutput:
        """The step's loss sums and metrics (simulated acceptance, the selector's and the accept term's figures)."""
        anchors, label_valid, sel, blk = plan.anchors, plan.label_valid, plan.sel, self.block_size
        bsz, n_blk = anchors.shape

        def by_slot(ok: torch.Tensor) -> torch.Tensor:
            return F.pad(_to_slots(ok, sel, bsz, n_blk, blk), (1, 0), value=False)

        # a selector's walk proposes its pick; DFlash-1 each slot's argmax
        correct = by_slot((term.pick if term is not None else pred) == plan.labels)
        block_ok = label_valid.any(-1)
        acc_len = acceptance_lengths(correct, label_valid)
        return_out = DFlashLossOutput(
            loss_sum=loss_sum,
            weight_sum=weight_sum,
            correct=(correct & label_valid).sum(),
            num_labels=label_valid.sum(),
            accept_sum=(acc_len * block_ok).sum().float(),
            num_blocks=block_ok.sum(),
            **_flop_counts(batch, plan, blk),
        )
        if term is not None:
            return_out.selector_loss_sum = sel_sum.detach()
            return_out.unary_accept_sum = (acceptance_lengths(by_slot(pred == plan.labels), label_valid)
                                           * block_ok).sum().float()
            inside = by_slot(term.inside)
            return_out.topk_hits = (inside & label_valid).sum()
            return_out.oracle_accept_sum = (acceptance_lengths(inside, label_valid) * block_ok).sum().float()
        if accept is not None:
            on = label_valid[..., 1:].flatten() if sel is None else None
            return_out.accept_prob_sum = (accept * on).sum() if on is not None else accept.sum()
            return_out.accept_prob_slots = label_valid.sum()
        if sampled is not None:
            lengths = []
            for alpha in sampled:
                per_slot = _to_slots(alpha, sel, bsz, n_blk, blk) * label_valid[..., 1:]
                lengths.append((expected_block_length(per_slot) * block_ok).sum())
            return_out.sampled_accept_sum, return_out.greedy_draft_accept_sum = lengths
            return_out.sampled_blocks = block_ok.sum()
            on = label_valid[..., 1:]
            hit = (correct[..., 1:] & on).double()
            alpha = _to_slots(sampled[0], sel, bsz, n_blk, blk).double() * on
            return_out.slot1_greedy_sum, return_out.later_greedy_sum = hit[..., 0].sum(), hit[..., 1:].sum()
            return_out.slot1_sampled_sum, return_out.later_sampled_sum = alpha[..., 0].sum(), alpha[..., 1:].sum()
            return_out.slot1_slots, return_out.later_slots = on[..., 0].sum(), on[..., 1:].sum()
        return return_out


def _label_sources(src: Optional[torch.Tensor], anchors: torch.Tensor, blk: int, seq: int) -> torch.Tensor:
    """The positions the target predicts each label slot from (a+k-1 for slot k), once: `src` if already formed."""
    if src is not None:
        return src
    return (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)


def _to_slots(rows: torch.Tensor, sel: Optional[torch.Tensor], bsz: int, n_blk: int, blk: int) -> torch.Tensor:
    """Per loss row values [N] -> [B, A, blk - 1] by label slot 1..blk-1 (zero / False where no row is)."""
    if sel is None:
        return rows.view(bsz, n_blk, blk - 1)
    full = torch.zeros(bsz * n_blk * blk, dtype=rows.dtype, device=rows.device)
    full[sel] = rows
    return full.view(bsz, n_blk, blk)[..., 1:]


def _to_rows(slots: torch.Tensor, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """The inverse of `_to_slots`: [B, A, blk - 1] -> the loss rows [N]."""
    if sel is None:
        return slots.flatten()
    return F.pad(slots, (1, 0)).flatten().index_select(0, sel)


def _predecessor_positions(anchors: torch.Tensor, blk: int, seq: int, sel: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, L] positions of the token before each label slot (a + k - 1: the anchor for slot 1), laid out as
    `_rows_at` reads them for the loss rows."""
    if sel is None:
        return (anchors.unsqueeze(-1) + torch.arange(blk - 1, device=anchors.device)).clamp(max=seq - 1).flatten(1)
    return (block_positions(anchors, blk) - 1).clamp(0, seq - 1).flatten(1)


def _flop_counts(batch: DFlashTargetBatch, plan: BlockPlan, block: int) -> dict[str, torch.Tensor]:
    """The `LossSums` counts a step's model FLOPs follow from, as tensors (no host sync)."""
    anchor_pos = plan.anchor_pos if plan.anchor_pos is not None else plan.anchors
    valid = plan.valid
    visible = (block * (anchor_pos + block) * valid).sum()
    if batch.doc_ids is not None and batch.position_ids is not None:  # packed: per document
        real = batch.doc_ids >= 0
        tokens = real.sum()
        pairs = ((batch.position_ids + 1) * real).sum()
    else:  # unpacked: every row as long as the longest, as the target runs them
        rows = batch.attention_mask.shape[0]
        length = batch.attention_mask.sum(1).max()
        tokens = rows * length
        pairs = rows * length * (length + 1) // 2
    return {"valid_blocks": valid.sum(), "visible_keys": visible, "context_tokens": tokens, "context_pairs": pairs}
