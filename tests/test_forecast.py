"""The forecast of a step (planning/forecast.py) and the hardware profiles it divides by.

The FLOP count is checked against torch's FlopCounterMode on the run's real model (built as the
ranks build it); the collectives of every layout against a spy on torch.distributed in real
steps: DDP, ZeRO-1/2/3, TP, PP, the 2-D meshes, FSDP2, HSDP and Ulysses are spied in the runs that
check their losses (test_data_parallel, test_hybrid, test_fsdp, test_sequence_parallel); ZeRO-3
with weights large enough to be partitioned here.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from dplaunch.config.schema import ModelConfig
from dplaunch.errors import UserError
from dplaunch.planning.forecast import (
    TERMS,
    TORCH_ADAMW_OVER_CPU_ADAM,
    Collective,
    compare_with_forecast,
    forecast_step,
    host_adamw_s_per_param,
    micro_batch_flops,
    model_weights,
    step_collectives,
    why_faster,
)
from dplaunch.planning.lora import LoraSpec
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.profiles import (
    CALIBRATED,
    DATASHEET,
    OPS,
    DensePoint,
    Link,
    Profile,
    cached_profile,
    choose_profile,
    datasheet_profile,
    gpu_sheet_name,
    profile_dir,
    profile_file_name,
    profile_text,
    read_profile,
)
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Workload
from tests.helpers import (
    LLAMA_7B,
    REPO,
    assert_forecast_collectives,
    read_metrics,
    refusal_line,
    run_cli,
    run_dplaunch,
    spy_environment,
    train,
    write_config,
)

SMALL_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=259,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# GPT-2 without dropout after its MLP (a dropout's mask makes torch recompute the last product)
SMALL_GPT2 = dict(
    model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=259,
    resid_pdrop=0.0,
)  # fmt: skip
SMALL_BERT = dict(
    model_type="bert",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=300,
    max_position_embeddings=128,
)


def counted_flops(config: dict, *, task="causal-lm", lora=None, checkpointing=False) -> int:
    """FlopCounterMode's count of one forward + backward of a micro-batch (2 × 32 tokens) on the
    model the ranks build from this config (dplaunch.train.modeling.load_model), eager attention
    (the counter does not see CPU flash-attention kernels)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dplaunch.train.modeling import load_model
    from dplaunch.train.tokenizer import byte_level_tokenizer

    model_config = ModelConfig(
        config=config,
        tokenizer="byte-level",
        task=task,
        num_labels=2,
        gradient_checkpointing=checkpointing,
        attn_implementation="eager",
        lora=lora,
    )
    model = load_model(model_config, byte_level_tokenizer(), 0)
    model.train()
    ids = torch.randint(0, 250, (2, 32))
    labels = torch.tensor([0, 1]) if task == "sequence-classification" else ids
    options = {"use_cache": False} if task != "sequence-classification" else {}
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=labels, **options).loss.backward()
    return counter.get_total_flops()


ALL_LINEAR = {"r": 8, "target_modules": "all-linear"}


@pytest.mark.parametrize(
    ("config", "task", "lora", "checkpointing"),
    [
        (SMALL_LLAMA, "causal-lm", None, False),
        (SMALL_LLAMA, "causal-lm", None, True),
        (SMALL_LLAMA, "causal-lm", ALL_LINEAR, False),
        (SMALL_LLAMA, "causal-lm", ALL_LINEAR, True),
        (SMALL_LLAMA, "causal-lm", {"r": 4, "target_modules": ["q_proj", "v_proj"]}, False),
        (SMALL_LLAMA, "causal-lm", {"r": 4, "target_modules": ["down_proj"]}, True),
        (SMALL_LLAMA, "sequence-classification", None, False),
        (SMALL_GPT2, "causal-lm", None, True),
        (SMALL_GPT2, "causal-lm", ALL_LINEAR, False),
        (SMALL_BERT, "sequence-classification", None, True),
        (SMALL_BERT, "sequence-classification", ALL_LINEAR, False),
    ],
    ids=[
        "llama-full",
        "llama-checkpointed",
        "llama-lora",
        "llama-lora-checkpointed",
        "llama-lora-q-v",
        "llama-lora-down-checkpointed",
        "llama-classifier",
        "gpt2-checkpointed",
        "gpt2-lora",
        "bert-classifier-checkpointed",
        "bert-classifier-lora",
    ],
)
def test_the_forecast_counts_the_flops_torch_counts_on_the_runs_real_model(
    config, task, lora, checkpointing
):
    options = dict(task=task, lora=lora, checkpointing=checkpointing)
    assert forecast_flops(config, **options) == counted_flops(config, **options)


