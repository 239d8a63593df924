"""Any checkpoint resumes under another layout (2): DeepSpeed ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-2 +
optimizer offload as sources.

One straight 2-rank ZeRO-3 run saves a checkpoint every step; its step-2 checkpoint feeds the
tree below, each resumed source trains one step and stops with a checkpoint for its own targets
(tests/layout_matrix_runs.py: how the runs are shared and what each edge checks). The pairs
proven, every source under three other layouts, one on another rank count:

- ZeRO-3 (2) → ZeRO-2 + offload, FSDP2 full on 1 rank, ZeRO-1
- ZeRO-2 + offload → FSDP2 × TP 2, DDP on 1 rank, ZeRO-2
- ZeRO-1 → AutoTP 2, SP 2, ZeRO-2 + offload on 1 rank
- ZeRO-2 → PP 2, DDP, ZeRO-1 on 1 rank
"""

from __future__ import annotations

import pytest

from tests.layout_matrix_runs import Tree, check_edge, matrix_edges, run_matrix

pytestmark = pytest.mark.multiprocess

TREES = (
    Tree(
        "zero3",
        {
            "zero3": ("zero2-offload", "fsdp-1", "zero1"),
            "zero2-offload": ("fsdp-tp2", "ddp-1", "zero2"),
            "zero1": ("tp2", "sp2", "zero2-offload-1"),
            "zero2": ("pp2", "ddp", "zero1-1"),
        },
    ),
)
EDGES = matrix_edges(TREES)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_matrix(tmp_path_factory.mktemp("matrix"), TREES, "layout matrix (ZeRO)")


@pytest.mark.parametrize("edge", EDGES, ids=[edge.name for edge in EDGES])
def test_a_zero_checkpoint_resumes_under_another_layout_with_the_straight_runs_numbers(
    matrix, edge
):
    check_edge(matrix, edge)
