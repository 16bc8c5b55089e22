"""The top-p nucleus without a top-k (`sampling.nucleus_keep`: a bisection on a vocabulary, a stable sort on short
rows) is a function of each row alone: a row keeps the same tokens, and the plain sampled step draws the same token
for it, filtered alone or batched (in any order, any row count, [R, K, V] or [R, V]) with rows of other
distributions. The kept set is checked against two references: a stable sort with a float64 cumulative sum (the
definition: equal), and the sort-based filter the engine ran before (`filter_scores` with a tensor top-k of 0: an
unstable sort and a float32 cumulative sum). Against the latter two differences are allowed (`unexplained`): which
of the tokens tied with the boundary token are kept, and tokens its float32 cumulative sum rounded across top-p."""

from __future__ import annotations

import pytest
import torch

from _spec_fixtures import single_thread  # noqa: F401  (autouse: one thread in this module)
from nemo_dflash.engine import sampling
from nemo_dflash.engine.sampling import SORT_BELOW, filter_scores, nucleus_keep, nucleus_of_probs

TOP_PS = (0.1, 0.5, 0.9, 0.99)


def _tie_row(v: int, g: torch.Generator) -> torch.Tensor:
    """Log-probabilities with a tie at the nucleus boundary: 0.35 on one token, 0.1 on each of four tokens spread
    over the row, the rest (0.25) over the others. At top-p 0.5 the first two of the 0.1s (in token order) stay."""
    p = torch.full((v,), 0.25 / (v - 5))
    ids = torch.randperm(v, generator=g)[:5]
    p[ids[0]] = 0.35
    p[ids[1:]] = 0.1
    return p.log()


def rows_of(v: int) -> torch.Tensor:
    """[8, v] scores of different shapes: peaked, near-flat (a random model's: a dense boundary), ties everywhere
    (rounded), most tokens at -inf, a tie at the boundary, a flat row, one finite token, a near-flat row's twin."""
    g = torch.Generator().manual_seed(v)
    rows = torch.randn(8, v, generator=g)
    rows[0] *= 4
    rows[1] *= 0.05
    rows[2] = (rows[2] * 4).round() / 2
    rows[3, torch.rand(v, generator=g) < 0.6] = float("-inf")
    rows[4] = _tie_row(v, g)
    rows[5] = 0.0
    rows[5, 0] = float("-inf")  # flat over v - 1 tokens: over v, top-p k/v would be exactly a boundary
    rows[6, 1:] = float("-inf")
    rows[7] *= 0.01
    return rows


