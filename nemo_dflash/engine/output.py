"""What a one-prompt decoder returns, and the small output helpers both decode modes share.

`spec_decode` (eager) and `batched_static` (graphs) both build a `GenerationOutput`; keeping it here
lets `spec_decode` import `batched_static` without `batched_static` importing it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch

TokenIds = Union[Sequence[int], torch.Tensor]


# What a decoding call generates when its caller names no limit (every decoder of this package).
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class GenerationOutput:
    """One prompt's generation and what it cost.

    `acceptance_lengths[i]` is the number of tokens step i produced (accepted draft tokens + the
    target's bonus token) before truncation at a stop token / the token limit; the prefill's
    first token is not a step. Times exclude the prefill.
    """

    output_ids: list[int]
    num_target_forwards: int
    acceptance_lengths: list[int] = field(default_factory=list)
    decode_time_s: float = 0.0
    prefill_time_s: float = 0.0
    stopped: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens produced after the prefill (the prefill yields the first one)."""
        return max(len(self.output_ids) - 1, 0)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def time_per_output_token(self) -> float:
        return self.decode_time_s / self.num_decode_tokens if self.num_decode_tokens else 0.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def truncate(tokens: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) or at `room` tokens; say whether a stop was hit."""
    tokens = tokens[:room]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens, False


def stop_set(stop_token_ids: Optional[Iterable[int]]) -> set[int]:
    if stop_token_ids is None:
        return set()
    if isinstance(stop_token_ids, int):
        return {int(stop_token_ids)}
    return {int(t) for t in stop_token_ids}