def forecast_flops(config: dict, *, task: str, lora: dict | None, checkpointing: bool) -> int:
    """micro_batch_flops of the same micro-batch, from the config alone."""
    spec = None
    if lora is not None:
        targets = lora["target_modules"]
        spec = LoraSpec(
            r=lora["r"], target_modules=targets if isinstance(targets, str) else tuple(targets)
        )
    flops = micro_batch_flops(
        ModelFacts.from_config_dict(config),
        micro_batch=2,
        seq_len=32,
        task=task,
        num_labels=2,
        lora=spec,
        activation_checkpointing=checkpointing,
    )
    return int(flops.total)


def test_lora_computes_less_than_full_training_and_checkpointing_more():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    shape = dict(micro_batch=1, seq_len=4096)
    full = micro_batch_flops(facts, **shape)
    lora = micro_batch_flops(facts, lora=LoraSpec(r=16), **shape)
    again = micro_batch_flops(facts, activation_checkpointing=True, **shape)
    params = sum(w.numel for w in model_weights(facts))
    # full training: about 6 · parameters · tokens, plus the attention scores
    assert 6 * params * 4096 < full.model < 7.2 * params * 4096
    # LoRA: no weight gradients of the frozen base, about 2/3 of the work
    assert 0.6 < lora.total / full.total < 0.72
    # checkpointing recomputes the decoder's forward: about 4/3 of the work
    assert 1.25 < again.total / full.total < 1.34 and again.model == full.model


def test_model_weights_are_the_models_parameters_tensor_by_tensor():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**SMALL_LLAMA)
    model = AutoModelForCausalLM.from_config(config)
    real = sorted(p.numel() for p in model.parameters())
    assert sorted(w.numel for w in model_weights(ModelFacts.from_config_dict(SMALL_LLAMA))) == real
    decays = sorted(p.numel() for n, p in model.named_parameters() if p.ndim >= 2)
    facts = ModelFacts.from_config_dict(SMALL_LLAMA)
    assert sorted(w.numel for w in model_weights(facts) if w.decays) == decays


# ---------------------------------------------------------------------------------------------
# profiles


def small_profile(**changes) -> Profile:
    """A profile with round numbers: 1e12 FLOP/s everywhere, links of 10 µs and 10 GB/s."""
    link = Link(10e-6, 10e9)
    profile = Profile(
        device="Test GPU",
        devices_per_node=8,
        nodes=1,
        interconnect="nvlink",
        source=CALIBRATED,
        peak_flops={"bf16": 2e12, "fp32": 1e12},
        dense=(DensePoint("bf16", 1024, 4096, 1e12),),
        attention=(),
        collectives={
            "intra": {
                op: link
                for op in (
                    "all_reduce",
                    "all_gather",
                    "reduce_scatter",
                    "all_to_all",
                    "broadcast",
                    "send",
                )
            },
        },
        overlap=0.0,
        optimizer_s_per_param=1e-11,
        cpu_adam_s_per_param=1e-9,
        host_device_bytes_per_s=20e9,
    )
    return dataclasses.replace(profile, **changes)


def test_known_gpus_get_datasheet_figures_and_say_they_are_not_calibrated():
    h100 = datasheet_profile("NVIDIA H100 80GB HBM3", 8, 2)
    assert h100 is not None and h100.source == DATASHEET == "datasheet, not calibrated"
    assert h100.peak("bf16") == 989e12
    assert (
        h100.link("all_reduce", "intra").bus_bytes_per_s
        > h100.link("all_reduce", "inter").bus_bytes_per_s
    )
    for name in ("H200", "A100-SXM4-80GB", "L40S", "Tesla V100-SXM2-32GB"):
        assert datasheet_profile(name, 8, 1) is not None, name
    assert datasheet_profile("NVIDIA GeForce RTX 4090", 1, 1) is None
    ethernet = datasheet_profile("H100", 8, 2, "ethernet")
    assert (
        ethernet.link("all_gather", "inter").bus_bytes_per_s
        < h100.link("all_gather", "inter").bus_bytes_per_s
    )
    with pytest.raises(UserError, match="--interconnect"):
        datasheet_profile("H100", 8, 2, "carrier-pigeon")


def test_rates_between_measured_shapes_are_interpolated_and_flat_beyond():
    profile = small_profile(
        dense=(
            DensePoint("fp32", 256, 1024, 10e9),
            DensePoint("fp32", 1024, 1024, 30e9),
        )
    )
    assert profile.dense_rate("fp32", 512, 1024) == pytest.approx(20e9)  # halfway in log(h)
    assert profile.dense_rate("fp32", 4096, 1024) == 30e9
    assert profile.dense_rate("fp32", 64, 1024) == 10e9
    # bf16 was not measured: the fp32 rates stand in
    assert profile.dense_rate("bf16", 512, 1024) == pytest.approx(20e9)


