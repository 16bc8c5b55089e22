"""Token sampling of the decoding engine (`engine`: regeneration and evaluation) and the one-prompt decoders.

Bottom layer: imports torch only, so every decoder takes its noise and acceptance rule from one place.

- Keyed sampling: every uniform is a pure hash of (seed, key, position, token id), so a sampled token
  does not depend on batch composition or launch order, and a sampling step is one CUDA graph.
- `select_tokens` / `verify_block`: the one-prompt decoder's token choice (generator-driven) and the
  speculative acceptance rule (accept slot k with probability min(1, p/q), else sample the residual).
- `SamplingParams`: temperature, top-p, top-k and how the draft proposes, the one value every decoder takes
  (a command, a recipe or a benchmark turns its bare temperature into one once: `as_sampling`). With top-p /
  top-k both the target's and the draft's distributions are filtered and renormalised before the accept test,
  so the output follows the target's filtered distribution exactly.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Union

import torch

from nemo_dflash.engine.acceptance import greedy_accepted, sampled_accepted

DRAFT_PROPOSALS = ("sample", "greedy")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: T = 0 is greedy; T > 0 samples softmax(logits / T) within top-k, then top-p.

    ``draft`` is how the draft proposes at T > 0: "sample" draws each block slot from its own filtered
    distribution q; "greedy" proposes its argmax and verifies it as a one-hot q (accept with probability
    p(x), else draw from p without x). Both leave the output distribution the target's: the accept rule
    is exact for any proposal distribution.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    draft: str = "sample"

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, self.draft)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def plain(self) -> bool:
        """A temperature alone (no filter, the draft samples): what result files record as a bare number."""
        return not self.filtered and self.draft == "sample"

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits / T with the tokens outside top-k, then top-p, at -inf."""
        return filter_scores(logits.float() / self.temperature, self.top_p, self.top_k)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered, renormalised distribution [..., V] (T > 0)."""
        return torch.softmax(self.scores(logits), dim=-1)

    @property
    def key(self) -> str:
        """A short stable key: "0", "1" (a plain temperature, as journals always wrote it), "0.2,p0.9", "1,greedy"."""
        if self.greedy:
            return "0"
        parts = [f"{self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"p{self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"k{self.top_k}")
        if self.draft != "sample":
            parts.append(self.draft)
        return ",".join(parts)

    @property
    def label(self) -> str:
        """For reports: "T=0", "T=0.2, top-p 0.9", "T=1, draft greedy"."""
        if self.greedy:
            return "T=0"
        out = f"T={self.temperature:g}"
        if self.top_p < 1.0:
            out += f", top-p {self.top_p:g}"
        if self.top_k > 0:
            out += f", top-k {self.top_k}"
        if self.draft != "sample":
            out += f", draft {self.draft}"
        return out

    def __format__(self, spec: str) -> str:
        """``f"{s:g}"`` is `key`, as ``f"{t:g}"`` of a bare temperature: reports and journals key either alike."""
        return self.key

    def hf_generate_kwargs(self) -> dict:
        """`model.generate`'s sampling arguments for this setting, given whole (top-k off unless set) so that a
        checkpoint's generation_config does not reshape the distribution."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def record(self) -> dict:
        """For JSON files: the temperature, and the filters and draft proposals where they are not the defaults."""
        out: dict = {"temperature": self.temperature}
        if self.top_p < 1.0:
            out["top_p"] = self.top_p
        if self.top_k > 0:
            out["top_k"] = self.top_k
        if self.draft != "sample":
            out["draft"] = self.draft
        return out

    @classmethod
    def from_key(cls, key: str) -> "SamplingParams":
        """The inverse of `key`; a bare number is a temperature."""
        head, *rest = [x.strip() for x in str(key).split(",") if x.strip()] or ["0"]
        kw: dict = {"temperature": float(head)}
        for part in rest:
            if part.startswith("p"):
                kw["top_p"] = float(part[1:])
            elif part.startswith("k"):
                kw["top_k"] = int(part[1:])
            else:
                kw["draft"] = part
        return cls(**kw)


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0, draft: str = "sample", *,
                   names: tuple[str, str, str] = ("temperature", "top-p", "top-k")) -> None:
    """One-line errors for settings a user can give (temperature, top-p, top-k, draft proposals), each naming the
    setting as the user gave it (`names`: e.g. the flags). NaN and infinity are refused: NaN passes every
    comparison, and an infinite temperature samples uniformly random tokens."""
    t_name, p_name, k_name = names
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{t_name} must be a finite number >= 0 (got {temperature!r}); use 0 for greedy decoding")
    if not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"{p_name} must be in (0, 1] (got {top_p!r}); use 1 for no nucleus cut")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{k_name} must be an integer >= 0 (got {top_k!r}); use 0 for no top-k cut")
    if draft not in DRAFT_PROPOSALS:
        raise ValueError(f"draft proposals {draft!r}: give one of {', '.join(DRAFT_PROPOSALS)}")


