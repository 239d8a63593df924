"""Parameter counts, memory and traffic estimates, and the plan table."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

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
from dplaunch.planning.workload import Workload
from tests.helpers import LLAMA_7B, ranks

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


def test_estimate_memory_for_7b_zero1_on_16_gpus_line_by_line():
    llama = facts(**LLAMA_7B)
    psi = 6_738_415_616
    s, b, h, a, v = 2048, 1, 4096, 32, 32000
    memory = estimate_memory(
        llama,
        ranks(dp=16, zero_stage=1),
        Workload(mixed_precision="bf16", micro_batch=b, seq_len=s, attn_implementation="eager"),
    )
    assert memory.model_states_gb == pytest.approx((4 + 12 / 16) * psi / GIB)
    # a llama layer in 16-bit: 24 + 8·i/h = 45.5 bytes per s·b·h; eager keeps the scores too:
    # fp32 softmax + its bf16 copy, 6 bytes × a·s·s·b
    per_layer = s * b * h * 45.5 + a * s * s * b * 6
    assert memory.activations_gb == pytest.approx(32 * per_layer / GIB)
    # HF's loss: 12 bytes per logit at its peak (not the 4 of one fp32 tensor)
    assert memory.logits_gb == pytest.approx(b * s * v * 12 / GIB)
    # ZeRO-1 on GPUs: two reduce buckets of BUCKET_SIZE (200M) bf16 elements (overlap_comm)
    assert memory.buckets_gb == pytest.approx(2 * 200_000_000 * 2 / GIB)
    # the optimizer step builds the fp32 gradient partition
    assert memory.step_gb == pytest.approx(4 * psi / 16 / GIB)
    assert (memory.nccl_gb, memory.cuda_context_gb, memory.autocast_gb) == (0.5, 1.0, 0.0)
    forward_backward = memory.activations_gb + memory.logits_gb + memory.buckets_gb
    assert memory.forward_backward_gb == pytest.approx(forward_backward)
    assert memory.total_gb == pytest.approx(memory.model_states_gb + 1.5 + forward_backward)
    lines = memory.breakdown()
    assert sum(gib for _, _, gib in lines) - memory.step_gb == pytest.approx(memory.total_gb)
    assert ("activations_gb", "activations (32 layers, eager attention)") in [
        (name, text) for name, text, _ in lines
    ]


def test_ddp_in_bf16_holds_autocast_copies_of_every_matrix():
    psi = 6_738_415_616
    ddp = estimate_memory(
        facts(**LLAMA_7B), ranks(dp=8, zero_stage=0), Workload(mixed_precision="bf16")
    )
    # fp32 master weights stay; autocast caches a bf16 copy of all but the input embedding
    assert ddp.autocast_gb == pytest.approx(2 * (psi - 32000 * 4096) / GIB)
    assert (ddp.buckets_gb, ddp.step_gb) == (0, 0)  # gradient_as_bucket_view; torch's AdamW
    assert (
        estimate_memory(facts(**LLAMA_7B), ranks(dp=8), Workload(mixed_precision="no")).autocast_gb
        == 0
    )
    assert (
        estimate_memory(facts(**LLAMA_7B), ranks(dp=8, zero_stage=2), Workload()).autocast_gb == 0
    )
    tied = count_parameters(facts(**{**LLAMA_7B, "tie_word_embeddings": True}))
    tied_ddp = estimate_memory(
        facts(**{**LLAMA_7B, "tie_word_embeddings": True}), ranks(dp=8), Workload()
    )
    # the tied head's product casts the shared matrix too
    assert tied_ddp.autocast_gb == pytest.approx(2 * tied.total / GIB)


def test_zero3_buckets_nccl_per_axis_and_the_step_peak():
    llama = facts(**LLAMA_7B)
    psi = 6_738_415_616
    zero3 = estimate_memory(llama, ranks(dp=8, zero_stage=3), Workload(micro_batch=4))
    # one reduce bucket + a prefetch bucket of BUCKET_SIZE/4, bf16
    assert zero3.buckets_gb == pytest.approx((200_000_000 + 50_000_000) * 2 / GIB)
    assert zero3.step_gb == pytest.approx(4 * psi / 8 / GIB)
    # one communicator per axis of degree > 1
    assert estimate_memory(llama, ranks(dp=4, tp=2, zero_stage=1), Workload()).nccl_gb == 1.0
    assert estimate_memory(llama, ranks(dp=1), Workload()).nccl_gb == 0
    # offloaded, the fp32 gradient partition lives in host memory with the optimizer states
    offloaded = estimate_memory(llama, ranks(dp=8, zero_stage=2, offload="optimizer"), Workload())
    assert offloaded.step_gb == 0
    assert offloaded.cpu_gb == pytest.approx((12 + 4) * psi / 8 / GIB)
    # a tiny activation load: the step's fp32 partition is the peak, activations are freed by then
    step_bound = estimate_memory(
        llama, ranks(dp=2, zero_stage=1), Workload(seq_len=8, micro_batch=1)
    )
    assert step_bound.step_gb > step_bound.forward_backward_gb
    assert step_bound.total_gb == pytest.approx(
        step_bound.model_states_gb + 1.5 + step_bound.step_gb
    )


def test_activation_formula_with_tensor_parallel_checkpointing_and_fp32():
    count = count_parameters(facts(**LLAMA_7B))
    s, h, a = 2048, 4096, 32
    scores = a * s * s * 6
    width = 11008 / 4096  # 2.6875: the MLP's share is 8 × that per s·b·h
    assert activation_bytes_per_layer(count, micro_batch=1, seq_len=s) == (
        s * h * (24 + 8 * width) + scores
    )
    assert activation_bytes_per_layer(count, micro_batch=1, seq_len=s, tp=4) == (
        s * h * (12 + (12 + 8 * width) / 4) + scores / 4
    )
    # DDP's autocast keeps the fp32 residual stream and norms: 10 more
    assert activation_bytes_per_layer(
        count, micro_batch=1, seq_len=s, attention_scores=False, autocast=True
    ) == s * h * (34 + 8 * width)
    # fp32: one fp32 softmax output (4 bytes) for the scores
    assert activation_bytes_per_layer(count, micro_batch=2, seq_len=s, mixed_precision="no") == (
        2 * s * h * (40 + 16 * width) + 2 * a * s * s * 4
    )
    # a GPT-2 layer: Korthikanti's 34·s·b·h (10 + 24/t), doubled in fp32
    gpt2 = count_parameters(facts(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25))
    s_b_h = 1024 * 1600
    assert activation_bytes_per_layer(
        gpt2, micro_batch=1, seq_len=1024, tp=2, attention_scores=False
    ) == s_b_h * (10 + 12)
    assert (
        activation_bytes_per_layer(
            gpt2, micro_batch=1, seq_len=1024, mixed_precision="no", attention_scores=False
        )
        == s_b_h * 68
    )
    eager = Workload(seq_len=s, attn_implementation="eager")
    plain = estimate_memory(facts(**LLAMA_7B), ranks(dp=16, zero_stage=3), eager)
    checkpointed = estimate_memory(
        facts(**LLAMA_7B),
        ranks(dp=16, zero_stage=3),
        replace(eager, activation_checkpointing=True),
    )
    expected = 32 * 2 * s * h + s * h * (24 + 8 * width) + scores
    assert checkpointed.activations_gb == pytest.approx(expected / GIB)
    assert checkpointed.activations_gb < plain.activations_gb / 10


def test_first_pipeline_stage_keeps_pp_micro_batches_in_flight():
    llama = facts(**LLAMA_7B)
    # the pipeline engine holds 16-bit weights, as DeepSpeed's ZeRO does (DDP: fp32 + autocast)
    one_stage = estimate_memory(llama, ranks(dp=1, pp=1, zero_stage=1), Workload())
    four_stages = estimate_memory(llama, ranks(dp=1, pp=4), Workload())
    # 1F1B: stage 0 holds 4 micro-batches of 8 layers = the activations of 32 layers
    assert four_stages.stage == 0 and four_stages.layers_per_gpu == 8
    assert four_stages.activations_gb == pytest.approx(one_stage.activations_gb)
    assert four_stages.logits_gb == 0  # the head is on the last stage
    # one micro-batch per step: nothing queues, the last stage (8 layers + logits) is the busiest
    single = estimate_memory(llama, ranks(dp=1, pp=4), Workload(global_batch_size=1))
    assert single.stage == 3
    assert single.activations_gb == pytest.approx(one_stage.activations_gb / 4)
    assert single.logits_gb == pytest.approx(one_stage.logits_gb)


def test_communication_per_step():
    llama = facts(**LLAMA_7B)
    psi = 6_738_415_616
    ddp = estimate_communication(llama, ranks(dp=16, zero_stage=0), Workload())
    assert ddp.network_bytes == pytest.approx(2 * psi * 2 * 15 / 16)
    assert (
        estimate_communication(llama, ranks(dp=16, zero_stage=2), Workload()).network_bytes
        == ddp.network_bytes
    )
    zero3 = estimate_communication(llama, ranks(dp=16, zero_stage=3), Workload())
    assert zero3.network_bytes == pytest.approx(1.5 * ddp.network_bytes)
    tp = estimate_communication(llama, ranks(dp=1, tp=2), Workload(seq_len=2048))
    layer_traffic = 32 * 4 * 2048 * 4096 * 2 * (2 * 1 / 2)
    logits_traffic = 2048 * 32000 * 2 * (2 * 1 / 2)
    assert tp.tensor_parallel_bytes == pytest.approx(layer_traffic + logits_traffic)
    pipe = estimate_communication(llama, ranks(dp=1, pp=4), Workload(global_batch_size=8))
    assert pipe.pipeline_bytes == 2 * 2048 * 4096 * 2 * 8
    assert estimate_communication(llama, ranks(dp=1), Workload()).network_bytes == 0


# -- the plan table -------------------------------------------------------------------------------


def plans_for_7b(gpu_memory_gb: float):
    # eager attention: the s×s scores make data parallelism alone too big on 24 GB GPUs
    return candidate_plans(
        facts(**LLAMA_7B),
        Workload(micro_batch=1, seq_len=2048, mixed_precision="bf16", attn_implementation="eager"),
        gpus=16,
        gpus_per_node=4,
        gpu_memory_gb=gpu_memory_gb,
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
    # 27% before llama's measured layer bytes, the CUDA context, NCCL, buckets and the loss's 12
    # bytes per logit were counted
    assert best.why.startswith("ZeRO-1 fits in 80 GB with 15% headroom")


def test_7b_on_16_x_32gb_recommends_tensor_parallel_4_when_no_data_parallel_plan_fits():
    cands = plans_for_7b(32)
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
    # (FSDP offloads parameters too: its rows hold zero_stage 0)
    assert all(c.offload != "all" or c.zero_stage == 3 or c.fsdp for c in cands)


def test_gqa_limits_tensor_parallel_to_the_kv_heads():
    cands = candidate_plans(
        facts(**{**LLAMA_7B, "num_key_value_heads": 2}),
        Workload(micro_batch=1, seq_len=2048, mixed_precision="bf16"),
        gpus=8,
        gpus_per_node=8,
        gpu_memory_gb=80,
    )
    assert {c.tp for c in cands} == {1, 2}


def test_bert_gets_neither_tensor_nor_pipeline_parallel():
    cands = candidate_plans(
        facts(**TINY_CONFIGS["bert"]),
        Workload(micro_batch=8, seq_len=48, mixed_precision="no", task="sequence-classification"),
        gpus=4,
        gpus_per_node=4,
        gpu_memory_gb=16,
    )
    assert {(c.tp, c.pp) for c in cands} == {(1, 1)}


def test_a_tiny_model_gets_ddp():
    cands = candidate_plans(
        facts(**TINY_LLAMA),
        Workload(micro_batch=4, seq_len=64, mixed_precision="no"),
        gpus=2,
        gpus_per_node=2,
        gpu_memory_gb=16,
    )
    best = only_recommended(cands)
    assert best.name == "DDP"
    # a tiny model still pays the CUDA context (1 GiB) and NCCL buffers (0.5 GiB)
    assert best.why.startswith("DDP fits in 16 GB with 91% headroom")


def test_when_nothing_fits_nothing_is_recommended_and_the_line_says_what_to_do():
    cands = candidate_plans(
        facts(**LLAMA_7B),
        Workload(micro_batch=8, seq_len=4096, mixed_precision="bf16"),
        gpus=2,
        gpus_per_node=2,
        gpu_memory_gb=16,
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


# -- the attention kernel the ranks run (model.attn_implementation) -----------------------------


def test_7b_on_8_x_80gb_micro_4_fits_with_sdpa_the_kernel_transformers_picks():
    # Llama-2-7B, bf16, micro batch 4 × 2048: eager's scores made it 115 GiB of activations
    gpus = dict(gpus=8, gpus_per_node=8, gpu_memory_gb=80)
    workload = Workload(micro_batch=4, seq_len=2048, mixed_precision="bf16")
    best = only_recommended(candidate_plans(facts(**LLAMA_7B), workload, **gpus))
    assert (best.tp, best.pp, best.offload) == (1, 1, "none")  # plain data parallelism fits
    assert best.memory.attn_implementation == "sdpa"
    sdpa_layers = 32 * 2048 * 4 * 4096 * 45.5  # llama's 24 + 8·i/h bytes per s·b·h
    assert best.activations_gb == pytest.approx(sdpa_layers / GIB)  # 45.5 GiB
    eager_workload = replace(workload, attn_implementation="eager")
    eager = candidate_plans(facts(**LLAMA_7B), eager_workload, **gpus)
    same = next(c for c in eager if (c.name, c.tp, c.pp) == (best.name, 1, 1))
    scores = 32 * 32 * 2048 * 2048 * 4 * 6
    assert same.activations_gb == pytest.approx((sdpa_layers + scores) / GIB)  # eager: 141.5 GiB
    assert not same.fits
    assert only_recommended(eager).tp * only_recommended(eager).pp > 1


def test_transformers_default_kernel_and_the_families_that_run_sdpa():
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from dplaunch.planning.model_facts import SDPA_FAMILIES, attention_implementation

    for family in SDPA_FAMILIES:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
        assert model_class._supports_sdpa, family
    assert not transformers.BloomForCausalLM._supports_sdpa
    assert attention_implementation("bloom") == "eager"
    assert attention_implementation("somethingnew") == "eager"  # unknown: the memory-heavy case
    assert attention_implementation("llama", "eager") == "eager"
    tiny = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**TINY_LLAMA)
    )
    assert tiny.config._attn_implementation == attention_implementation("llama") == "sdpa"


def saved_for_backward(attn_implementation: str, weights: str, **config) -> int:
    """Bytes a tiny Llama's forward keeps for backward on CPU (distinct storages; the weights
    and their autocast copies left out). ``weights``: "16-bit" (DeepSpeed's bf16 model),
    "autocast" (DDP: fp32 weights, bf16 autocast) or "fp32"."""
    import torch
    import transformers
    from torch.autograd.graph import saved_tensors_hooks

    torch.manual_seed(0)
    config = {**TINY_LLAMA, "num_key_value_heads": 8, **config}
    config["num_key_value_heads"] = config["num_attention_heads"]  # no GQA: k, v as big as q
    config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation
    )
    if weights == "16-bit":
        model = model.to(torch.bfloat16)
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 256))
    storages: dict[int, int] = {}

    def keep(tensor):
        if tuple(tensor.shape) not in weight_shapes:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights == "autocast"):
            model(input_ids=ids, labels=ids)
    return sum(storages.values())


@pytest.mark.parametrize("weights", ["16-bit", "autocast", "fp32"])
def test_a_llama_layer_keeps_the_bytes_the_estimate_counts(weights):
    # Llama-2-7B's MLP width ratio (11008 / 4096), sdpa: everything but the scores
    shape = dict(hidden_size=128, intermediate_size=344, num_attention_heads=4)
    per_layer = saved_for_backward("sdpa", weights, num_hidden_layers=3, **shape) - (
        saved_for_backward("sdpa", weights, num_hidden_layers=2, **shape)
    )
    count = count_parameters(facts(**{**TINY_LLAMA, **shape, "num_key_value_heads": 4}))
    estimated = activation_bytes_per_layer(
        count,
        micro_batch=2,
        seq_len=256,
        mixed_precision="no" if weights == "fp32" else "bf16",
        attention_scores=False,
        autocast=weights == "autocast",
    )
    # 45.5, 55.5 and 83 bytes per s·b·h (Korthikanti's GPT layer: 34 and 68)
    assert per_layer == pytest.approx(estimated, rel=0.02)


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_eager_keeps_the_score_bytes_the_estimate_counts_and_sdpa_none(mixed_precision):
    count = count_parameters(facts(**{**TINY_LLAMA, "num_key_value_heads": 8}))
    shape = dict(micro_batch=2, seq_len=256, mixed_precision=mixed_precision)
    scores = activation_bytes_per_layer(count, **shape) - activation_bytes_per_layer(
        count, attention_scores=False, **shape
    )
    weights = "16-bit" if mixed_precision == "bf16" else "fp32"
    measured = saved_for_backward("eager", weights) - saved_for_backward("sdpa", weights)
    # 8 heads × 256 × 256 × 2 per layer: 6 bytes each in bf16, 4 in fp32
    assert measured == pytest.approx(count.num_layers * scores, rel=0.02)


def peak_bytes_of(step) -> int:
    """Peak bytes of the tensors ``step()`` creates and holds at once (storages, CPU)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key in self.seen or size == 0:
                    continue
                self.seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.free, key, size)
            return out

        def free(self, key: int, size: int) -> None:
            self.seen.discard(key)
            self.live -= size

    with LiveStorages() as mode:
        step()
    return mode.peak


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_hf_loss_peaks_at_the_bytes_per_logit_the_estimate_counts(mixed_precision):
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from dplaunch.planning.estimate import LOSS_BYTES_PER_LOGIT

    batch, seq, hidden, vocab = 2, 128, 8, 4096
    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    states = torch.randn(batch, seq, hidden, requires_grad=True)
    head = torch.randn(vocab, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))

    def loss_and_backward():
        # as the loop does: model(**batch).loss, the output (and its logits) dropped at once
        logits = torch.nn.functional.linear(states.to(dtype), head.to(dtype))
        loss = ForCausalLMLoss(logits, labels, vocab)
        del logits
        loss.backward()

    per_logit = peak_bytes_of(loss_and_backward) / (batch * seq * vocab)
    # the head's copies and gradient add hidden·(2 or 4)/(batch·seq) ≤ 0.13 bytes per logit
    assert per_logit == pytest.approx(LOSS_BYTES_PER_LOGIT, abs=0.2)
    count = count_parameters(facts(**TINY_LLAMA))
    memory = estimate_memory(facts(**TINY_LLAMA), ranks(), Workload(micro_batch=batch, seq_len=seq))
    assert memory.logits_gb * GIB == batch * seq * count.vocab_size * LOSS_BYTES_PER_LOGIT