def test_a_profile_file_round_trips_and_a_broken_one_is_named(tmp_path):
    profile = small_profile()
    path = tmp_path / "profile.json"
    path.write_text(profile_text(profile))
    assert read_profile(path) == profile
    path.write_text("{}")
    with pytest.raises(UserError, match="--profile: .* is not a dplaunch profile") as empty:
        read_profile(path)
    # said in words, not as Python's "TypeError: Profile.__init__() missing 10 …"
    assert "it lacks device, devices_per_node, nodes" in str(empty.value)
    assert "TypeError" not in str(empty.value) and "__init__" not in str(empty.value)
    with pytest.raises(UserError, match="does not exist"):
        read_profile(tmp_path / "missing.json")
    # an older dplaunch's profile (without the fields that have defaults) and a newer one's (a
    # field this one does not know) both load
    data = profile.to_dict()
    for key in ("intra", "measured_at", "notes"):
        del data[key]
    path.write_text(json.dumps({**data, "engine_overheads": {"zero3": 0.1}}))
    assert read_profile(path) == dataclasses.replace(profile, intra="nvlink", notes=())


def test_the_cache_finds_the_calibrated_profile_of_this_hardware(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cached_profile("Test GPU", 8, 1) is None
    profile_dir().mkdir(parents=True)
    profile = small_profile()
    (profile_dir() / profile_file_name(profile.key)).write_text(profile_text(profile))
    assert cached_profile("Test GPU", 8, 1) == profile
    # another count of the same device: the profile, with a note of where it was measured
    other = cached_profile("Test GPU", 4, 2)
    assert other is not None and "calibrated on 8 device(s) × 1 node(s)" in other.notes[-1]
    # the cache wins over the datasheet; --profile wins over both
    cached = dataclasses.replace(profile, device="H100")
    (profile_dir() / profile_file_name(cached.key)).write_text(profile_text(cached))
    assert choose_profile("H100", 8, 1).source == CALIBRATED
    assert choose_profile("H200", 8, 1).source == DATASHEET
    assert (
        choose_profile("anything", 1, 1, path=profile_dir() / profile_file_name(profile.key))
        == profile
    )
    assert choose_profile(None, 1, 1) is None


def test_a_profile_without_the_links_a_plan_needs_takes_the_datasheets_and_says_so(tmp_path):
    # calibrated on one H100: no collective measured; planned for 2 nodes × 8
    one_gpu = small_profile(device="NVIDIA H100 80GB HBM3", devices_per_node=1, collectives={})
    path = tmp_path / "one-gpu.json"
    path.write_text(profile_text(one_gpu))
    profile = choose_profile("NVIDIA H100 80GB HBM3", 8, 2, path=path)
    sheet = datasheet_profile("H100", 8, 2)
    for scope in ("intra", "inter"):
        assert profile.link("broadcast", scope) == sheet.link("broadcast", scope)
    assert any(
        note.startswith(
            "no collectives measured inside a node (calibrated on 1 device(s) × 1 node(s)): "
            "the H100 datasheet's nvlink figures assumed (10 µs + 360 GB/s)"
        )
        for note in profile.notes
    ), profile.notes
    assert any("no collectives measured across nodes" in note for note in profile.notes)
    forecast_step(ModelFacts.from_config_dict(LLAMA_7B), ParallelDims(16, 8), workload(), profile)

    # CPU ranks have no datasheet: the class figures of gloo between a host's ranks
    cpu = choose_profile(
        "CPU", 2, 1, path=_written(tmp_path, dataclasses.replace(one_gpu, device="CPU Test"))
    )
    assert any("the class figures of shared memory" in note for note in cpu.notes), cpu.notes

    # measured on 1 node × 2, planned for 2 nodes × 4: across nodes is assumed, and no faster
    # than what was measured inside the node
    slow = small_profile(
        devices_per_node=2, collectives={"intra": {op: Link(1e-4, 1e8) for op in OPS}}
    )
    across = choose_profile("Test GPU", 4, 2, path=_written(tmp_path, slow))
    assert across.link("all_reduce", "inter") == Link(1e-4, 1e8)
    assert any(
        "no collectives measured across nodes (calibrated on 2 device(s) × 1 node(s))" in note
        for note in across.notes
    )
    # and the plan says so
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_LLAMA))
    flags = ("--model", model, "--gpus", "8", "--nodes", "2", "--gpu-memory", "80")
    result = run_cli("plan", *flags, "--profile", _written(tmp_path, slow))
    assert result.returncode == 0, result.stderr
    assert "profile note: no collectives measured across nodes" in result.stdout