GREEDY = SamplingParams()  # T=0: the argmax


def as_sampling(x: Union[float, int, SamplingParams]) -> SamplingParams:
    """A `SamplingParams` from itself or a bare temperature: for the boundaries (a command's flag, a recipe key, a
    benchmark's argument), so that every decoder below takes one type."""
    return x if isinstance(x, SamplingParams) else SamplingParams(temperature=float(x))


@torch.compiler.disable
def eager_cumsum(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x.cumsum(-1, dtype=dtype)``, always run eagerly, also inside a compiled sampling step (a graph break).
    Inductor's split scan (long rows, few of them) failed to generate code for the T=1 verify step at 244 x
    49,152 on an H200 (torch 2.11), which then ran unfused; eager cumsum also sums in the unfused order, so
    fused and unfused draws stay the same tokens."""
    return x.cumsum(dim=-1, dtype=dtype)


def topk_ids(logits: torch.Tensor, k: int, block: int = 256) -> torch.Tensor:
    """The ids [N, k] of each row's k largest logits [N, V], through blocks of `block` columns: the k blocks with
    the largest maxima hold every one of the row's k largest values (a value among the top k lies in a block whose
    maximum is at least it, and at most k blocks reach the k-th value), so one reduction over the vocabulary and a
    top-k over k * block gathered values give the same set as ``logits.topk(k)`` (ties may be broken otherwise),
    without the multi-pass selection over every column of every row. The order is by value, largest first."""
    n, v = logits.shape
    while block > 1 and v % block:
        block //= 2
    blocks = v // block
    if block == 1 or blocks <= k:
        return logits.topk(k, dim=-1).indices
    tiles = logits.view(n, blocks, block)
    top_blocks = tiles.amax(dim=-1).topk(k, dim=-1).indices  # [N, k]
    values = tiles.gather(1, top_blocks.unsqueeze(-1).expand(n, k, block)).view(n, k * block)
    best = values.topk(k, dim=-1).indices  # [N, k] into the gathered values
    return top_blocks.gather(1, best // block) * block + best % block


def filter_scores(scores: torch.Tensor, top_p: Union[float, torch.Tensor] = 1.0,
                  top_k: Union[int, torch.Tensor] = 0, k_cap: int = 0) -> torch.Tensor:
    """``scores`` with the tokens outside the top-k, then outside the nucleus of top-p of what remains
    (renormalised), set to -inf: the order vLLM and HF apply them in. The nucleus keeps token i when the
    tokens more probable than i hold less than top-p (the most probable token always stays).

    ``top_p`` / ``top_k`` may be 0-d tensors (a captured graph reads them from buffers); top_k 0 is off.
    Without a top-k (a python 0) the nucleus is `nucleus_keep`'s: a vocabulary's rows are not sorted (a sort of
    151k scores a row was most of a sampled step), and ties at the boundary keep the first in token order. With a
    top-k, ties at the top-k boundary keep the first in sort order;
    ``k_cap`` > 0 promises top_k in [1, k_cap] (a step captured for one setting): only the k_cap largest scores
    are ranked then, with the same result. A python top_k > 0 is its own cap; a tensor top_k without a cap
    ranks the whole vocabulary (a sort: the engine's steps pass k_cap, or a python 0).
    """
    if not isinstance(top_p, torch.Tensor) and not isinstance(top_k, torch.Tensor) and top_p >= 1.0 and top_k <= 0:
        return scores
    if not isinstance(top_k, torch.Tensor) and top_k <= 0:
        return scores.masked_fill(~nucleus_keep(scores, top_p), float("-inf"))
    cap = top_k if not isinstance(top_k, torch.Tensor) else k_cap
    if 0 < cap < scores.shape[-1]:
        flat = scores.reshape(-1, scores.shape[-1])
        order = topk_ids(flat, cap).view(*scores.shape[:-1], cap)  # largest first
        sorted_scores = scores.gather(-1, order)
    else:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_scores.shape[-1], device=scores.device)
    k = top_k if isinstance(top_k, torch.Tensor) else torch.tensor(top_k, device=scores.device)
    drop_sorted = (k > 0) & (rank >= k)
    sorted_scores = sorted_scores.masked_fill(drop_sorted, float("-inf"))
    probs = sorted_scores.softmax(dim=-1)
    before = eager_cumsum(probs) - probs  # mass of the tokens ranked above each one
    drop_sorted = drop_sorted | (before >= top_p)  # the first token always stays (before == 0)
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, order, ~drop_sorted)
    return scores.masked_fill(~keep, float("-inf"))


_ONE_BITS = 0x3F800000  # the int32 bit pattern of 1.0f: no probability lies above it
_FIXED = 2.0**61  # the nucleus' masses in int64 units of 2^-61: a row's total (<= ~1) stays far below 2^63
SORT_BELOW = 16384  # rows shorter than this find their nucleus through a sort: cheaper there than 31 passes


def nucleus_keep(scores: torch.Tensor, top_p: Union[float, torch.Tensor]) -> torch.Tensor:
    """The top-p nucleus of softmax(scores) [..., V] as a mask: what a stable sort (ties in token-id order) and an
    exact cumulative sum keep, {i : mass ranked above i < top_p}. Rows of a vocabulary (V >= `SORT_BELOW`) are not
    sorted: the mass above a threshold falls as it rises, and the int32 bit patterns of non-negative floats are
    ordered as the floats, so the boundary probability theta is found exactly by bisection on those patterns, 31
    steps (the patterns of [0, 1] span 2^30), each a masked sum over the row; every token above theta stays, and
    of the tokens equal to theta the first ones in token order while the mass before each is below top_p (a
    count, then one integer scan over the row). Fixed shapes, no host sync, no branch on values: a captured,
    compiled step runs it. Shorter rows take the stable sort itself.

    The masses are sums of int64 fixed-point probabilities (floor(p * 2^61)): integer sums do not depend on
    their order, so a compiled step and an eager one (or either path) keep the same set for the same
    probabilities, and each row's set is a function of that row alone. Ties at the boundary are broken by token
    id, not all kept: keeping every token tied with the boundary made the set's size jump when a one-ulp change
    of the scores (a row batched with other rows) made or broke a tie there. Tokens at -inf stay out while the
    mass allows (a top_p of 1 keeps every token)."""
    return nucleus_of_probs(scores.float().softmax(dim=-1), top_p)


def nucleus_of_probs(probs: torch.Tensor, top_p: Union[float, torch.Tensor]) -> torch.Tensor:
    """`nucleus_keep` of the probabilities [..., V] themselves (non-negative, summing to ~1)."""
    if isinstance(top_p, torch.Tensor):  # a buffer: compared as its float32 value, in fixed point, on the device
        want, everything = (top_p.float() * _FIXED).to(torch.int64), top_p >= 1.0
    else:  # rounded to float32 as a buffer would hold it, so that a python top_p keeps the same set
        want, everything = int(struct.unpack("f", struct.pack("f", top_p))[0] * _FIXED), top_p >= 1.0
    fixed = (probs * _FIXED).to(torch.int64)
    by = _nucleus_by_sort if probs.shape[-1] < SORT_BELOW else _nucleus_by_bisection
    return by(probs, fixed, want) | everything


def _nucleus_by_bisection(probs: torch.Tensor, fixed: torch.Tensor, want: Union[int, torch.Tensor]) -> torch.Tensor:
    lo = torch.full(probs.shape[:-1], -1, dtype=torch.int32, device=probs.device)  # mass above lo >= top_p
    hi = torch.full_like(lo, _ONE_BITS)  # mass above hi (none) < top_p
    mass_hi = torch.zeros(probs.shape[:-1], dtype=torch.int64, device=probs.device)  # the mass above hi
    for _ in range(31):
        mid = (lo + hi) >> 1  # floor: once hi == lo + 1 it stays there
        # p > float(mid) is bits(p) > mid for mid >= 0; mid -1 is a NaN (nothing above): hi becomes -1, all kept
        above = torch.where(probs > mid.view(torch.float32).unsqueeze(-1), fixed, 0).sum(dim=-1)
        inside = above < want
        hi = torch.where(inside, mid, hi)
        lo = torch.where(inside, lo, mid)
        mass_hi = torch.where(inside, above, mass_hi)
    # theta: the boundary probability (mass above it < top_p <= mass at or above it); of its ties, the first
    # `take` in token order: the r-th (from 0) has mass_hi + r * theta before it, kept while below top_p
    theta = hi.clamp(min=0).view(torch.float32).unsqueeze(-1)
    tied = probs == theta
    theta_fixed = (theta * _FIXED).to(torch.int64)
    room = (want - mass_hi).unsqueeze(-1)  # >= 1 wherever theta_fixed > 0
    take = torch.where(theta_fixed > 0, (room - 1) // theta_fixed.clamp(min=1) + 1, probs.shape[-1])
    last = nth_true_index(tied.view(-1, probs.shape[-1]), take.view(-1, 1)).view(take.shape)
    return (probs > theta) | (tied & (torch.arange(probs.shape[-1], device=probs.device) <= last))


def nth_true_index(mask: torch.Tensor, n: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The index [N, 1] of each row's n-th True (n [N, 1], from 1) in ``mask`` [N, V]; V when the row holds fewer.
    Through blocks of `block` columns: a count per block, running sums over the block counts, then over the one
    block that holds the n-th. The running sums are products with a lower-triangular matrix of ones, not scans: a
    scan is an eager kernel inside the compiled step (`eager_cumsum`), and the graph break it made there left the
    bisection's 31 sums unfused from the softmax (the sampled plain step 1.5x slower on an H200). The products are
    exact: their inputs are counts of at most `block` (exact in TF32 too) summed in float32, below 2^24."""
    rows, v = mask.shape
    while block > 1 and v % block:
        block //= 2
    if block < 16 or v // block > 4096:  # a vocabulary of few divisors: one scan over the row
        upto_col = eager_cumsum(mask, dtype=torch.int32)
        return torch.where((upto_col >= n).any(dim=-1, keepdim=True), (upto_col < n).sum(dim=-1, keepdim=True), v)
    tiles = mask.view(rows, v // block, block).float()
    upto = _running_sum(tiles.sum(dim=-1))  # [N, blocks]: Trues in the blocks up to each one
    at = (upto < n).sum(dim=-1, keepdim=True)  # the block of the n-th True (`blocks`: none)
    found = at < upto.shape[-1]
    at = at.clamp(max=upto.shape[-1] - 1)
    before = torch.where(at > 0, upto.gather(-1, (at - 1).clamp(min=0)), 0)  # Trues in the blocks before it
    inside = _running_sum(tiles.gather(1, at.unsqueeze(-1).expand(rows, 1, block)).squeeze(1))  # [N, block]
    col = (inside < n - before).sum(dim=-1, keepdim=True)
    return torch.where(found, at * block + col, v)


def _running_sum(x: torch.Tensor) -> torch.Tensor:
    """Running sums [N, C] of the small non-negative integer counts x [N, C] (float), as int64, by a product: in
    float32 whatever autocast is on (a bf16 product rounds sums above 256; the trainer's held-out metrics run under
    bf16 autocast)."""
    c = x.shape[-1]
    ones = torch.ones(c, c, device=x.device).tril().T  # [i, j] = 1 where i <= j
    with torch.autocast(x.device.type, enabled=False):
        return (x.float() @ ones).round().to(torch.int64)


def _nucleus_by_sort(probs: torch.Tensor, fixed: torch.Tensor, want: Union[int, torch.Tensor]) -> torch.Tensor:
    """The same set through a stable sort (ties in token order) and the exact prefix sums of the masses."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    sorted_fixed = fixed.gather(-1, order)
    before = eager_cumsum(sorted_fixed) - sorted_fixed  # mass ranked above, exact in integers
    return torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter(-1, order, before < want)


_MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- keyed sampling


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values (a cheap, well-mixed hash)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def keyed_uniform(seed: int, keys: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, token): a pure function of (seed, key, position, token id).

    ``token_ids`` is [N, K] (the candidates of each row) or ``arange(V)`` (the whole vocabulary, every row).
    """
    row = _fmix32((keys.to(torch.int64) * 0x9E3779B1 + seed) & _MASK32)
    row = _fmix32((row ^ (positions.to(torch.int64) * 0x85EBCA77)) & _MASK32)
    cols = _vocab_cols(token_ids.shape[0], token_ids.device) if token_ids.dim() == 1 else _col_hash(token_ids)
    h = _fmix32((row[:, None] + (cols if cols.dim() == 2 else cols[None, :])) & _MASK32)
    return ((h.to(torch.float64) + 0.5) / 2.0**32).to(torch.float32)


def _col_hash(token_ids: torch.Tensor) -> torch.Tensor:
    return token_ids.to(torch.int64) * 0xC2B2AE3D


_VOCAB_COLS: dict[tuple[int, str], torch.Tensor] = {}


@torch.compiler.disable
def _vocab_cols(n: int, device: torch.device) -> torch.Tensor:
    """The column hashes of token ids 0..n-1, computed once, eagerly. Inside a compiled step, inductor fuses
    ``arange(n) * 0xC2B2AE3D`` into int32 index arithmetic and Triton refuses the constant (out of int32 range):
    the T=1, top-p 1 decode step failed to compile. Read from memory instead, the same values."""
    key = (n, str(device))
    cols = _VOCAB_COLS.get(key)
    if cols is None:
        cols = _VOCAB_COLS[key] = _col_hash(torch.arange(n, device=device))
    return cols


@torch.compiler.disable
def keyed_draw(seed: int, keys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [N, V] (non-negative, any scale: a distribution, or a residual not yet
    normalised), drawn with one keyed uniform per row (a pure function of seed, key and position) through the
    row's cumulative sum. Gumbel-max over ``keyed_uniform`` needs V hashes a row; this needs one, and a scan.

    Eager inside the compiled sampling steps, scan included (a graph break there, as at `eager_cumsum`): compiled,
    what followed its scan was a frame of its own, recompiled for every row count and grad mode until dynamo's
    limit (8) on a GPU's T=1 run. Under CUDA graphs its few small kernels cost no launches."""
    return inverse_cdf(weights, keyed_uniform(seed, keys, positions, torch.zeros_like(keys).view(-1, 1)).squeeze(-1))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The keyed draws' rule: the first index [...] at which a row of ``weights`` [..., V] (non-negative, any scale)
    has its cumulative sum reach ``u`` [...] (uniforms in (0, 1)) times the row's total; the last index at most."""
    cdf = weights.float().cumsum(dim=-1)
    return torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[..., -1:]).squeeze(-1).clamp(max=weights.shape[-1] - 1)


class SlotUniforms:
    """A walk's draws (`dflash2.selector_walk`'s ``draw(k, q)``) by `inverse_cdf`, with the uniform of every slot
    fixed before the walk: ``uniforms`` [R, S]. The keyed engine's are (`keyed_slot_draws`): a slot's uniform hashes
    the row's key and the slot's position, whatever was drawn before it, so a walk that sees them may draw each
    slot given every candidate before it at once instead of slot by slot; the same tokens either way."""

    def __init__(self, uniforms: torch.Tensor) -> None:
        self.uniforms = uniforms

    def __call__(self, k: int, q: torch.Tensor) -> torch.Tensor:
        return inverse_cdf(q, self.uniforms[:, k])


def keyed_slot_draws(seed: int, keys: torch.Tensor, first_pos: torch.Tensor, slots: int) -> SlotUniforms:
    """The draws of block slots 1..`slots` of each row (its block at `first_pos` [R]), keyed as `keyed_draw` keys
    them: slot k's uniform is the one ``keyed_draw(seed, keys, first_pos + 1 + k, q)`` picks with; all in one hash."""
    pos = (first_pos.view(-1, 1) + 1 + torch.arange(slots, device=first_pos.device)).reshape(-1)
    flat = keys.view(-1, 1).expand(-1, slots).reshape(-1)
    return SlotUniforms(keyed_uniform(seed, flat, pos, torch.zeros_like(flat).view(-1, 1)).view(-1, slots))


# Noise streams of the keyed speculative step (`keyed_proposals`, `keyed_verify`).
DRAFT_STREAM, ACCEPT_STREAM, NEXT_STREAM = 0x5D, 0xACC, 0x4E7


def keyed_proposals(q: torch.Tensor, keys: torch.Tensor, first_pos: torch.Tensor) -> torch.Tensor:
    """The draft's proposals [R, K] for block slots 1..K of R rows: one keyed draw from each slot's q [R, K, V].
    Row r's block starts at position first_pos[r]; slot k's noise is keyed by (keys[r], first_pos[r] + k)."""
    R, K, V = q.shape
    slots = first_pos.view(-1, 1) + 1 + torch.arange(K, device=q.device)
    flat_keys = keys.view(-1, 1).expand(R, K).reshape(-1)
    return keyed_draw(DRAFT_STREAM, flat_keys, slots.reshape(-1), q.reshape(R * K, V)).view(R, K)


def keyed_verify(p: torch.Tensor, q: torch.Tensor, proposals: torch.Tensor, keys: torch.Tensor,
                 first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for R rows on the device, keyed: (accepted [R], tokens [R, K + 1]) where
    tokens[r, :n] are row r's kept proposals and tokens[r, n] its next token.

    p [R, K + 1, V]: the target's distributions (row k judges slot k + 1; row K gives the bonus); q [R, K, V]:
    what the proposals [R, K] were drawn from. Slot k is kept with probability min(1, p/q) (its uniform keyed
    by the row's key, position and token); the next token is drawn from the first rejected slot's residual
    norm(max(p - q, 0)), or from p's last row when every slot was kept. Only that row is formed.
    """
    R, K1, V = p.shape
    K = K1 - 1
    slots = first_pos.view(-1, 1) + 1 + torch.arange(K1, device=p.device)  # [R, K + 1]: position of each slot
    if K:
        p_tok = p[:, :-1].gather(-1, proposals.unsqueeze(-1)).squeeze(-1)
        q_tok = q.gather(-1, proposals.unsqueeze(-1)).squeeze(-1)
        u = keyed_uniform(ACCEPT_STREAM, keys.view(-1, 1).expand(R, K).reshape(-1), slots[:, :-1].reshape(-1),
                          proposals.reshape(-1, 1)).view(R, K)
        n_acc = sampled_accepted(u, q_tok, p_tok)
    else:
        n_acc = torch.zeros(R, dtype=torch.long, device=p.device)
    p_row = p.gather(1, n_acc.view(R, 1, 1).expand(R, 1, V)).squeeze(1)  # [R, V]
    dist = p_row
    if K:
        q_row = q.gather(1, n_acc.clamp(max=K - 1).view(R, 1, 1).expand(R, 1, V)).squeeze(1)
        resid = (p_row - q_row).clamp(min=0)
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p_row)  # keyed_draw normalises
        dist = torch.where((n_acc == K).view(R, 1), p_row, resid)
    nxt = keyed_draw(NEXT_STREAM, keys, slots.gather(1, n_acc.view(R, 1)).squeeze(1), dist).view(R, 1)
    return n_acc, torch.cat([proposals, nxt], 1).scatter(1, n_acc.view(R, 1), nxt)


def _scaled(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
            filtered: bool, k_cap: int = 0) -> torch.Tensor:
    """logits / T, filtered when `filtered`. A step made without a cap (k_cap 0) has no top-k (the runners are made
    per top-k, `SampledStepState.configure`): its filter is the sort-free nucleus alone."""
    scores = logits.float() * inv_temp
    return filter_scores(scores, top_p, top_k if k_cap else 0, k_cap) if filtered else scores


# The sampled steps of the fixed-shape decoders, each a pure function of tensors (T, top-p and top-k read from
# buffers, `filtered` a constant of the step), so that one `torch.compile` makes each a few fused kernels: the
# softmaxes over the vocabulary, the keyed hashes and the draws' scans are otherwise ~40 small kernels a step.


def sampled_next_tokens(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                        keys: torch.Tensor, positions: torch.Tensor, filtered: bool, k_cap: int = 0) -> torch.Tensor:
    """A plain step's tokens [R] for logits [R, V]: each row's keyed draw for its token at `positions` [R]."""
    return keyed_draw(NEXT_STREAM, keys, positions,
                      torch.softmax(_scaled(logits, inv_temp, top_p, top_k, filtered, k_cap), dim=-1))


def sampled_proposals(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                      keys: torch.Tensor, first_pos: torch.Tensor, filtered: bool, k_cap: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, K, V], proposals [R, K]) from the draft's logits [R, K, V]: `keyed_proposals` of the filtered
    softmax at T."""
    q = torch.softmax(_scaled(logits, inv_temp, top_p, top_k, filtered, k_cap), dim=-1)
    return q, keyed_proposals(q, keys, first_pos)


def sampled_verify(logits: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                   q: torch.Tensor, proposals: torch.Tensor, keys: torch.Tensor, first_pos: torch.Tensor,
                   filtered: bool, k_cap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`keyed_verify` of the target's logits [R, K + 1, V] (the filtered softmax at T) against the proposals
    drawn from q."""
    p = torch.softmax(_scaled(logits, inv_temp, top_p, top_k, filtered, k_cap), dim=-1)  # row k judges slot k + 1
    return keyed_verify(p, q, proposals, keys, first_pos)


# ----------------------------------------------------------------------------- generator-driven sampling


def sample_from(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def select_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """[N, V] logits -> (tokens [N], the filtered probs [N, V] or None at T=0): the target's own choice."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    probs = sampling.probs(logits)
    return sample_from(probs, generator), probs


def propose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The draft's proposals for [N, V] logits: (tokens [N], q [N, V] or None at T=0).

    q is what the accept test divides by: the filtered distribution the tokens were drawn from, or,
    with ``draft="greedy"``, the one-hot of the argmax proposed.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    if sampling.draft == "greedy":
        tokens = logits.argmax(dim=-1)
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return tokens, q.scatter_(-1, tokens.unsqueeze(-1), 1.0)
    return select_tokens(logits, sampling, generator)


def verify_block(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingParams = GREEDY,
    draft_probs: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[int, int]:
    """Decide how much of a drafted block to keep: returns (num_accepted, next_token).

    draft_tokens: [K] proposals for block slots 1..K; target_logits: [K + 1, V], row k being
    the target's prediction after slot k (row k judges draft_tokens[k]; row K gives the bonus).
    T = 0: accept the longest prefix where draft == target argmax; the next token is the
    target's argmax after it. T > 0: accept slot k with probability min(1, p/q); on the first
    rejection sample from norm(max(p - q, 0)); if all pass, sample the bonus from p. With top-p /
    top-k, p is the target's filtered distribution and q the draft's (`propose_tokens`).
    """
    k_len = draft_tokens.shape[0]
    if sampling.greedy:
        target_tokens = target_logits.argmax(dim=-1)
        n_acc = int(greedy_accepted(draft_tokens, target_tokens)) if k_len else 0
        return n_acc, int(target_tokens[n_acc])
    if draft_probs is None and k_len:
        raise ValueError("Speculative sampling (temperature > 0) needs the draft's probabilities")
    p = sampling.probs(target_logits)  # [K + 1, V]
    if k_len:
        idx = draft_tokens.unsqueeze(-1)
        p_tok = p[:-1].gather(-1, idx).squeeze(-1)
        q_tok = draft_probs.float().gather(-1, idx).squeeze(-1)  # type: ignore[union-attr]
        u = torch.rand(k_len, device=p.device, generator=generator)
        n_acc = int(sampled_accepted(u, q_tok, p_tok))
    else:
        n_acc = 0
    if n_acc < k_len:
        residual = (p[n_acc] - draft_probs[n_acc].float()).clamp(min=0)  # type: ignore[index]
        total = residual.sum()
        dist = residual / total if total > 0 else p[n_acc]
        return n_acc, int(sample_from(dist, generator))
    return n_acc, int(sample_from(p[k_len], generator))
