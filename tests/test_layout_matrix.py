"""Any checkpoint resumes under another layout (1): DDP, AutoTP 2, PP 2 and SP 2 as sources.

One straight 2-rank DDP run saves a checkpoint every step; its step-2 checkpoint feeds the tree
below, each resumed source trains one step and stops with a checkpoint for its own targets
(tests/layout_matrix_runs.py: how the runs are shared and what each edge checks). The pairs
proven, every source under three other layouts, one on another rank count:

- DDP (2) → AutoTP 2, PP 2, ZeRO-3 on 1 rank
- AutoTP 2 → DDP on 1 rank, SP 2 (Ulysses), FSDP2 × TP 2
- PP 2 → DDP, ZeRO-2 on 1 rank, FSDP2 full
- SP 2 → ZeRO-1 on 1 rank, ZeRO-3, PP 2

The other sources: tests/test_layout_matrix_zero.py (ZeRO-1/2/3, ZeRO-2 + offload),
tests/test_layout_matrix_fsdp.py (FSDP2, HSDP, FSDP × TP) and tests/test_layout_matrix_lora.py
(LoRA under DDP and ZeRO-3).
"""

from __future__ import annotations

import pytest

from tests.layout_matrix_runs import Tree, check_edge, matrix_edges, run_matrix

pytestmark = pytest.mark.multiprocess

TREES = (
    Tree(
        "ddp",
        {
            "ddp": ("tp2", "pp2", "zero3-1"),
            "tp2": ("ddp-1", "sp2", "fsdp-tp2"),
            "pp2": ("ddp", "zero2-1", "fsdp"),
            "sp2": ("zero1-1", "zero3", "pp2"),
        },
    ),
)
EDGES = matrix_edges(TREES)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_matrix(tmp_path_factory.mktemp("matrix"), TREES, "layout matrix (DDP, TP, PP, SP)")


@pytest.mark.parametrize("edge", EDGES, ids=[edge.name for edge in EDGES])
def test_a_checkpoint_resumes_under_another_layout_with_the_straight_runs_numbers(matrix, edge):
    check_edge(matrix, edge)