def _written(folder, profile: Profile):
    path = folder / f"{profile.device}-{profile.devices_per_node}.json"
    path.write_text(profile_text(profile))
    return path


def test_pcie_and_nvl_cards_have_their_own_datasheets():
    # nvidia-smi's names of the cards; before, each matched its SXM board's sheet
    assert gpu_sheet_name("NVIDIA H100 PCIe") == "H100 PCIe"
    assert gpu_sheet_name("NVIDIA H100 NVL") == "H100 NVL"
    assert gpu_sheet_name("NVIDIA A100-PCIE-40GB") == "A100 PCIe"
    assert gpu_sheet_name("NVIDIA A100 80GB PCIe") == "A100 PCIe"
    assert gpu_sheet_name("NVIDIA H100 80GB HBM3") == "H100"
    pcie = datasheet_profile("NVIDIA H100 PCIe", 8, 1)
    sxm = datasheet_profile("NVIDIA H100 80GB HBM3", 8, 1)
    assert pcie.peak("bf16") == 756e12 and sxm.peak("bf16") == 989e12
    # AdamW streams its states at the card's memory bandwidth: 2.0 TB/s, not the SXM's 3.35
    assert pcie.optimizer_s_per_param == pytest.approx(sxm.optimizer_s_per_param * 3.35 / 2.0)
    # no NVLink switch between PCIe cards: PCIe, unless stated, and NVLink bridges join pairs
    assert pcie.intra == "pcie" and pcie.link("all_reduce", "intra").bus_bytes_per_s == 44e9
    assert any("--intra-node nvlink" in note for note in pcie.notes)
    pair = datasheet_profile("H100 PCIe", 2, 1, intra="nvlink")
    assert pair.intra == "nvlink" and pair.link("all_reduce", "intra").bus_bytes_per_s == 240e9
    eight = datasheet_profile("H100 PCIe", 8, 1, intra="nvlink")
    assert eight.intra == "pcie" and any("join 2 GPUs" in note for note in eight.notes)
    with pytest.raises(UserError, match="--intra-node: the L40S has no NVLink"):
        datasheet_profile("L40S", 8, 1, intra="nvlink")


def test_plan_takes_a_known_gpu_types_memory_and_refuses_an_unknown_one(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_LLAMA))
    flags = ("--model", model, "--gpus", "8", "--price-per-gpu-hour", "2.5")
    h100 = run_cli("plan", *flags, "--gpu-type", "H100")
    assert h100.returncode == 0, h100.stderr
    assert "80 GB each (from --gpu-type H100)" in h100.stdout
    assert "40 GB each" in run_cli("plan", *flags, "--gpu-type", "A100 40GB").stdout
    assert "94 GB each" in run_cli("plan", *flags, "--gpu-type", "H100 NVL").stdout
    # an unknown type was ignored (exit 0, no forecast): refused, naming the known ones
    refusal_line(run_cli("plan", *flags, "--gpu-type", "H900"), "--gpu-type: 'H900'", "H100 PCIe")


# ---------------------------------------------------------------------------------------------
# the step


def workload(**changes) -> Workload:
    return dataclasses.replace(
        Workload(micro_batch=1, seq_len=4096, mixed_precision="bf16", global_batch_size=64),
        **changes,
    )


def test_the_pipeline_bubble_is_pp_minus_one_of_m_plus_pp_minus_one_stage_times():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    profile = small_profile()
    for pp, batch in ((2, 8), (4, 8), (4, 32)):
        forecast = forecast_step(
            facts, ParallelDims(pp, 8, pp=pp), workload(global_batch_size=batch), profile
        )
        m = batch  # dp 1, micro 1
        share = forecast.terms["bubble"] / (forecast.terms["bubble"] + forecast.terms["compute"])
        assert share == pytest.approx((pp - 1) / (m + pp - 1))


def test_a_collective_costs_latency_plus_its_bus_bytes_over_the_bus_bandwidth():
    profile = small_profile()
    reduce = Collective("all_reduce", 8e9, 8, "intra", "backward", "x")
    assert reduce.bus_bytes == 8e9 * 2 * 7 / 8
    assert reduce.seconds(profile) == pytest.approx(10e-6 + 8e9 * 2 * 7 / 8 / 10e9)
    gather = Collective("all_gather", 8e9, 8, "intra", "forward", "x")
    assert gather.seconds(profile) == pytest.approx(10e-6 + 7e9 / 10e9)
    send = Collective("send", 1e9, 2, "intra", "forward", "x")
    assert send.seconds(profile) == pytest.approx(10e-6 + 0.1)


