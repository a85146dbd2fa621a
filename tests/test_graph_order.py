"""The one ranked topological order (fusegraph/graph/order.py) every layer that orders a
graph's pieces uses: edges respected, ties by rank then vertex, a cycle leaves it short."""

from __future__ import annotations

from fusegraph.graph.order import ranked_order


def test_edges_first_then_rank_then_vertex() -> None:
    #   0 -> 2, 1 -> 2, 3 free; rank puts 3 first, 1 before 0
    succ = [[2], [2], [], []]
    assert ranked_order(succ, [5, 1, 0, -1]) == [3, 1, 0, 2]
    assert ranked_order(succ, [0, 0, 0, 0]) == [0, 1, 2, 3]  # equal ranks: vertex number


def test_repeated_edges_count_once_and_a_cycle_is_short() -> None:
    assert ranked_order([[1, 1], []], [0, 0]) == [0, 1]
    assert len(ranked_order([[1], [0], []], [0, 0, 0])) == 1  # only the free vertex
