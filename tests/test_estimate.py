"""Parameter counts, memory and traffic estimates, and the plan table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dplaunch.errors import UserError
from dplaunch.planning.candidates import (
    candidate_plans,
    format_table,
    recommendation_line,
    to_json_rows,
)
from dplaunch.planning.estimate import (
    GIB,
    activation_bytes_per_layer,
    count_parameters,
    estimate_communication,
    estimate_memory,
    layers_per_stage,
    model_state_bytes,
    stage_shares,
)
from dplaunch.planning.model_facts import ModelFacts

LLAMA_7B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
)
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def facts(**config) -> ModelFacts:
    return ModelFacts.from_config_dict(config)


def real_count(config: dict, task: str = "causal-lm", num_labels: int = 2) -> int:
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    if task == "sequence-classification":
        hf_config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(hf_config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


TINY_CONFIGS = {
    "llama with grouped-query attention": TINY_LLAMA,
    "llama with tied embeddings": {**TINY_LLAMA, "tie_word_embeddings": True},
    "llama with attention and mlp biases": {**TINY_LLAMA, "attention_bias": True, "mlp_bias": True},
    "llama with an explicit head_dim": {**TINY_LLAMA, "head_dim": 24},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2"},
    "qwen3": {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 16},
    "mistral": {**TINY_LLAMA, "model_type": "mistral"},
    "gpt2": dict(model_type="gpt2", vocab_size=101, n_embd=64, n_layer=3, n_head=4, n_positions=48),
    "gpt2 with n_inner": dict(
        model_type="gpt2",
        vocab_size=101,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=48,
        n_inner=80,
    ),
    "gpt2 with only some fields (HF defaults fill the rest)": dict(
        model_type="gpt2", n_embd=32, n_layer=2, n_head=2
    ),
    "bert": dict(
        model_type="bert",
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=48,
    ),
}


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_causal_lm_count_equals_the_real_model(name):
    config = TINY_CONFIGS[name]
    count = count_parameters(facts(**config))
    assert count.exact
    assert count.total == real_count(config)


@pytest.mark.parametrize("name", ["llama with grouped-query attention", "qwen2", "gpt2", "bert"])
def test_sequence_classification_count_equals_the_real_model(name):
    config = TINY_CONFIGS[name]
    count = count_parameters(facts(**config), task="sequence-classification", num_labels=5)
    assert count.total == real_count(config, "sequence-classification", num_labels=5)


def test_llama_7b_has_6_738_415_616_parameters_without_building_it():
    count = count_parameters(facts(**LLAMA_7B))
    assert count.total == 6_738_415_616
    assert count.embedding == 32000 * 4096
    assert count.head == 4096 + 32000 * 4096  # final norm + untied lm_head


def test_tensor_parallel_split_replicates_exactly_the_norms_and_row_biases():
    import torch
    import transformers

    config = {**TINY_LLAMA, "attention_bias": True, "mlp_bias": True}
    count = count_parameters(facts(**config))
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    block = model.model.layers[0]
    replicated = sum(
        p.numel()
        for name, p in block.named_parameters()
        if "norm" in name or name in ("self_attn.o_proj.bias", "mlp.down_proj.bias")
    )
    assert count.per_layer == sum(p.numel() for p in block.parameters())
    assert count.per_layer - count.per_layer_sharded == replicated
    assert isinstance(block.self_attn.q_proj, torch.nn.Linear)


def test_unknown_family_is_an_approximation_and_says_so():
    count = count_parameters(facts(**{**LLAMA_7B, "model_type": "somethingnew"}))
    assert not count.exact
    assert "approximation" in count.note
    assert count.total == pytest.approx(6_738_415_616, rel=0.01)


def test_pipeline_stages_hold_embedding_first_and_head_last():
    count = count_parameters(facts(**LLAMA_7B))
    assert layers_per_stage(32, 4) == [8, 8, 8, 8]
    assert layers_per_stage(10, 4) == [3, 3, 2, 2]
    shares = stage_shares(count, pp=4)
    assert sum(s.params for s in shares) == count.total
    assert shares[0].params == count.embedding + 8 * count.per_layer
    assert shares[-1].params == count.head + 8 * count.per_layer


def test_tied_embeddings_are_copied_to_the_last_pipeline_stage():
    count = count_parameters(facts(**TINY_CONFIGS["gpt2"]))
    shares = stage_shares(count, pp=3)
    assert sum(s.params for s in shares) == count.total + count.tied_params


# -- model states: ZeRO paper, Ψ params, Nd = dp, K = 12 ---------------------------------------


@pytest.mark.parametrize(
    "stage, expected_bytes_per_param",
    [
        (0, 2 + 2 + 12),
        (1, 2 + 2 + 12 / 8),
        (2, 2 + (2 + 12) / 8),
        (3, (2 + 2 + 12) / 8),
    ],
)
def test_model_states_follow_the_zero_paper(stage, expected_bytes_per_param):
    psi = 1_000_000
    weights, grads, optimizer, cpu = model_state_bytes(
        psi, dp=8, zero_stage=stage, mixed_precision="bf16"
    )
    assert weights + grads + optimizer == pytest.approx(expected_bytes_per_param * psi)
    assert cpu == 0


def test_fp32_uses_4_4_8_bytes_per_parameter():
    assert sum(model_state_bytes(10, dp=1, zero_stage=0, mixed_precision="no")) == 160


def test_offload_moves_optimizer_then_weights_to_the_cpu():
    psi = 1_000_000
    w, g, o, cpu = model_state_bytes(psi, dp=4, zero_stage=2, offload="optimizer")
    assert (w, g, o, cpu) == (2 * psi, 2 * psi / 4, 0, 12 * psi / 4)
    w, g, o, cpu = model_state_bytes(psi, dp=4, zero_stage=3, offload="all")
    assert (w, g, o, cpu) == (0, 2 * psi / 4, 0, (12 + 2) * psi / 4)


@pytest.mark.parametrize("stage, offload", [(0, "optimizer"), (2, "all"), (1, "disk")])
def test_impossible_offloads_are_user_errors(stage, offload):
    with pytest.raises(UserError, match="parallel.offload"):
        model_state_bytes(1, dp=2, zero_stage=stage, offload=offload)


def test_estimate_memory_for_7b_zero1_on_16_gpus():
    llama = facts(**LLAMA_7B)
    psi = 6_738_415_616
    memory = estimate_memory(
        llama, dp=16, zero_stage=1, mixed_precision="bf16", micro_batch=1, seq_len=2048
    )
    assert memory.model_states_gb == pytest.approx((4 + 12 / 16) * psi / GIB)
    per_layer = 2048 * 1 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    logits = 2048 * 32000 * 4
    assert memory.activations_gb == pytest.approx((32 * per_layer + logits) / GIB)
    assert memory.total_gb == pytest.approx(memory.model_states_gb + memory.activations_gb)


def test_activation_formula_with_tensor_parallel_checkpointing_and_fp32():
    count = count_parameters(facts(**LLAMA_7B))
    s, h = 2048, 4096
    assert activation_bytes_per_layer(count, micro_batch=1, seq_len=s) == s * h * 114
    assert activation_bytes_per_layer(count, micro_batch=1, seq_len=s, tp=4) == s * h * (
        10 + 6 + 20
    )
    assert activation_bytes_per_layer(count, micro_batch=2, seq_len=s, mixed_precision="no") == (
        4 * s * h * 114
    )
    plain = estimate_memory(facts(**LLAMA_7B), dp=16, zero_stage=3, seq_len=s)
    checkpointed = estimate_memory(
        facts(**LLAMA_7B), dp=16, zero_stage=3, seq_len=s, activation_checkpointing=True
    )
    expected = 32 * 2 * s * h + s * h * 114 + s * 32000 * 4
    assert checkpointed.activations_gb == pytest.approx(expected / GIB)
    assert checkpointed.activations_gb < plain.activations_gb / 10


def test_first_pipeline_stage_keeps_pp_micro_batches_in_flight():
    llama = facts(**LLAMA_7B)
    one_stage = estimate_memory(llama, dp=1, pp=1)
    four_stages = estimate_memory(llama, dp=1, pp=4)
    # 1F1B: stage 0 holds 4 micro-batches of 8 layers = the activations of 32 layers
    assert four_stages.stage == 0 and four_stages.layers_per_gpu == 8
    assert four_stages.activations_gb == pytest.approx(
        one_stage.activations_gb - 2048 * 32000 * 4 / GIB
    )
    # one micro-batch per step: nothing queues, the last stage (8 layers + logits) is the busiest
    single = estimate_memory(llama, dp=1, pp=4, gradient_accumulation_steps=1)
    assert single.stage == 3
    assert single.activations_gb == pytest.approx(
        one_stage.activations_gb / 4 + 0.75 * 2048 * 32000 * 4 / GIB
    )


def test_communication_per_step():
    llama = facts(**LLAMA_7B)
    psi = 6_738_415_616
    ddp = estimate_communication(llama, dp=16, zero_stage=0)
    assert ddp.network_bytes == pytest.approx(2 * psi * 2 * 15 / 16)
    assert estimate_communication(llama, dp=16, zero_stage=2).network_bytes == ddp.network_bytes
    zero3 = estimate_communication(llama, dp=16, zero_stage=3)
    assert zero3.network_bytes == pytest.approx(1.5 * ddp.network_bytes)
    tp = estimate_communication(llama, dp=1, tp=2, seq_len=2048)
    layer_traffic = 32 * 4 * 2048 * 4096 * 2 * (2 * 1 / 2)
    logits_traffic = 2048 * 32000 * 2 * (2 * 1 / 2)
    assert tp.tensor_parallel_bytes == pytest.approx(layer_traffic + logits_traffic)
    pipe = estimate_communication(llama, dp=1, pp=4, gradient_accumulation_steps=8)
    assert pipe.pipeline_bytes == 2 * 2048 * 4096 * 2 * 8
    assert estimate_communication(llama, dp=1).network_bytes == 0


# -- the plan table -------------------------------------------------------------------------------


def plans_for_7b(gpu_memory_gb: float):
    return candidate_plans(
        facts(**LLAMA_7B),
        gpus=16,
        gpus_per_node=4,
        gpu_memory_gb=gpu_memory_gb,
        micro_batch=1,
        seq_len=2048,
        mixed_precision="bf16",
    )


def only_recommended(cands):
    chosen = [c for c in cands if c.recommended]
    assert len(chosen) == 1
    return chosen[0]


def test_7b_on_16_x_80gb_recommends_zero1_because_ddp_does_not_fit():
    cands = plans_for_7b(80)
    ddp = next(c for c in cands if c.name == "DDP")
    # 16 bytes × 6.74 B params = 100.4 GiB of model states alone
    assert ddp.model_states_gb == pytest.approx(16 * 6_738_415_616 / GIB)
    assert not ddp.fits
    best = only_recommended(cands)
    assert (best.name, best.tp, best.pp, best.dp) == ("ZeRO-1", 1, 1, 16)
    assert best.fits and best.total_gb <= 72
    assert best.comm_gb_per_step == pytest.approx(ddp.comm_gb_per_step)
    assert best.why.startswith("ZeRO-1 fits in 80 GB with 27% headroom")


def test_7b_on_16_x_24gb_recommends_tensor_parallel_4_when_no_data_parallel_plan_fits():
    cands = plans_for_7b(24)
    assert not any(c.fits for c in cands if c.tp == 1 and c.pp == 1)
    best = only_recommended(cands)
    assert best.fits
    assert (best.name, best.tp, best.pp, best.dp) == ("ZeRO-1", 4, 1, 4)
    assert "tp·pp = 4" in best.why


def test_layouts_respect_heads_nodes_and_zero_limits():
    cands = plans_for_7b(80)
    assert {c.tp for c in cands} == {1, 2, 4}  # tp 8 > 4 GPUs per node
    assert all(c.tp * c.pp * c.dp == 16 for c in cands)
    assert all(c.zero_stage <= 1 for c in cands if c.pp > 1)
    assert all(c.zero_stage <= 2 for c in cands if c.tp > 1)
    assert all(c.offload != "all" or c.zero_stage == 3 for c in cands)


def test_gqa_limits_tensor_parallel_to_the_kv_heads():
    cands = candidate_plans(
        facts(**{**LLAMA_7B, "num_key_value_heads": 2}),
        gpus=8,
        gpus_per_node=8,
        gpu_memory_gb=80,
        micro_batch=1,
        seq_len=2048,
        mixed_precision="bf16",
    )
    assert {c.tp for c in cands} == {1, 2}


def test_bert_gets_neither_tensor_nor_pipeline_parallel():
    cands = candidate_plans(
        facts(**TINY_CONFIGS["bert"]),
        gpus=4,
        gpus_per_node=4,
        gpu_memory_gb=16,
        micro_batch=8,
        seq_len=48,
        mixed_precision="no",
        task="sequence-classification",
    )
    assert {(c.tp, c.pp) for c in cands} == {(1, 1)}


def test_a_tiny_model_gets_ddp():
    cands = candidate_plans(
        facts(**TINY_LLAMA),
        gpus=2,
        gpus_per_node=2,
        gpu_memory_gb=16,
        micro_batch=4,
        seq_len=64,
        mixed_precision="no",
    )
    best = only_recommended(cands)
    assert best.name == "DDP"
    assert best.why.startswith("DDP fits in 16 GB with 100% headroom")


def test_when_nothing_fits_nothing_is_recommended_and_the_line_says_what_to_do():
    cands = candidate_plans(
        facts(**LLAMA_7B),
        gpus=2,
        gpus_per_node=2,
        gpu_memory_gb=16,
        micro_batch=8,
        seq_len=4096,
        mixed_precision="bf16",
    )
    assert not any(c.recommended for c in cands)
    line = recommendation_line(cands)
    assert line.startswith("nothing fits: the smallest plan")
    assert "activation checkpointing" in line
    assert line in format_table(cands)


def test_json_rows_and_table():
    cands = plans_for_7b(80)
    rows = to_json_rows(cands)
    assert len(rows) == len(cands)
    for key in ("zero_stage", "offload", "tp", "pp", "dp", "model_states_gb", "activations_gb"):
        assert key in rows[0]
    for key in ("total_gb", "comm_gb_per_step", "fits", "recommended", "why"):
        assert key in rows[0]
    assert sum(row["recommended"] for row in rows) == 1
    table = format_table(cands)
    marked = [line for line in table.splitlines() if line.startswith("* ")]
    assert marked[0].startswith("* ZeRO-1 ") and marked[0].endswith("yes")
    widths = {len(line) for line in table.splitlines()[2 : 2 + len(cands)]}
    assert len(widths) == 1  # fixed width


def test_planning_modules_do_not_import_torch():
    code = (
        "import sys, dplaunch.planning.estimate, dplaunch.planning.candidates;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