# -- LoRA / QLoRA: adapters only are trained, the base is held frozen (or quantized) -------------

LORA_CASES = {
    "llama, all-linear": (TINY_LLAMA, "causal-lm", dict(r=4)),
    "llama, q/v and a saved lm_head": (
        TINY_LLAMA,
        "causal-lm",
        dict(r=4, target_modules=("q_proj", "v_proj"), modules_to_save=("lm_head",)),
    ),
    "llama, an adapted embedding": (
        TINY_LLAMA,
        "causal-lm",
        dict(r=4, target_modules=("q_proj", "embed_tokens")),
    ),
    "llama classifier (its head trained in full)": (TINY_LLAMA, "sequence-classification", {}),
    "qwen2": (TINY_CONFIGS["qwen2"], "causal-lm", dict(r=8)),
    "qwen3, saved embeddings": (
        TINY_CONFIGS["qwen3"],
        "causal-lm",
        dict(r=8, modules_to_save=("embed_tokens",)),
    ),
    "gpt2 (Conv1D layers)": (TINY_CONFIGS["gpt2"], "causal-lm", dict(r=4)),
    "gpt2 classifier, c_attn": (
        TINY_CONFIGS["gpt2"],
        "sequence-classification",
        dict(r=4, target_modules=("c_attn",)),
    ),
    "bert classifier (pooler adapted)": (TINY_CONFIGS["bert"], "sequence-classification", {}),
}