def test_overlap_hides_only_what_may_run_beside_the_backward():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    dims = ParallelDims(8, 8)
    hidden = forecast_step(facts, dims, workload(), small_profile(overlap=1.0))
    exposed = forecast_step(facts, dims, workload(), small_profile(overlap=0.0))
    assert hidden.terms["communication"] < exposed.terms["communication"]
    # DDP's last bucket is all-reduced after the backward: never hidden
    last = [c for c in step_collectives(facts, dims, workload()) if c.what == "DDP buckets"][-1]
    assert not last.overlaps and hidden.terms["communication"] >= last.seconds(small_profile())


def test_offload_adds_host_copies_and_cpu_adam_and_drops_the_gpu_optimizer():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    on_gpu = forecast_step(facts, ParallelDims(8, 8, zero_stage=2), workload(), small_profile())
    offloaded = forecast_step(
        facts, ParallelDims(8, 8, zero_stage=2, offload="optimizer"), workload(), small_profile()
    )
    assert on_gpu.terms["offload"] == 0 and on_gpu.terms["optimizer"] > 0
    assert (
        offloaded.terms["optimizer"] == 0 and offloaded.terms["offload"] > on_gpu.terms["optimizer"]
    )


def test_fsdp2s_cpu_offload_steps_torchs_adamw_on_the_host_not_at_the_gpus_fused_rate():
    # 7 B on 8 H100s (datasheet): CPUOffloadPolicy keeps the fp32 shards on the host and steps
    # torch's AdamW there, at the host's rate (≥ 100× the GPU's fused AdamW)
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    h100 = datasheet_profile("H100", 8, 1)
    host = host_adamw_s_per_param(h100)
    assert host == h100.cpu_adam_s_per_param * TORCH_ADAMW_OVER_CPU_ADAM
    assert host >= 100 * h100.optimizer_s_per_param
    on_gpu = forecast_step(facts, ParallelDims(8, 8, fsdp="full"), workload(), h100)
    partition = on_gpu.terms["optimizer"] / h100.optimizer_s_per_param  # the whole model ÷ 8
    offloaded = forecast_step(
        facts, ParallelDims(8, 8, fsdp="full", offload="all"), workload(), h100
    )
    assert offloaded.terms["optimizer"] == 0
    assert offloaded.terms["offload"] >= partition * host
    # every micro-batch copies the fp32 weight shards in twice and the gradient shards out once
    one = forecast_step(
        facts,
        ParallelDims(8, 8, fsdp="full", offload="all"),
        workload(global_batch_size=8),
        h100,
    )
    copies = (8 - 1) * 3 * partition * 4 / h100.host_device_bytes_per_s
    assert offloaded.terms["offload"] - one.terms["offload"] == pytest.approx(copies)
    # ZeRO's offload steps DeepSpeed's CPU Adam on the host too
    for dims in (
        ParallelDims(8, 8, zero_stage=2, offload="optimizer"),
        ParallelDims(8, 8, zero_stage=3, offload="all"),
    ):
        zero = forecast_step(facts, dims, workload(), h100)
        assert zero.terms["optimizer"] == 0
        assert zero.terms["offload"] >= partition * h100.cpu_adam_s_per_param
    # CPU ranks: calibrate measured torch's AdamW on the very cores that step it
    cpu = small_profile(device="cpu", optimizer_s_per_param=3e-9)
    assert host_adamw_s_per_param(cpu) == 3e-9


def test_mfu_is_the_models_flops_over_step_time_ranks_and_peak():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    forecast = forecast_step(facts, ParallelDims(8, 8, zero_stage=3), workload(), small_profile())
    flops = micro_batch_flops(facts, micro_batch=1, seq_len=4096).model * 64
    assert forecast.model_flops_per_step == pytest.approx(flops)
    assert forecast.mfu == pytest.approx(flops / (forecast.step_time_s * 8 * 2e12))
    row = forecast.to_dict(steps=1000, price_per_gpu_hour=2.0)
    assert row["hours"] == pytest.approx(forecast.step_time_s * 1000 / 3600, rel=1e-3)
    assert row["gpu_hours"] == pytest.approx(row["hours"] * 8, rel=1e-3)
    assert row["cost"] == pytest.approx(row["gpu_hours"] * 2.0, rel=1e-2)
    assert {"step_time_s", "tokens_per_s", "mfu", "hours", "gpu_hours", "profile"} <= set(row)


# ---------------------------------------------------------------------------------------------
# a real step


