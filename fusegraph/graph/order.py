"""One topological order with ranked ties, for the layers that order pieces of a graph
(regions, a unit's pieces, partition units): the same input always gives the same order,
and among the pieces ready at once the lowest rank runs first (the graph's own order, so a
plan runs its pieces as the model reads). ``graphlib`` has no tie-breaking rule."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def ranked_order(succ: Sequence[Sequence[int]], rank: Sequence[float]) -> list[int]:
    """Vertices 0..n-1 in an order where every edge v -> w of ``succ`` has v before w, ties
    broken by ``rank`` then vertex number. On a cycle the order is short: the caller
    compares its length with n and says what the cycle means for it."""
    waiting = [0] * len(succ)
    for ws in succ:
        for w in set(ws):
            waiting[w] += 1
    ready = [(rank[v], v) for v in range(len(succ)) if waiting[v] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, v = heapq.heappop(ready)
        order.append(v)
        for w in sorted(set(succ[v])):
            waiting[w] -= 1
            if waiting[w] == 0:
                heapq.heappush(ready, (rank[w], w))
    return order