def peft_model(config: dict, task: str, spec):
    """The HF model wrapped by peft as the ranks wrap it (train/lora.py's peft config)."""
    import peft
    import transformers

    from dplaunch.config.schema import LoraConfig
    from dplaunch.train.lora import peft_config

    hf_config = transformers.AutoConfig.for_model(**config)
    if task == "sequence-classification":
        hf_config.num_labels = 3
        model = transformers.AutoModelForSequenceClassification.from_config(hf_config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    targets = spec.target_modules
    lora = LoraConfig(
        r=spec.r,
        target_modules=targets if isinstance(targets, str) else list(targets),
        modules_to_save=list(spec.modules_to_save) or None,
    )
    return peft.get_peft_model(model, peft_config(lora, task))


@pytest.mark.parametrize("name", LORA_CASES)
def test_lora_trainable_count_equals_peft(name):
    from dplaunch.planning.lora import LoraSpec, count_lora

    config, task, settings = LORA_CASES[name]
    spec = LoraSpec(**settings)
    model = peft_model(config, task, spec)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    count = count_lora(facts(**config), spec, task, num_labels=3)
    assert count.exact and count.trainable == trainable


def test_lora_adapters_are_r_times_in_plus_out_of_each_linear_but_the_head():
    from dplaunch.planning.lora import LoraSpec, count_lora

    # Llama-2-7B, r 16: q/k/v/o 4096×4096, gate/up/down 4096×11008, 32 layers
    count = count_lora(facts(**LLAMA_7B), LoraSpec(r=16))
    per_layer = 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert count.trainable == count.adapters == 32 * per_layer == 39_976_960
    assert count.trainable_embedding == count.trainable_head == 0


def test_lora_keeps_the_base_frozen_and_zero_partitions_only_the_adapter_states():
    from dplaunch.planning.lora import LoraSpec, count_lora

    llama, psi = facts(**LLAMA_7B), 6_738_415_616
    lora = count_lora(llama, LoraSpec(r=16))
    a = lora.trainable
    ddp = estimate_memory(llama, ranks(dp=8), Workload(), lora=lora)
    # DDP: fp32 base (Accelerate's autocast keeps it), fp32 adapters + gradients + Adam
    assert ddp.weights_gb * GIB == 4 * psi + 4 * a
    assert (ddp.gradients_gb * GIB, ddp.optimizer_gb * GIB) == (4 * a, 8 * a)
    assert ddp.trainable_params == a and ddp.params_per_gpu == psi
    full = estimate_memory(llama, ranks(dp=8), Workload())
    assert ddp.model_states_gb < full.model_states_gb / 3.5  # 16 → 4 bytes per parameter
    zero2 = estimate_memory(llama, ranks(dp=8, zero_stage=2), Workload(), lora=lora)
    assert zero2.weights_gb * GIB == 2 * psi + 2 * a  # DeepSpeed's bf16 base, whole
    assert zero2.gradients_gb * GIB == pytest.approx(2 * a / 8)
    assert zero2.optimizer_gb * GIB == pytest.approx(12 * a / 8)
    assert zero2.step_gb * GIB == pytest.approx(4 * a / 8)  # the fp32 gradient partition
    zero3 = estimate_memory(llama, ranks(dp=8, zero_stage=3), Workload(), lora=lora)
    assert zero3.weights_gb * GIB == pytest.approx((2 * psi + 2 * a) / 8)  # the base too
    qlora = count_lora(llama, LoraSpec(r=16, quantize="4bit"))
    four_bit = estimate_memory(llama, ranks(dp=8), Workload(), lora=qlora)
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    # the linears in nf4 (+ an fp32 absmax per 64), the rest fp32 under DDP (as the ranks hold it)
    assert four_bit.weights_gb * GIB == pytest.approx(
        linears * (0.5 + 4 / 64) + (psi - linears) * 4 + 4 * a
    )
    assert four_bit.weights_gb < 4.6  # a 7B base in 4-bit: 4.4 GiB + adapters
    # autocast copies only what is not quantized: the fp32 lm_head (and the norms, 65 × 4096)
    assert four_bit.autocast_gb * GIB == 2 * (32000 + 65) * 4096


def test_lora_moves_only_adapter_gradients_between_data_parallel_ranks():
    from dplaunch.planning.lora import LoraSpec, count_lora

    llama, psi = facts(**LLAMA_7B), 6_738_415_616
    a = count_lora(llama, LoraSpec(r=16))
    ddp = estimate_communication(llama, ranks(dp=16), Workload(), lora=a)
    assert ddp.network_bytes == pytest.approx(2 * a.trainable * 2 * 15 / 16)
    zero3 = estimate_communication(llama, ranks(dp=16, zero_stage=3), Workload(), lora=a)
    # ZeRO-3 still gathers the frozen base for forward and backward
    assert zero3.network_bytes == pytest.approx((2 * psi + a.trainable) * 2 * 15 / 16)


def held_bytes(model, optimizer) -> dict[str, int]:
    """Storage of the parameters (bitsandbytes' quantization constants included), gradients and
    AdamW states, each storage counted once (tests/memory_probe.py's counter)."""
    from tests.memory_probe import StorageCounter

    counter = StorageCounter()
    for parameter in model.parameters():
        counter.add("parameters", parameter.data)
        counter.add("parameters", getattr(parameter, "SCB", None))  # 8-bit row scales
        quant_state = getattr(parameter, "quant_state", None)  # 4-bit absmax (and its own)
        for state in (quant_state, getattr(quant_state, "state2", None)):
            if state is not None:
                counter.add_all("parameters", list(vars(state).values()))
    for state in optimizer.state.values():
        counter.add_all("optimizer", state)
    for parameter in model.parameters():
        counter.add("gradients", parameter.grad)
    return counter.bytes


# every output width a multiple of 32: bitsandbytes' CPU 4-bit kernel repacks weights in blocks of 32
LORA_PROBE = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "quantize, mixed_precision", [(None, "no"), ("4bit", "bf16"), ("8bit", "bf16")]
)
def test_lora_bytes_held_after_an_adam_step_are_within_10_percent_of_the_estimate(
    tmp_path, quantize, mixed_precision
):
    import torch
    import transformers

    from dplaunch.config.schema import LoraConfig, ModelConfig
    from dplaunch.planning.lora import LoraSpec, count_lora
    from dplaunch.train.modeling import load_model
    from dplaunch.train.tokenizer import byte_level_tokenizer

    # the model as the ranks build it (train/modeling.py): bitsandbytes quantizes a pretrained
    # base as it loads, so the base is a saved folder
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**LORA_PROBE)
    )
    base.save_pretrained(tmp_path)
    lora = LoraConfig(r=8, quantize=quantize)
    settings = ModelConfig(name_or_path=str(tmp_path), tokenizer="byte-level", lora=lora)
    model = load_model(settings, byte_level_tokenizer(), seed=0)
    spec = LoraSpec.from_config(lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, LORA_PROBE["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # Adam's states exist; the next backward's gradients sit beside them
    model(input_ids=ids, labels=ids).loss.backward()
    held = held_bytes(model, optimizer)
    lora = count_lora(facts(**LORA_PROBE), spec)
    estimate = estimate_memory(
        facts(**LORA_PROBE),
        ranks(),
        Workload(mixed_precision=mixed_precision, seq_len=16),
        lora=lora,
    )
    expected = {
        "parameters": estimate.weights_gb * GIB,
        "gradients": estimate.gradients_gb * GIB,
        "optimizer": estimate.optimizer_gb * GIB,
    }
    print(f"LoRA {quantize}: held {held}, estimated {expected}")
    for kind, estimated in expected.items():
        assert held[kind] == pytest.approx(estimated, rel=0.10), kind
    assert held["gradients"] == 4 * lora.trainable  # the frozen base has none
    # the loaded base (the parameters less the fp32 adapters): what a rank holds in host RAM
    # at load, where CPU ranks keep it (QLoRA: quantized, not the fp32 model)
    base = held["parameters"] - held["gradients"]
    assert base == pytest.approx(estimate.host_load_gb * GIB, rel=0.10)
