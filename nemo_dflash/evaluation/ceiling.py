"""Acceptance ceilings and the decoder's accept test, measured: what limits acceptance at T > 0 for a target.

- `anchor_figures`: at one anchor of a sequence, the expected block length of three ideal drafts (the target's
  own greedy continuation; the marginals of the target's sampled continuations, sampled or proposed by argmax)
  and, given the real draft's block there (`draft_block_logits`, one forward as training and replay run it), the
  draft's own figures. `benchmarks/drafter.py ceiling` averages them over answers.
- `decoder_acceptance`: over every step of the eager reference decoder, the tokens each step kept against what
  its accept test expected given the drafts (`recorded_verify`): a decoder that accepts more or less than
  min(1, p/q) shows as a gap. `benchmarks/drafter.py accept` reports it.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import torch

from nemo_dflash.engine.acceptance import expected_block_length
from nemo_dflash.engine.sampling import GREEDY, SamplingParams
from nemo_dflash.evaluation.replay import DRAFT_ATTENTION
from nemo_dflash.objective.trainer_module import draft_block_hidden
from nemo_dflash.target import HFDFlashTargetModel

CEILINGS = ("greedy", "marginal", "marginal_argmax")  # JSON keys ceiling_<name>
DRAFT_FIGURES = ("draft_sampled", "draft_argmax", "slot1_overlap")
PER_SLOT = ("marginal_slot_accept", "draft_slot_accept", "draft_argmax_slot_accept", "marginal_overlap")


def repeated(cache: Any, n: int) -> Any:
    """A copy of a KV cache with each row repeated `n` times (rollouts from one context)."""
    c = copy.deepcopy(cache)
    c.batch_repeat_interleave(n)
    return c


def draft_block_logits(target: HFDFlashTargetModel, draft: Any, seq: torch.Tensor, feats: torch.Tensor,
                       anchors: list[int], block: int) -> torch.Tensor:
    """[A, block - 1, V] fp32: the draft's unary logits (`slot_logits`) at slots 1.. of its block at each anchor
    position of `seq` [1, S], from one forward as training and replay run it (`feats` [1, S, n*H]: the target's
    features, seen strictly before each anchor)."""
    end = max(anchors) + 1
    ids, a = seq[:, :end], torch.tensor([anchors], device=seq.device)
    hidden = draft_block_hidden(draft, target.get_input_embeddings(), ids, feats[:, :end], torch.ones_like(ids), a,
                                torch.ones_like(a, dtype=torch.bool), block, int(draft.mask_token_id),
                                backend=DRAFT_ATTENTION.get(seq.device.type, "sdpa"))
    return draft.slot_logits(hidden.view(len(anchors), block, -1)[:, 1:], target.get_output_embeddings()).float()


@torch.inference_mode()
def anchor_figures(model: torch.nn.Module, cache: Any, anchor_tok: int, pos: int, k: int, s: SamplingParams,
                   rollouts: int, sims: int, g: torch.Generator, draft_logits: Optional[torch.Tensor] = None,
                   g_draft: Optional[torch.Generator] = None) -> dict[str, Any]:
    """The three ceilings at one anchor: `cache` holds the context before the anchor token (at `pos`); with
    `draft_logits` [k, V] (the real draft's block there), the draft's figures too. Per-slot figures are lists."""
    dev = next(model.parameters()).device
    anchor = torch.tensor([[anchor_tok]], device=dev)

    def step(c, toks: torch.Tensor, at: int) -> torch.Tensor:  # [N, L] tokens from position `at` -> [N, L, V]
        ids = torch.arange(at, at + toks.shape[1], device=dev).expand(toks.shape[0], -1)
        return model(input_ids=toks, past_key_values=c, use_cache=True, position_ids=ids).logits.float()

    def sampled(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[S, K] accept probs of a draft sampling slot k from q[k] on its own, verified against p along its
        proposals."""
        x = torch.stack([torch.multinomial(q[i], sims, replacement=True, generator=gen) for i in range(k)], 1)
        rows = torch.cat([anchor.expand(sims, 1), x[:, :-1]], 1)
        p = s.probs(step(repeated(cache, sims), rows, pos))  # row k judges slot k + 1
        return (p.gather(-1, x.unsqueeze(-1)).squeeze(-1) / q.gather(-1, x.T).T).clamp(max=1.0)

    def argmax_accept(q: torch.Tensor) -> torch.Tensor:
        """[K] p of each proposal of a draft proposing the argmax of each q[k]."""
        xa = q.argmax(-1).view(1, -1)
        pa = s.probs(step(copy.deepcopy(cache), torch.cat([anchor, xa[:, :-1]], 1), pos))
        return pa.gather(-1, xa.unsqueeze(-1)).squeeze(-1)[0]

    # perfect greedy draft: the target's own greedy continuation, each kept with p of it
    c, tok, acc = copy.deepcopy(cache), anchor, []
    for i in range(k):
        logits = step(c, tok, pos + i)[:, -1]
        probs = s.probs(logits)
        if i == 0:
            p1 = probs[0]  # the target's next-token distribution after the anchor
        tok = logits.argmax(-1, keepdim=True)
        acc.append(probs.gather(-1, tok))
    greedy = float(expected_block_length(torch.cat(acc, -1))[0])
    # the marginals q_k: p at slot k averaged over the target's own sampled continuations
    c, tok, q = repeated(cache, rollouts), anchor.expand(rollouts, 1), []
    for i in range(k):
        p = s.probs(step(c, tok, pos + i)[:, -1])
        q.append(p.mean(0))
        tok = torch.multinomial(p, 1, generator=g)
    q = torch.stack(q)  # [K, V]
    ratio = sampled(q, g)
    out: dict[str, Any] = {"greedy": greedy, "marginal": float(expected_block_length(ratio).mean()),
                           "marginal_argmax": float(expected_block_length(argmax_accept(q))),
                           "marginal_slot_accept": ratio.mean(0).tolist()}
    if draft_logits is not None:
        qd = s.probs(draft_logits)
        ratio_d, acc_d = sampled(qd, g_draft if g_draft is not None else g), argmax_accept(qd)
        out.update(draft_sampled=float(expected_block_length(ratio_d).mean()),
                   draft_argmax=float(expected_block_length(acc_d)),
                   slot1_overlap=float(torch.minimum(p1, qd[0]).sum()),
                   draft_slot_accept=ratio_d.mean(0).tolist(), draft_argmax_slot_accept=acc_d.tolist(),
                   marginal_overlap=torch.minimum(q, qd).sum(-1).tolist())
    return out


@contextlib.contextmanager
def recorded_verify(records: list[dict[str, float]]) -> Iterator[list[dict[str, float]]]:
    """Every `verify_block` call of the reference decoder, with the figures of its accept test appended to
    `records` (the decoder's own rule runs: only what it decided is read)."""
    from nemo_dflash.engine import spec_decode

    original = spec_decode.verify_block

    def verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, sampling: SamplingParams = GREEDY,
               draft_probs: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None
               ) -> tuple[int, int]:
        n_acc, nxt = original(draft_tokens, target_logits, sampling, draft_probs, generator)
        s = sampling
        if not s.greedy and draft_tokens.shape[0]:
            p, q = s.probs(target_logits).float(), draft_probs.float()
            idx = draft_tokens.unsqueeze(-1)
            ratio = (p[:-1].gather(-1, idx) / q.gather(-1, idx)).squeeze(-1).clamp(max=1.0)
            records.append({"kept": n_acc + 1, "expected": float(expected_block_length(ratio)),
                            "slot1_accepted": float(n_acc >= 1),
                            "slot1_overlap": float(torch.minimum(p[0], q[0]).sum()),
                            "slot1_entropy": float(-(p[0] * p[0].clamp(min=1e-30).log()).sum())})
        return n_acc, nxt

    spec_decode.verify_block = verify
    try:
        yield records
    finally:
        spec_decode.verify_block = original


