"""The DFlash2 draft: the DFlash backbone plus a causal convolution over the block and a candidate selector.

A DFlash-1 draft predicts every block slot on its own (a marginal), so a block sampled slot by slot is no
coherent continuation. DFlash2 keeps the backbone and adds two modules (`../shared/reference/dflash2.md`):

- `BlockConv`, two a layer (around attention and around the MLP): a grouped, per-token ("dynamic") causal
  convolution over the block's own positions, zero taps across a block start. The layer is
  ``h += conv_out(attn(conv_in(norm(h))))`` and the same around the MLP. Identity init (``base[:, 0] = 1``, the
  rest and the kernel projection 0) makes a fresh DFlash2 layer compute exactly a DFlash layer.
- `CandidateSelector`: slot k's candidates C_k are the top-K of its unary logits u_k; the pair score of a
  successor b given the predecessor a is ``u_k(b) + <A[a] * (P h_k), B[b]>``. Decoding walks the block left to
  right, each slot chosen given the token actually chosen before it (`selector_walk`): the argmax at T=0, a draw
  from ``q_k = softmax(s_k / T)`` over C_k at T > 0, q kept for the standard accept test (lossless).

Weight names follow the engines' DFlash2 loaders: ``layers.{i}.attention_conv.base_kernel``,
``layers.{i}.attention_conv.kernel_projection.weight`` (``mlp_conv`` alike), and
``candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}`` (the codebooks plain
tensors). A zero conv kernel size turns the convolutions off, a zero selector rank the selector: each pair is
set together, as SGLang reads an absent pair.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nemo_dflash.draft.model.configuration import DFlashConfig
from nemo_dflash.draft.model.modeling import DFlashDecoderLayer, DFlashDraftModel
from nemo_dflash.engine.sampling import SlotUniforms, inverse_cdf

# dflash_config fields of a DFlash2 draft beyond DFlash's, with the defaults of the published fixture's sizes
# (output multiplier and soft-capping off: the values our drafts train with).
DFLASH2_DEFAULTS: dict[str, Any] = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "output_multiplier": 1.0,
    "final_logit_softcapping": 0.0,
}


def _field(name: str, cast: Callable[[Any], Any]) -> property:
    """A read-only attribute for one `dflash_config` field (the engines' names), its default when absent."""
    def get(self: "DFlash2Config") -> Any:
        value = self.dflash_config.get(name, DFLASH2_DEFAULTS[name])
        return cast(0 if value is None else value)
    return property(get)


class DFlash2Config(DFlashConfig):
    """A DFlash config whose `dflash_config` also holds the conv and selector sizes (the engines' fields)."""

    def __init__(self, dflash_config: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        kwargs.setdefault("architectures", ["DFlash2DraftModel"])
        dflash_config = {**DFLASH2_DEFAULTS, **dict(dflash_config or {})}
        super().__init__(dflash_config=dflash_config, **kwargs)
        check_dflash2_sizes(self)

    conv_kernel_size = _field("conv_kernel_size", int)
    conv_group_size = _field("conv_group_size", int)
    selector_rank = _field("selector_rank", int)
    selector_top_k = _field("selector_top_k", int)
    output_multiplier = _field("output_multiplier", float)
    final_logit_softcapping = _field("final_logit_softcapping", float)


def check_dflash2_sizes(config: Any) -> None:
    """`check_dflash2_fields` of a DFlash2 config."""
    check_dflash2_fields(int(config.hidden_size), int(config.vocab_size), int(config.block_size),
                         {k: config.dflash_config.get(k, v) for k, v in DFLASH2_DEFAULTS.items()})


def check_dflash2_fields(hidden: int, vocab: int, block: int, fields: dict[str, Any]) -> None:
    """One-line errors for conv and selector sizes (`fields`: dflash_config entries, defaults filled in) that a
    draft of this hidden size, vocabulary and block cannot be built with (ValueError; the builders turn it into the
    user's one-line error). The keys are named as the recipe writes them."""
    f = {**DFLASH2_DEFAULTS, **fields}
    h, v = hidden, vocab
    kc, gs = int(f["conv_kernel_size"]), int(f["conv_group_size"])
    rank, top_k = int(f["selector_rank"]), int(f["selector_top_k"])
    if kc < 0 or kc > block:
        raise ValueError(f"draft.dflash2.conv_kernel_size={kc} must be in [0, block_size={block}] "
                         "(0: no convolution)")
    if kc > 0 and (gs < 1 or h % gs):
        raise ValueError(f"draft.dflash2.conv_group_size={gs} must divide the hidden size {h} (channels a group; "
                         "the published drafts use 16)")
    if (rank == 0) != (top_k == 0) or rank < 0 or top_k < 0:
        raise ValueError(f"draft.dflash2.selector_rank={rank} and selector_top_k={top_k}: set both > 0, or both 0 "
                         "(no selector)")
    if top_k > v:
        raise ValueError(f"draft.dflash2.selector_top_k={top_k} is above the vocabulary ({v} tokens): use <= {v} "
                         "(the published drafts use 16)")
    if not float(f["output_multiplier"]) > 0 or float(f["final_logit_softcapping"] or 0.0) < 0:
        raise ValueError("draft.dflash2.output_multiplier must be > 0 and final_logit_softcapping >= 0 (0: off)")


def block_convolve(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, side: int, block: int,
                   groups: int) -> torch.Tensor:
    """One side of `BlockConv`: x [B, Q, H] in blocks of `block`, delta [B, Q, 2 * K * G] (`kernel_projection`'s),
    base [K, H] that side's base kernel. A plain function of tensors, so a captured step can run it compiled."""
    b, q, h = x.shape
    kernel_size = base.shape[0]
    xb = x.view(b, q // block, block, h)
    d = delta.view(b, q // block, block, 2, kernel_size, groups)[..., side, :, :]
    out = None
    for t in range(kernel_size):
        shifted = xb if t == 0 else F.pad(xb[:, :, : block - t], (0, 0, t, 0))  # z[i - t], 0 before the block
        # (base + d per group) * z, the group offsets broadcast over their channels (no [.., H] kernel formed)
        grouped = d[..., t, :].unsqueeze(-1) * shifted.view(*shifted.shape[:-1], groups, h // groups)
        term = base[t].to(x.dtype) * shifted + grouped.view_as(shifted)
        out = term if out is None else out + term
    return out.view(b, q, h)


class BlockConv(nn.Module):
    """Grouped dynamic causal convolution over each block's positions, one side before a sublayer and one after.

    ``y[i, c] = sum_{t < K} (base[s, t, c] + d_s[i, t, c // group]) * z[i - t, c]``, taps before the block's first
    position zero; ``d = kernel_projection(norm(h))`` per token, [2 sides, K taps, G groups].
    """

    convolve = staticmethod(block_convolve)  # `fuse_for_capture` sets a compiled one on the instance

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        """The identity convolution: the layer then computes exactly a DFlash layer."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block: int) -> torch.Tensor:
        return self.convolve(x, delta, self.base_kernel[side], side, block, self.groups)

    def fuse_for_capture(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
        """Run `block_convolve` compiled (`compile_fn(block_convolve)`) until the returned undo: a captured decode
        step then replays one fused kernel a side instead of ~8 tiny ones a tap (`engine.graphs.fused_elementwise`)."""
        self.convolve = compile_fn(block_convolve)
        return lambda: self.__dict__.pop("convolve", None)

    def prepare(self, z: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_in(z), the per-token kernel offsets for `finish`) of a sublayer's normalized input z [B, Q, H]."""
        delta = self.kernel_projection(z)
        return self._convolve(z, delta, 0, block), delta

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        """conv_out(y) of the sublayer's output, with the kernel offsets `prepare` made."""
        return self._convolve(y, delta.to(y.dtype), 1, block)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlash2Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        kc, gs = config.conv_kernel_size, config.conv_group_size
        self.attention_conv = BlockConv(config.hidden_size, kc, gs) if kc else None
        self.mlp_conv = BlockConv(config.hidden_size, kc, gs) if kc else None

    def forward(self, hidden, context, cos, sin, mask, backend, cache=None, block: int = 0) -> torch.Tensor:
        if self.attention_conv is None:
            return super().forward(hidden, context, cos, sin, mask, backend, cache)
        z, d = self.attention_conv.prepare(self.input_layernorm(hidden), block)
        hidden = hidden + self.attention_conv.finish(
            self.self_attn(z, context, cos, sin, mask, backend, cache), d, block)
        z, d = self.mlp_conv.prepare(self.post_attention_layernorm(hidden), block)
        return hidden + self.mlp_conv.finish(self.mlp(z), d, block)


class CandidateSelector(nn.Module):
    """Low-rank pair scores over each slot's top-K unary candidates (see `pair_scores`)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(std) for A and P, B zero: a fresh selector ranks the candidates as the unary logits do, and
        B's first gradient (through A[a] * P h, non-zero) starts the pair term."""
        with torch.no_grad():
            nn.init.normal_(self.hidden_projection.weight, std=std)
            nn.init.normal_(self.predecessor_codebook, std=std)
            self.successor_codebook.zero_()

    def pair_scores(self, hidden: torch.Tensor, candidate_logits: torch.Tensor, candidate_ids: torch.Tensor,
                    predecessors: torch.Tensor) -> torch.Tensor:
        """s(a -> b) = u(b) + <A[a] * (P h), B[b]> for each row's candidates b: hidden [..., H], candidate_logits
        and candidate_ids [..., K], predecessors [...] (the token chosen, or true, at the slot before)."""
        ph = self.hidden_projection(hidden)
        # F.embedding, not indexing: its backward reduces the rows' gradients by token (indexing's accumulates
        # through a generic scatter, several times slower on GPUs for millions of rows)
        ctx = F.embedding(predecessors, self.predecessor_codebook).to(ph.dtype) * ph  # [..., r]
        succ = F.embedding(candidate_ids, self.successor_codebook).to(ph.dtype)  # [..., K, r]
        return candidate_logits.float() + (succ @ ctx.unsqueeze(-1)).squeeze(-1).float()

    def lattice(self, hidden: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Pair terms of every (candidate of slot k - 1) x (candidate of slot k), for k = 1..S-1:
        hidden [R, S, H], candidate_ids [R, S, K] -> [R, S - 1, K, K] (one einsum; the walk then gathers)."""
        ph = self.hidden_projection(hidden[:, 1:])  # [R, S-1, r]
        pred = self.predecessor_codebook[candidate_ids[:, :-1]].to(ph.dtype)  # [R, S-1, K, r]
        succ = self.successor_codebook[candidate_ids[:, 1:]].to(ph.dtype)  # [R, S-1, K, r]
        return torch.einsum("bsiq,bsq,bsjq->bsij", pred, ph, succ).float()


def unary_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """u = softcap(output_multiplier * logits) (plain logits for a DFlash-1 draft); fp32."""
    m = float(getattr(config, "output_multiplier", 1.0) or 1.0)
    c = float(getattr(config, "final_logit_softcapping", 0.0) or 0.0)
    u = logits.float() * m if m != 1.0 else logits.float()
    return c * torch.tanh(u / c) if c > 0 else u


def compose_maps(maps: torch.Tensor) -> torch.Tensor:
    """Prefix compositions of index maps: maps [R, S, K] (slot s sends candidate i of slot s - 1 to maps[:, s, i])
    -> out [R, S, K] with out[:, s] = maps[:, s] o ... o maps[:, 0]. Doubling (log2 S gathers), so a greedy walk
    over a block is a handful of kernels rather than a few a slot."""
    out, step = maps, 1
    while step < maps.shape[1]:
        out = torch.cat([out[:, :step], out[:, step:].gather(2, out[:, :-step])], dim=1)
        step *= 2
    return out


Draw = Callable[[int, torch.Tensor], torch.Tensor]  # (slot, q over the candidates [R, K]) -> candidate index [R]


def selector_walk(selector: CandidateSelector, hidden: torch.Tensor, unary: torch.Tensor, anchors: torch.Tensor,
                  inv_temperature: Optional[torch.Tensor | float] = None, draw: Optional[Draw] = None
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The coherent path over a drafted block: (tokens [R, S], q [R, S, V] or None).

    hidden [R, S, H] and unary [R, S, V] of the S drafted slots, anchors [R] (the token before slot 0). Each slot's
    candidates are the top-K of its unary logits; its token is chosen given the token chosen before it (greedy
    left to right, not Viterbi): the argmax of the pair scores (lowest candidate index on ties) when `draw` is
    None, else ``draw(slot, q)`` with ``q = softmax(s * inv_temperature)`` over the candidates, q returned
    scattered over the vocabulary (0 outside C_k) for the accept test. Draws whose uniforms are known up front
    (`SlotUniforms`, the keyed engine's) are taken for every predecessor at once and the path followed through
    the composed maps, as the greedy walk's: a few kernels a block instead of a dozen a slot.
    """
    # sorted, largest first; exact ties come in torch.topk's order, which is not always the lower token id first
    cand_logits, cand_ids = unary.topk(selector.top_k, dim=-1)
    first = selector.pair_scores(hidden[:, 0], cand_logits[:, 0], cand_ids[:, 0], anchors)  # [R, K]
    lattice = selector.lattice(hidden, cand_ids) if hidden.shape[1] > 1 else None
    if draw is None:
        index = first.argmax(dim=-1, keepdim=True)  # [R, 1]
        if lattice is not None:
            # every slot's best successor of each candidate before it, at once; the path then follows these maps
            successor = (cand_logits[:, 1:].float().unsqueeze(2) + lattice).argmax(dim=-1)  # [R, S-1, K]
            index = torch.cat([index, compose_maps(successor).gather(2, index.unsqueeze(1).expand(
                -1, successor.shape[1], 1)).squeeze(2)], dim=1)
        return cand_ids.gather(-1, index.unsqueeze(-1)).squeeze(-1), None
    q = slot_distributions(first, cand_logits, lattice, inv_temperature)  # [R, S, K, K]
    if isinstance(draw, SlotUniforms):  # slot k's pick given each candidate i before it: a map, as at T=0
        index = compose_maps(inverse_cdf(q, draw.uniforms.unsqueeze(-1).expand(q.shape[:-1])))[..., 0]
    else:  # a draw that must see each q in turn (a generator's)
        index = walk_slot_by_slot(q, draw)
    before = torch.cat([torch.zeros_like(index[:, :1]), index[:, :-1]], dim=1)  # the row of q each slot drew from
    qs = q.gather(2, before.view(*before.shape, 1, 1).expand(-1, -1, 1, q.shape[-1])).squeeze(2)  # [R, S, K]
    tokens = cand_ids.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    q_full = torch.zeros(unary.shape, dtype=torch.float32, device=unary.device)
    return tokens, q_full.scatter_(-1, cand_ids, qs)


def slot_distributions(first: torch.Tensor, cand_logits: torch.Tensor, lattice: Optional[torch.Tensor],
                       inv_temperature: torch.Tensor | float) -> torch.Tensor:
    """Every q the walk can draw from, [R, S, K, K]: row i of slot k > 0 is softmax(s_k(. | candidate i of slot
    k - 1) * inv_temperature) over slot k's candidates; slot 0 has one predecessor (the anchor), its K rows alike.
    One softmax for the block: each row is the very q a slot-by-slot walk forms once it has drawn candidate i."""
    scores = first.view(first.shape[0], 1, 1, -1).expand(-1, 1, first.shape[-1], -1)  # [R, 1, K, K]
    if lattice is not None:
        scores = torch.cat([scores, cand_logits[:, 1:].float().unsqueeze(2) + lattice], dim=1)
    return torch.softmax(scores * inv_temperature, dim=-1)


def walk_slot_by_slot(q: torch.Tensor, draw: Draw) -> torch.Tensor:
    """Candidate indices [R, S] of a walk whose draws are made in slot order (`draw(k, q_k)`, e.g. from a
    generator): q_k is the row of slot k's distributions (`slot_distributions`) of the candidate drawn before."""
    rows = torch.arange(q.shape[0], device=q.device)
    picks = [draw(0, q[:, 0, 0].contiguous())]
    for k in range(1, q.shape[1]):
        picks.append(draw(k, q[rows, k, picks[-1]]))
    return torch.stack(picks, dim=1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: `DFlashDraftModel` with `BlockConv` around each sublayer and a `CandidateSelector`."""

    config_class = DFlash2Config
    _no_split_modules = ["DFlash2DecoderLayer"]
    layer_cls = DFlash2DecoderLayer

    def add_variant_modules(self, config: DFlash2Config) -> None:
        self.candidate_selector = (
            CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k)
            if config.selector_rank else None)

    def _init_weights(self, module: nn.Module) -> None:
        """The base init, then the identity convolution and the selector's own (a module's children are
        initialised before it, so a conv's kernel projection ends at zero)."""
        if isinstance(module, BlockConv):
            module.reset_identity()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(getattr(self.config, "initializer_range", 0.02))
        else:
            super()._init_weights(module)

    @property
    def has_selector(self) -> bool:
        return self.candidate_selector is not None

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """softcap(output_multiplier * logits), in fp32 when either is set (applied by `slot_logits` only)."""
        c = self.config
        if c.output_multiplier == 1.0 and c.final_logit_softcapping == 0:
            return logits
        return unary_logits(c, logits)

    def propose_block(self, hidden: torch.Tensor, unary: torch.Tensor, anchors: torch.Tensor,
                      inv_temperature: Optional[torch.Tensor | float] = None, draw: Optional[Draw] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The selector's walk over drafted slots (`selector_walk`): hidden [R, S, H] and the unary logits [R, S, V]
        of slots 1..S as `slot_logits` formed them (transformed already: not again here), anchors [R] the token
        before them. Every decoder proposes through here."""
        return selector_walk(self.candidate_selector, hidden, unary, anchors, inv_temperature, draw)

    def layer_args(self, q_len: int, block_size: Optional[int]) -> tuple:
        """The blocks' length for the convolutions: `block_size`, else the trained block size when the queries are
        several whole blocks, else one block of all queries (a decoder's single, maybe shorter, block)."""
        block = int(block_size or (self.config.block_size if q_len % self.config.block_size == 0 else q_len))
        if q_len % block:
            raise ValueError(f"{q_len} block tokens are not whole blocks of {block}")
        return (block,)


__all__ = [
    "BlockConv", "CandidateSelector", "block_convolve", "DFLASH2_DEFAULTS", "DFlash2Config", "DFlash2DecoderLayer",
    "DFlash2DraftModel", "check_dflash2_fields", "check_dflash2_sizes", "compose_maps", "selector_walk",
    "slot_distributions", "unary_logits", "walk_slot_by_slot",
]