@pytest.mark.multiprocess
def test_a_zero3_run_issues_the_forecast_collectives_and_checks_its_step_time_against_it(
    tmp_path,
):
    # MLP weights of 64 × 2048 (131 k elements) pass ZeRO-3's persistence threshold (100 k) and
    # are partitioned; attention and norms persist whole and are gathered after the step
    config = write_config(
        tmp_path / "wide.yaml",
        model={"config": {**SMALL_LLAMA, "intermediate_size": 2048}},
        train={"max_steps": 3, "global_batch_size": 8, "micro_batch_size": 2},
    )
    # a profile far from this machine (1e12 FLOP/s): the forecast will be far off
    profile = tmp_path / "profile.json"
    profile.write_text(profile_text(small_profile()))
    run = tmp_path / "zero3"
    flags = ("--cpu", "--gpus", "2", "--zero", "3", "--profile", profile)
    result = train(run, *flags, config=config, env=spy_environment(run))
    assert_forecast_collectives(run)
    spied = json.loads((tmp_path / "zero3.collectives" / "rank-0.json").read_text())
    gathers = [c for c in spied["collectives"] if c["op"] == "all_gather"]
    assert gathers[0]["bytes"] == 2 * 3 * 64 * 2048 * 4  # both layers' MLPs, fp32, at once

    # plan.json carries the forecast of its layout; every train line its MFU
    forecast = json.loads((run / "plan.json").read_text())["forecast"]
    assert {"step_time_s", "tokens_per_s", "mfu", "hours", "gpu_hours", "profile"} <= set(forecast)
    assert forecast["profile"] == "Test GPU ×8, nvlink (calibrated)"
    records = read_metrics(run)
    assert all(0 < r["mfu"] for r in records if r["type"] == "train")
    assert " MFU " in result.stdout
    # the end: measured beside forecast, and (more than 25 % off) the most wrong term
    [summary] = [r for r in records if r["type"] == "summary"]
    assert summary["forecast_ratio"] == pytest.approx(
        summary["step_time_s"] / summary["forecast_step_time_s"], rel=1e-3
    )
    assert summary["forecast_most_wrong"] in TERMS
    assert summary["forecast_note"] in result.stdout
    report = run_dplaunch("report", run, "--out", tmp_path / "report")
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert "measured / forecast" in text and summary["forecast_note"] in text
    # forecast.png: phase by phase, DeepSpeed's backward and step as one (the engine times them
    # so), the forecast's terms beside the measured median
    from dplaunch.report import phase_comparison

    assert (tmp_path / "report" / "forecast.png").is_file()
    phases = {p.phase: p for p in phase_comparison(run, summary)}
    assert set(phases) == {"forward", "backward and step"}
    joined = forecast["phases_s"]["backward"]["compute"] + forecast["phases_s"]["step"].get("compute", 0.0)  # fmt: skip
    assert phases["backward and step"].forecast["compute"] == pytest.approx(joined, rel=1e-3)
    assert phases["forward"].measured == pytest.approx(summary["phases_s"]["forward"])


