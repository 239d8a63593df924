"""Any checkpoint resumes under another layout (4): LoRA runs under DDP and ZeRO-3 as sources.

A LoRA run's checkpoint holds the adapters (on every linear layer of the tiny Llama) and their
Adam state only. One straight 2-rank LoRA run under DDP saves a checkpoint every step; its
step-2 checkpoint feeds the tree below, the resumed ZeRO-3 run trains one step and stops with a
checkpoint for its own targets (tests/layout_matrix_runs.py: how the runs are shared and what
each edge checks; an export merges the adapters into the base). The pairs proven, every source
under three other layouts, one on another rank count:

- LoRA DDP (2) → ZeRO-3, FSDP2 full on 1 rank, ZeRO-2
- LoRA ZeRO-3 → DDP on 1 rank, FSDP2 full, ZeRO-1
"""

from __future__ import annotations

import pytest

from tests.layout_matrix_runs import Tree, check_edge, matrix_edges, run_matrix

pytestmark = pytest.mark.multiprocess

TREES = (
    Tree(
        "ddp",
        {
            "ddp": ("zero3", "fsdp-1", "zero2"),
            "zero3": ("ddp-1", "fsdp", "zero1"),
        },
        lora=True,
    ),
)
EDGES = matrix_edges(TREES)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_matrix(tmp_path_factory.mktemp("matrix"), TREES, "layout matrix (LoRA)")


@pytest.mark.parametrize("edge", EDGES, ids=[edge.name for edge in EDGES])
def test_a_lora_checkpoint_resumes_under_another_layout_with_the_straight_runs_numbers(
    matrix, edge
):
    check_edge(matrix, edge)
