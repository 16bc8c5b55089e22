"""Prefill planning for the slot engine: how a packed refill's rows are split into attention groups.

Pure functions of the rows' lengths (numpy, no torch): [i, j) bounds over rows sorted ascending,
the split of least cost under the cost model. The engine (``generation.py``) calls them;
``tests/test_generation.py`` checks them against brute force.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def cheapest_split(n: int, group_costs: Callable[[int], np.ndarray]) -> list[tuple[int, int]]:
    """[i, j) bounds splitting rows 0..n-1 into contiguous groups of least total cost; ``group_costs(j)``
    gives the cost of the group [i, j) for every i < j. A dynamic program over the end of the last
    group, O(n^2) in numpy; among equal costs the first minimum, i.e. the largest group."""
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        cost = best[:j] + group_costs(j)
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    bounds, j = [], n
    while j > 0:
        bounds.append((int(cut[j]), j))
        j = int(cut[j])
    return bounds[::-1]


def min_cost_attention_plan(queries: Sequence[int], spans: Sequence[int], group_cost: float,
                            kv_read: float = 0.0) -> list[tuple[int, int]]:
    """[i, j) bounds over rows sorted by ``spans`` (ascending) minimising, over contiguous groups,
    sum(group_cost + rows x longest span x (most queries + kv_read)): a group's attention pads every
    row to its most queries and its longest span."""
    q = np.asarray(queries, dtype=np.float64)
    span = np.asarray(spans, dtype=np.float64)

    def group_costs(j: int) -> np.ndarray:
        most = np.maximum.accumulate(q[:j][::-1])[::-1]  # most queries of the group [i, j), every i < j
        return group_cost + (j - np.arange(j)) * span[j - 1] * (most + kv_read)

    return cheapest_split(len(span), group_costs)