def decoder_acceptance(target: torch.nn.Module, draft: Any, prompts: list[list[int]], sampling: SamplingParams,
                       max_new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Means over every step of the reference decoder on `prompts`: kept tokens, their expectation, slot 1's
    figures."""
    from nemo_dflash.engine.spec_decode import speculative_generate

    g = torch.Generator(device=next(target.parameters()).device).manual_seed(seed)
    with recorded_verify([]) as rec:
        for ids in prompts:
            speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, sampling=sampling, generator=g)
    n = len(rec)
    mean = {k: sum(r[k] for r in rec) / n for k in rec[0]} if n else {}
    var = sum((r["kept"] - mean["kept"]) ** 2 for r in rec) / max(n - 1, 1) if n else 0.0
    return {"steps": n, "kept_per_step": mean.get("kept"), "kept_per_step_stderr": (var / n) ** 0.5 if n else None,
            "expected_per_step": mean.get("expected"), "slot1_accept_rate": mean.get("slot1_accepted"),
            "slot1_overlap": mean.get("slot1_overlap"), "slot1_target_entropy": mean.get("slot1_entropy")}


__all__ = [
    "CEILINGS",
    "DRAFT_FIGURES",
    "PER_SLOT",
    "anchor_figures",
    "decoder_acceptance",
    "draft_block_logits",
    "recorded_verify",
    "repeated",
]
