"""The acceptance rule of speculative decoding, written once for every decoder and every figure.

A drafted block keeps its longest prefix of accepted slots, then the target's next token. At T=0 a slot is
accepted when it equals the target's argmax after the slots before it; under speculative sampling when
``u * q(x) < p(x)`` (u uniform: kept with probability min(1, p/q), without dividing by a zero q). The engine's rows,
the eager reference decoder, replay, serving parity and the trainer's simulated tau all count with these, so a
change to the rule is one change.
"""

from __future__ import annotations

from typing import Sequence

import torch


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """[..., K] per-slot accept decisions -> [...] the number of leading accepted slots (long)."""
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accepted(proposals: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """T=0: proposals [..., K] against the target's argmax tokens [..., >= K] (token k judges proposal k)."""
    return accepted_prefix(proposals == target_tokens[..., : proposals.shape[-1]])


def sampled_accepted(u: torch.Tensor, q_tok: torch.Tensor, p_tok: torch.Tensor) -> torch.Tensor:
    """Speculative sampling: uniforms u, the draft's q and the target's p of each proposal, [..., K] each."""
    return accepted_prefix(u * q_tok < p_tok)


def greedy_accepted_list(drafted: Sequence[int], truth: Sequence[int]) -> int:
    """`greedy_accepted` of host lists: the longest prefix of `drafted` equal to `truth` (which may be shorter)."""
    n = 0
    while n < len(drafted) and n < len(truth) and drafted[n] == truth[n]:
        n += 1
    return n


def expected_block_length(alpha: torch.Tensor) -> torch.Tensor:
    """[..., K] per-slot accept probabilities (0 past the answer) -> [...] expected tokens a step under the rule:
    1 + sum_k prod_{j<=k} alpha_j (the target's own token, plus each slot kept only if all before it were)."""
    return 1 + alpha.cumprod(dim=-1).sum(dim=-1)


__all__ = ["accepted_prefix", "expected_block_length", "greedy_accepted", "greedy_accepted_list", "sampled_accepted"]