class FakeGpu:
    """A device that runs behind the host: what is queued runs after what was queued before,
    and ``synchronize`` (torch.cuda's, patched) waits for it; ``now`` is the host's clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_until = 0.0
        self.waits = 0

    def perf_counter(self) -> float:
        return self.now

    def queue(self, seconds: float) -> None:
        self.now += 0.001  # the host queues a kernel
        self.busy_until = max(self.busy_until, self.now) + seconds

    def synchronize(self, *args) -> None:
        self.waits += 1
        self.now = max(self.now, self.busy_until)


@pytest.mark.parametrize("on_nonfinite", ["off", "stop"])
def test_the_measured_step_is_the_devices_not_the_time_the_host_took_to_queue_it(
    monkeypatch, on_nonfinite
):
    # a GPU faked with a spy on torch.cuda.synchronize and a clock: every step is 1 s of device
    # work that the host queues in 3 ms. With on_nonfinite: off nothing waits for the device
    # every step: the loop must wait around the steps it times, and only there
    import time
    import types

    import torch

    from dplaunch.train import loop, phase_clock
    from dplaunch.train.nonfinite import NonFiniteGuard
    from dplaunch.train.phase_clock import PhaseClock

    gpu = FakeGpu()
    clock = types.SimpleNamespace(perf_counter=gpu.perf_counter, time=time.time)
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(phase_clock, "time", clock)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    guard = NonFiniteGuard(on_nonfinite, 5, None, "bf16")

    class Engine:
        clock = PhaseClock(cuda)

        def current_lr(self) -> float:
            return 1e-3

        def train_step(self, micro_batches):
            self.clock.start()
            for phase, seconds in (("forward", 0.3), ("backward", 0.6), ("step", 0.1)):
                if phase == "step" and guard.enabled:
                    gpu.synchronize()  # the guard's verdict (.tolist()) before the update
                gpu.queue(seconds)
                self.clock.lap(phase)
            return torch.zeros(())

    run = types.SimpleNamespace(
        engine=Engine(),
        guard=guard,
        batcher=types.SimpleNamespace(micro_batches=lambda step: []),
        place=types.SimpleNamespace(counts_tokens=False),
        accelerator=types.SimpleNamespace(device=cuda),
        rollout=None,  # grpo's sampling: none here
    )
    progress = loop._Progress(torch.zeros(3), 0)
    for step in range(8):
        loop._train_step(run, progress, step)
    waits = gpu.waits
    for step in range(8, 16):
        loop._train_step(run, progress, step)
    assert progress.times.median_step() == pytest.approx(1.0, abs=0.01)
    assert progress.times.median_phases() == pytest.approx(
        {"forward": 0.301, "backward": 0.601, "step": 0.101}, abs=0.002
    )
    if on_nonfinite == "off":  # no per-step sync past the timed steps
        assert gpu.waits == waits


# ---------------------------------------------------------------------------------------------
# where it shows: `dplaunch plan`, parallel: auto


def test_plan_on_a_known_gpu_forecasts_every_row_from_its_datasheet(tmp_path):
    model = tmp_path / "llama-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_7B))
    flags = ("--model", model, "--gpus", "16", "--nodes", "2", "--gpu-memory", "80")
    forecast = ("--gpu-type", "H100", "--max-steps", "1000", "--price-per-gpu-hour", "2.5")
    result = run_dplaunch("plan", *flags, *forecast)
    assert result.returncode == 0, result.stderr
    assert "forecast on H100 ×8, 2 nodes, infiniband (datasheet, not calibrated)" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.strip().startswith("plan"))
    assert header.split()[-6:] == ["s/step", "tokens/s", "MFU", "hours", "GPU-h", "cost"]
    # the fastest plan that fits is recommended, and the line names the runner-up and why
    [line] = [
        line for line in result.stdout.splitlines() if line.startswith("* ") and "fastest" in line
    ]
    assert re.search(r"; the fastest forecast: .+ [\d.]+ s/step beats .+ [\d.]+ s/step: .+", line)

    rows = json.loads(run_dplaunch("plan", *flags, *forecast, "--json").stdout)
    for row in rows:
        assert row["profile"].endswith("(datasheet, not calibrated)")
        # the job's hours: its 1,000 steps, start-up and the export (planning/job_time.py)
        assert row["job_s"]["steps_s"] == pytest.approx(row["step_time_s"] * 1000, rel=1e-2)
        assert row["hours"] == pytest.approx(row["job_s"]["total_s"] / 3600, rel=1e-2)
        assert row["job_s"]["total_s"] > row["job_s"]["steps_s"] + row["job_s"]["start_up_s"]
        assert row["gpu_hours"] == pytest.approx(row["hours"] * 16, rel=1e-2)
        assert row["cost"] == pytest.approx(row["gpu_hours"] * 2.5, rel=1e-2)
        assert 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0
    [best] = [r for r in rows if r["recommended"]]
    fitting = [r for r in rows if r["fits"] and r["engine"] != "fsdp"]
    assert best["step_time_s"] == min(r["step_time_s"] for r in fitting)
    # an unknown GPU and no profile: no forecast, and the table says how to get one
    unknown = run_dplaunch("plan", *flags)
    assert "no forecast: no profile of these GPUs (run `dplaunch calibrate`" in unknown.stdout
    keys = json.loads(run_dplaunch("plan", *flags, "--json").stdout)[0]
    assert keys["step_time_s"] is None and keys["profile"] is None


def test_auto_picks_the_faster_of_the_fitting_layouts_under_each_profile(tmp_path):
    from dplaunch.config.load import build_run_config
    from dplaunch.planning.auto import resolve_auto_parallel
    from dplaunch.planning.plan import Machine

    data = yaml.safe_load((REPO / "examples" / "llama-1b.yaml").read_text())
    data["parallel"] = "auto"
    data.setdefault("launch", {}).update({"gpus": 16, "gpu_memory_gb": 80})
    facts = ModelFacts.from_config_dict(data["model"]["config"])
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
    fast_compute = (DensePoint("bf16", 1024, 4096, 1e15),)
    # a slow optimizer and a fast network: partitioning the optimizer (ZeRO) pays
    slow_optimizer = small_profile(
        dense=fast_compute,
        optimizer_s_per_param=1e-8,
        cpu_adam_s_per_param=1e-6,
        collectives={"intra": {op: Link(1e-6, 1e13) for op in ops}},
    )
    # a fast optimizer and a slow network: the least traffic (DDP) pays
    slow_network = small_profile(
        dense=fast_compute,
        optimizer_s_per_param=1e-13,
        collectives={"intra": {op: Link(1e-3, 1e9) for op in ops}},
    )
    picks = {}
    for name, profile in (("slow optimizer", slow_optimizer), ("slow network", slow_network)):
        config = build_run_config(data, assignments=[], base_dir=REPO / "examples")
        choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=16), profile=profile)
        fitting = [c for c in choice.candidates if c.fits and c.fsdp is None]
        fastest = min(fitting, key=lambda c: c.forecast.step_time_s)
        assert (choice.parallel.zero_stage, choice.parallel.offload) == (
            fastest.zero_stage,
            fastest.offload,
        )
        # the runner-up named, or a tie to the digits (ZeRO-1 and ZeRO-2 at one micro-batch)
        assert "beats" in choice.note or "as fast as" in choice.note, choice.note
        picks[name] = choice.parallel
    assert picks["slow optimizer"].zero_stage > 0 and picks["slow optimizer"].offload == "none"
    assert (picks["slow network"].zero_stage, picks["slow network"].tp) == (0, 1)


def test_why_one_forecast_beats_another_names_the_term_that_differs():
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    profile = small_profile(dense=(DensePoint("bf16", 1024, 4096, 1e15),))
    zero2 = forecast_step(facts, ParallelDims(16, 8, zero_stage=2), workload(), profile)
    zero3 = forecast_step(facts, ParallelDims(16, 8, zero_stage=3), workload(), profile)
    offload = forecast_step(
        facts, ParallelDims(16, 8, zero_stage=2, offload="optimizer"), workload(), profile
    )
    pipeline = forecast_step(facts, ParallelDims(16, 8, pp=2), workload(), profile)
    faster, slower = sorted((zero2, zero3), key=lambda f: f.step_time_s)
    assert re.fullmatch(r"(\d+% less|no) [a-z-]+ traffic", why_faster(faster, slower))
    assert why_faster(zero2, offload) == "no CPU offload"
    assert why_faster(zero2, pipeline) == "no pipeline bubble"


def test_a_run_more_than_25_percent_off_names_the_most_wrong_term():
    forecast = {
        "step_time_s": 1.0,
        "terms_s": {
            "compute": 0.6,
            "communication": 0.3,
            "bubble": 0.0,
            "offload": 0.0,
            "optimizer": 0.1,
        },
        "phases_s": {
            "forward": {"compute": 0.2, "communication": 0.0},
            "backward": {"compute": 0.4, "communication": 0.3},
            "step": {"optimizer": 0.1, "offload": 0.0, "communication": 0.0},
        },
    }
    close = compare_with_forecast(forecast, 1.1, {"forward": 0.2, "backward": 0.8, "step": 0.1})
    assert close["forecast_ratio"] == 1.1 and "forecast_note" not in close
    off = compare_with_forecast(forecast, 2.0, {"forward": 0.25, "backward": 1.65, "step": 0.1})
    assert off["forecast_most_wrong"] == "compute"
    assert off["forecast_note"].startswith("the forecast was 2.00× off (1 s/step forecast, 2 s")
    assert "the backward took 1.65 s a step, forecast 0.7 s" in off["forecast_note"]
    # DeepSpeed steps inside Accelerate's backward: the two phases are compared as one
    joined = compare_with_forecast(
        forecast, 2.0, {"forward": 0.2, "backward": 1.8, "step": 0.0}, ("backward", "step")
    )
    assert "the backward and step took 1.8 s a step, forecast 0.8 s" in joined["forecast_note"]
    untimed = compare_with_forecast(forecast, 0.5, None)
    assert untimed["forecast_most_wrong"] == "compute"
    assert "its phases were not timed" in untimed["forecast_note"]


def test_fsdp_takes_the_gradient_norm_to_clip_or_for_the_guard_but_not_for_an_fp16_guard():
    # with max_grad_norm 0 the FSDP engine still takes the norm when the non-finite guard judges
    # it (train/fsdp.py), the same all-reduces as clipping; under fp16 overflows are the scaler's
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    dims = ParallelDims(8, 8, fsdp="full")

    def norms(mixed_precision="bf16", **flags) -> int:
        collectives = step_collectives(
            facts, dims, workload(mixed_precision=mixed_precision), **flags
        )
        return sum(c.what == "FSDP2 gradient norms" for c in collectives)

    assert norms(guard=False, clip=True) == norms(guard=True, clip=False) == 1
    assert norms(guard=False, clip=False) == 0
    assert norms("fp16", guard=True, clip=False) == 0
