"""Any checkpoint resumes under another layout (3): FSDP2, HSDP and FSDP2 × TP 2 as sources.

One straight 2-rank FSDP2 run saves a checkpoint every step; its step-2 checkpoint feeds the
tree below, each resumed source trains one step and stops with a checkpoint for its own targets
(tests/layout_matrix_runs.py: how the runs are shared and what each edge checks). HSDP runs on
2 loopback "nodes" of 2 ranks (shard inside a node, replicate across). The pairs proven, every
source under three other layouts, one on another rank count:

- FSDP2 full (2) → HSDP (4), ZeRO-2, SP 2
- HSDP (4) → FSDP2 × TP 2, ZeRO-3, DDP on 1 rank
- FSDP2 × TP 2 → AutoTP 2, FSDP2 full on 1 rank, PP 2

LoRA runs as sources: tests/test_layout_matrix_lora.py.
"""

from __future__ import annotations

import pytest

from tests.layout_matrix_runs import Tree, check_edge, matrix_edges, run_matrix

pytestmark = pytest.mark.multiprocess

TREES = (
    Tree(
        "fsdp",
        {
            "fsdp": ("hsdp", "zero2", "sp2"),
            "hsdp": ("fsdp-tp2", "zero3", "ddp-1"),
            "fsdp-tp2": ("tp2", "fsdp-1", "pp2"),
        },
    ),
)
EDGES = matrix_edges(TREES)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_matrix(tmp_path_factory.mktemp("matrix"), TREES, "layout matrix (FSDP)")


@pytest.mark.parametrize("edge", EDGES, ids=[edge.name for edge in EDGES])
def test_an_fsdp_checkpoint_resumes_under_another_layout_with_the_straight_runs_numbers(
    matrix, edge
):
    check_edge(matrix, edge)
