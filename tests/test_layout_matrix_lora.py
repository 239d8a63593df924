"""Any checkpoint resumes under another layout (4): LoRA runs under DDP and ZeRO-3 as sources.

A LoRA run's checkpoint holds the adapters (on every linear layer of the tiny Llama) and their
Adam state only. One straight 2-rank LoRA run under DDP saves a checkpoint every step; its
step-2 checkpoint feeds the tree below, the resumed ZeRO-3 run trains one step and stops with a
checkpoint for its own targets (tests/layout_matrix_runs.py: how the runs are shared and what
each edge checks; an export merges the adapters into the base). The pairs proven, every source
under three other layouts, one on another rank count:

- LoRA DDP (2) → ZeRO-3, FSDP2 full on 1 rank, ZeRO-2
- LoRA ZeRO-3 → DDP on 1 rank, FSDP2 full, ZeRO-1

The adapters are DoRA with rsLoRA's scaling (model.lora.use_dora, use_rslora): a magnitude per
output feature trains beside lora_A and lora_B, which every engine saves, converts and exports;
the exported PEFT folder loads with PeftModel.from_pretrained as the merged model. (Plain LoRA
on each layout: tests/test_lora.py.)
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
        lora_keys=(("use_dora", True), ("use_rslora", True)),
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


def test_a_dora_adapter_loads_with_peft_on_its_base_as_the_merged_model(matrix):
    import json

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # ZeRO-3 (from DDP's checkpoint) → ZeRO-1 to the end: its export
    (edge,) = [e for plan, e in matrix.edges.items() if plan.name == "lora-zero3-to-zero1"]
    assert edge.error is None, edge.error
    adapter = edge.run_dir / "adapter"
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["use_dora"] and settings["use_rslora"], settings
    assert any(
        "lora_magnitude_vector" in key
        for key in load_file(str(adapter / "adapter_model.safetensors"))
    )
    base = AutoModelForCausalLM.from_pretrained(settings["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(edge.run_dir / "model")).eval()
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (adapted(ids).logits - merged(ids).logits).abs().max()
    assert gap < 1e-4, float(gap)