def stable_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: a stable sort of the float32 softmax (ties in token order), a float64 cumulative sum, each
    token kept while the mass before it is below top-p (as float32, as a buffer holds it)."""
    probs, order = scores.float().softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    probs = probs.double()
    bound = float(torch.tensor(top_p, dtype=torch.float32))
    return torch.zeros(scores.shape, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) - probs < bound)


def unexplained(scores: torch.Tensor, top_p: float, before: torch.Tensor, now: torch.Tensor,
                defined: torch.Tensor) -> torch.Tensor:
    """The tokens the sort-based filter (`before`) and the nucleus (`now`) disagree on that neither documented
    difference explains: (1) ties with the boundary token (the smallest probability `defined` keeps), of
    which a sort keeps any; (2) the sort-based filter's float32 cumulative sum, rounded to the other side of top-p
    than the exact (float64) sum in its own order (flat rows: thousands of equal additions drift by a few tokens)."""
    probs = scores.float().softmax(dim=-1)
    boundary = torch.where(defined, probs, 2.0).amin(dim=-1, keepdim=True)
    sorted_scores, order = scores.sort(dim=-1, descending=True)  # its sort, its softmax, its float32 sum
    sorted_probs = sorted_scores.softmax(dim=-1)
    bound = float(torch.tensor(top_p, dtype=torch.float32))
    rounded = sorted_probs.cumsum(-1) - sorted_probs < bound
    exact = sorted_probs.double().cumsum(-1) - sorted_probs.double() < bound
    rounding = torch.zeros_like(now).scatter(-1, order, rounded != exact)
    return (before != now) & (probs != boundary) & ~rounding


@pytest.mark.parametrize("v", [300, SORT_BELOW], ids=["sort", "bisection"])
def test_a_row_keeps_the_same_nucleus_alone_or_in_any_batch(v):
    rows = rows_of(v)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    for top_p in TOP_PS:
        given = torch.tensor(top_p)  # as a captured step reads it; a python top-p keeps the same set
        alone = torch.cat([nucleus_keep(rows[i:i + 1], given) for i in range(len(rows))])
        assert torch.equal(nucleus_keep(rows, given), alone) and torch.equal(nucleus_keep(rows, top_p), alone)
        assert torch.equal(nucleus_keep(rows[perm], given), alone[perm]), top_p
        assert torch.equal(nucleus_keep(rows.view(2, 4, v), given), alone.view(2, 4, v)), top_p
        padded = torch.cat([rows, rows[:3] * 3 + 1])  # more rows, of other distributions
        assert torch.equal(nucleus_keep(padded, given)[:8], alone), top_p
        defined = stable_nucleus(rows, top_p)
        assert torch.equal(alone, defined), top_p
        # the sort-based filter it replaced: a token kept by one only is tied with the boundary token, or one
        # whose float32 cumulative mass (that filter's) and exact one lie on either side of top-p
        before = ~torch.isinf(filter_scores(rows, torch.tensor(top_p), torch.tensor(0)))
        assert torch.equal(unexplained(rows, top_p, before, alone, defined), torch.zeros_like(alone)), top_p
    # the tie row at top-p 0.5: the 0.35 and the first two of its four 0.1s (in token order)
    kept = nucleus_keep(rows[4:5], 0.5)[0]
    tied = (rows[4] == torch.tensor(0.1).log()).nonzero().flatten()
    assert len(tied) == 4 and kept.sum() == 3 and kept[tied[:2]].all() and not kept[tied[2:]].any()


@pytest.mark.parametrize("v", [300, SORT_BELOW], ids=["sort", "bisection"])
def test_the_plain_step_draws_a_row_alone_as_in_a_batch(v):
    """`sampled_next_tokens` (the engine's plain step, top-p from a buffer, no top-k): row i's keyed draws are the
    same tokens whether the step holds row i alone or all rows, for several positions."""
    rows = rows_of(v)
    keys = torch.arange(8) * 7919 + 11
    one, top_p, no_k = torch.tensor(1.0), torch.tensor(0.9), torch.tensor(0)
    for pos in (3, 17, 400):
        positions = torch.full((8,), pos)
        batch = sampling.sampled_next_tokens(rows, one, top_p, no_k, keys, positions, True)
        alone = torch.cat([sampling.sampled_next_tokens(rows[i:i + 1], one, top_p, no_k, keys[i:i + 1],
                                                         positions[i:i + 1], True) for i in range(8)])
        assert torch.equal(batch, alone), pos
        assert nucleus_keep(rows, top_p)[torch.arange(8), batch].all()  # every draw inside its nucleus


@pytest.mark.parametrize("v", [300, SORT_BELOW], ids=["sort", "bisection"])
def test_a_one_ulp_tie_at_the_boundary_keeps_as_many_tokens(v):
    """The regression: the boundary token 1 ulp above the next (token 1 kept, token 2 out at top-p 0.6), then
    equal to it, as a row's scores differ in their last bits batched with other rows. Keeping every token tied
    with the boundary kept token 2 too, one token more, which moved every later token's place in the
    cumulative sum a draw reads; broken by token id, the same tokens stay."""
    a = torch.tensor(0.3, dtype=torch.float32)
    b = torch.nextafter(a, torch.tensor(0.0))
    rest = (1 - 0.35 - 0.6) / (v - 3)
    probs = torch.full((2, v), rest)
    probs[:, 0] = 0.35
    probs[0, 1], probs[0, 2] = a, b  # 0.35 + 0.3 >= 0.6: token 2 out
    probs[1, 1], probs[1, 2] = b, b  # tied: the first in token order stays, the second is out as before
    kept = nucleus_of_probs(probs, torch.tensor(0.6))
    assert kept[:, :3].tolist() == [[True, True, False], [True, True, False]]
    assert torch.equal(kept[0], kept[1]) and not kept[:, 3:].any()


@pytest.mark.parametrize("v", [512, 1536, 997], ids=["two-blocks", "six-blocks", "one-scan"])
def test_nth_true_index_equals_a_loop_over_the_row(v):
    """`nth_true_index` (block counts and triangular products; a vocabulary without a block size, one scan) gives
    the index of each row's n-th True, counted by a python loop; the row's length when it holds fewer."""
    g = torch.Generator().manual_seed(v)
    mask = torch.rand(12, v, generator=g) < torch.linspace(0.0, 0.05, 12).view(-1, 1)
    mask[3] = True  # every column
    n = torch.randint(1, 12, (12, 1), generator=g)
    n[5] = v + 1  # more than any row holds
    want = []
    for row, k in zip(mask.tolist(), n.view(-1).tolist()):
        seen, at = 0, v
        for i, x in enumerate(row):
            seen += x
            if seen == k:
                at = i
                break
        want.append([at])
    assert torch.equal(sampling.nth_true_index(mask, n), torch.tensor(want))


def test_nth_true_index_is_exact_under_bf16_autocast():
    """The block sums are products; under bf16 autocast (the trainer's held-out metrics) a bf16 product would round
    running sums above 256. Dense rows, counts in the hundreds: the same indices as a count by cumsum."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(12, 1536, generator=g) < torch.linspace(0.3, 0.9, 12).view(-1, 1)
    n = torch.randint(200, 1200, (12, 1), generator=g)
    upto = mask.long().cumsum(dim=-1)
    want = torch.where((upto >= n).any(dim=-1, keepdim=True), (upto < n).sum(dim=-1, keepdim=True), 1536)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(sampling.nth_true_index(mask, n), want)


def test_the_bisection_nucleus_compiles_to_one_graph(monkeypatch):
    """The bisection's tie break ranks the boundary's ties without a scan over the row: the nucleus is one graph
    under dynamo. A scan there (an eager kernel, a graph break) left the 31 sums unfused from the softmax, and the
    sampled plain step of SmolLM2's shape took 1.5x as long on an H200. The compiled mask is the eager one, ties
    at the boundary included."""
    import torch._dynamo

    monkeypatch.setattr(sampling, "SORT_BELOW", 0)
    g = torch.Generator().manual_seed(1)
    scores = torch.stack([_tie_row(512, g) for _ in range(3)] + [torch.randn(512, generator=g) * 4])
    top_p = torch.tensor(0.5)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(nucleus_keep)(scores, top_p)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    keep = torch.compile(nucleus_keep, dynamic=False)(scores, top_p)
    assert torch.equal(keep, nucleus_keep(scores, top_p)) and keep[:3].sum(dim=-1).tolist() == [3, 3, 3]
    torch._dynamo.reset()
