"""Find where a generated answer degenerates into repetition.

Small targets, greedy or sampled, often fall into a loop: the answer repeats a phrase or a
paragraph until the token cap. Such tails are trivially easy to draft, so they teach a draft an
easy, useless distribution (and inflate acceptance at evaluation). A loop is recognised on
token ids, with no tokenizer:

- token ``i`` is *repeated* when the ``ngram`` ids ending at ``i`` already occurred earlier in
  the answer;
- the answer loops from ``s`` when the suffix from ``s`` is at least ``min_ratio`` repeated
  tokens, is at least ``min_tokens`` long, and holds at least ``min_copies`` copies of its own
  material (suffix length / distinct n-grams in it).

The last condition is what spares legitimate repetition: code quoting an earlier function again,
a list whose items share a prefix, or a closing sentence said twice are repeated once, not many
times, while a loop repeats the same few n-grams over and over. The loop's start is the first
token of the first repeated copy, so cutting there keeps the original once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np


_PACK_BITS = 21  # three token ids of < 2**21 fit in one int64


def _gram_ids(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of ``np.unique(n-grams, axis=0)``, exactly, without its slow row sort.

    The n-gram of each position gets an exact id: three tokens at a time are packed into one
    int64, and the packs are combined left to right as (rank so far) x count + (rank of the
    pack), re-ranked each time so the code stays below count**2. A regeneration checks each live
    answer every 128 tokens (~8 answers a decode step at 1,024 slots); ``unique(axis=0)`` took
    ~0.3 ms an answer, a third of the decode time.
    """
    count = len(ids) - n + 1
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << _PACK_BITS):  # not token ids: the slow exact way
        grams = np.lib.stride_tricks.sliding_window_view(ids, n)
        _, first, inverse = np.unique(grams, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    code = np.zeros(count, dtype=np.int64)
    for lo in range(0, n, 3):
        packed = np.zeros(count, dtype=np.int64)
        for k in range(lo, min(lo + 3, n)):
            packed = (packed << _PACK_BITS) | ids[k : k + count]
        if lo:  # the ranks so far, then this pack's: exact, and below count**2
            _, rank = np.unique(packed, return_inverse=True)
            packed = code * count + rank.reshape(-1)
        _, first, code = np.unique(packed, return_index=True, return_inverse=True)
        code = code.reshape(-1)
    return first, code


@dataclass(frozen=True)
class LoopDetector:
    """Thresholds of :func:`find_loop_start` (the defaults are the recipe's)."""

    ngram: int = 6
    min_ratio: float = 0.8
    min_tokens: int = 48
    min_copies: float = 2.5

    def __post_init__(self) -> None:
        if self.ngram < 1 or self.min_tokens < 1 or not 0 < self.min_ratio <= 1 or self.min_copies < 1:
            raise ValueError(
                f"loop detector needs ngram >= 1, min_tokens >= 1, 0 < min_ratio <= 1 and min_copies >= 1 (got {self})"
            )

    def find(self, token_ids: Sequence[int]) -> Optional[int]:
        """Index of the first token of the loop in ``token_ids``, or None if the answer does not loop."""
        ids = np.asarray(token_ids, dtype=np.int64)
        n, length = self.ngram, len(ids)
        if length < max(self.min_tokens, n + 1):
            return None
        first, inverse = _gram_ids(ids, n)  # gram i covers tokens i .. i + n - 1
        repeated = first[inverse] < np.arange(len(inverse))  # this n-gram occurred earlier
        # The longest suffix that starts on a repeated n-gram and is mostly repeated n-grams.
        suffix = np.cumsum(repeated[::-1])[::-1]
        span_grams = len(inverse) - np.arange(len(inverse))
        ok = repeated & (suffix >= self.min_ratio * span_grams)
        if not ok.any():
            return None
        gram = int(np.argmax(ok))  # the first (smallest) such start
        start = gram  # gram i's first token is token i: the repeated copy begins there
        if length - start < self.min_tokens:
            return None
        distinct = len(np.unique(inverse[gram:]))
        if length - start < self.min_copies * distinct:
            return None
        return start


DEFAULT_LOOP_DETECTOR = LoopDetector()


def find_loop_start(token_ids: Sequence[int], detector: Optional[LoopDetector] = None) -> Optional[int]:
    """Index of the first token of a degenerate repetition in ``token_ids``, or None.

    Everything before the index is kept text, including one copy of the repeated material.
    """
    return (detector or DEFAULT_LOOP_DETECTOR).find(token_ids)
