"""Choosing and trusting a plan: `dplaunch plan`, `parallel: auto`, `verify`, `env`, `report`,
and the memory estimate checked against what real ranks hold."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dplaunch.config.load import build_run_config
from dplaunch.errors import UserError
from dplaunch.planning.auto import resolve_auto_parallel
from dplaunch.planning.estimate import GIB, estimate_memory, model_state_bytes
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.plan import Machine
from dplaunch.planning.workload import Workload
from tests.conftest import COMPARISON_FLAGS
from tests.helpers import (
    LLAMA_7B,
    REPO,
    TINY_LLAMA,
    child_environment,
    fake_nvidia_smi,
    heavy_imports,
    llama_7b_run_file,
    option_choices,
    ranks,
    refusal_line,
    run_cli,
    run_config,
    run_dplaunch,
    train_losses,
)

# -- dplaunch plan --------------------------------------------------------------------------------


def test_plan_for_a_7b_llama_on_16_x_80gb_recommends_zero1_and_says_why(tmp_path):
    config_json = tmp_path / "llama-7b" / "config.json"
    config_json.parent.mkdir()
    config_json.write_text(json.dumps(LLAMA_7B))
    result = run_cli(
        "plan", "--model", config_json.parent, "--gpus", "16", "--nodes", "4", "--gpu-memory", "80"
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "6,738,415,616 parameters" in out and "exact count" in out
    assert "micro batch 1 × sequence 2048" in out and "bf16" in out
    ddp = next(line for line in out.splitlines() if line.strip().startswith("DDP"))
    assert ddp.split()[-1] == "no"  # 100.4 GB of model states alone
    marked = [line for line in out.splitlines() if line.startswith("* ")]
    assert marked[0].startswith("* ZeRO-1 ") and marked[0].endswith("yes")
    # sdpa, transformers' pick for llama: no s×s scores (eager would leave 15%)
    assert "sdpa attention, as transformers picks it" in out
    assert marked[1].startswith("* ZeRO-1 fits in 80 GB with 45% headroom")
    assert "memory of one GPU under ZeRO-1 (GiB):" in out
    # every rank of a node loads the whole fp32 model: 4 × 4 bytes × 6.74 B parameters
    assert "host RAM: 4 rank(s) per node × 25.1 GiB (the fp32 model at load) = 100.4 GiB" in out
    assert re.search(r"logits in the loss \(12 bytes each\) +0\.73\b", out)

    rows = json.loads(
        run_cli(
            "plan",
            "--model",
            config_json,
            "--gpus",
            "16",
            "--nodes",
            "4",
            "--gpu-memory",
            "32",
            "--attn-implementation",
            "eager",
            "--json",
        ).stdout
    )
    for key in ("zero_stage", "offload", "tp", "pp", "dp", "model_states_gb", "activations_gb"):
        assert key in rows[0]
    assert all("total_gb" in r and "fits" in r and "recommended" in r for r in rows)
    [best] = [r for r in rows if r["recommended"]]
    assert (best["zero_stage"], best["tp"], best["pp"], best["dp"]) == (1, 4, 1, 4)
    assert best["attn_implementation"] == "eager"
    assert sum(best["memory_gb"].values()) - best["memory_gb"]["step_gb"] == pytest.approx(
        best["total_gb"], abs=0.01
    )
    assert not any(r["fits"] for r in rows if r["tp"] == 1 and r["pp"] == 1)
    # dplaunch cannot run AutoTP inside the pipeline engine: such layouts are not offered
    assert not any(r["tp"] > 1 and r["pp"] > 1 for r in rows)


def test_plan_of_a_hub_model_with_the_hub_unreachable_is_one_line_at_once(tmp_path):
    # a closed local port stands for the Hub: before, huggingface_hub retried for 24 s and
    # printed 11 lines before the message
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens on it once closed
    env = child_environment(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE")
    result = run_dplaunch(
        "plan", "--model", "someorg/some-model", "--gpus", "8", env=env, timeout=20
    )
    refusal_line(
        result,
        "--model: 'someorg/some-model' is neither a local folder, in the Hugging Face cache, nor "
        f"reachable (127.0.0.1:{port}: Connection refused) — download its config first (hf "
        "download ID config.json)",
    )


def test_plan_takes_the_workload_from_a_run_file():
    result = run_cli("plan", TINY_LLAMA, "--gpus", "2", "--gpu-memory", "16")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "181,184 parameters" in out  # the tiny Llama's exact count
    assert "sequence 64, global batch 8, fp32" in out  # data.max_length, train section
    assert "* DDP" in out and "2 GPUs (1 node(s) × 2), 16 GB each (from --gpu-memory)" in out


def test_plan_without_a_gpu_asks_for_its_memory_in_one_line():
    result = run_cli("plan", TINY_LLAMA, "--gpus", "2")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("dplaunch: error: --gpu-memory: no GPU here")
    assert "Traceback" not in result.stderr


def test_plan_reads_the_gpu_memory_from_nvidia_smi(tmp_path):
    path = fake_nvidia_smi(
        tmp_path,
        'echo "0, GPU-0a, 40960, 8.0, NVIDIA A100-SXM4-40GB"; '
        'echo "1, GPU-1b, 40960, 8.0, NVIDIA A100-SXM4-40GB"',
    )
    env = child_environment(PATH=path)
    del env["CUDA_VISIBLE_DEVICES"]
    result = run_cli("plan", TINY_LLAMA, env=env)
    assert result.returncode == 0, result.stderr
    assert "2 GPUs (1 node(s) × 2), 40 GB each (from nvidia-smi)" in result.stdout


def test_plan_imports_no_training_library():
    assert heavy_imports("plan", "--model", REPO / "examples", "--gpus", "8") == []


# -- model states in fp32: what DeepSpeed really keeps -------------------------------------------


def test_fp32_zero_keeps_a_master_copy_so_its_optimizer_share_is_12_bytes():
    psi = 1_000_000
    assert model_state_bytes(psi, dp=4, zero_stage=0, mixed_precision="no")[:3] == (
        4 * psi,
        4 * psi,
        8 * psi,
    )
    assert model_state_bytes(psi, dp=4, zero_stage=2, mixed_precision="no")[:3] == (
        4 * psi,
        psi,
        3 * psi,
    )


# -- parallel: auto ------------------------------------------------------------------------------


def test_auto_picks_a_plan_that_fits_when_ddp_does_not(tmp_path):
    config = run_config(
        llama_7b_run_file(tmp_path / "7b.yaml"),
        "launch.gpus=16",
        "launch.nodes=4",
        "launch.gpu_memory_gb=32",
        "model.attn_implementation=eager",
    )
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=4))
    ddp = next(c for c in choice.candidates if c.name == "DDP")
    assert not ddp.fits
    picked = next(c for c in choice.candidates if c.recommended)
    assert picked.fits and picked.total_gb <= 32 * 0.9
    p = choice.parallel
    assert (p.zero_stage, p.offload, p.tp, p.pp, p.auto) == (1, "none", 4, 1, False)
    assert choice.note.startswith("parallel: auto → ZeRO-1 with tp 4 fits in 32 GB")
    assert "(32 GB per GPU from launch.gpu_memory_gb)" in choice.note


def test_auto_counts_lora_a_7b_base_frozen_in_bf16_fits_8_x_24gb_with_zero1(tmp_path):
    # full fine-tuning needs ZeRO-3 (16 bytes per parameter / 8); LoRA holds the 7B base once,
    # frozen (DeepSpeed's bf16: 12.6 GiB), with 40 M trainable adapter parameters
    path = llama_7b_run_file(tmp_path / "7b.yaml")
    setting = ("launch.gpus=8", "launch.gpu_memory_gb=24", "data.max_length=1024")
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    full = resolve_auto_parallel(run_config(path, *setting), facts, Machine(visible_gpus=8))
    assert full.parallel.zero_stage == 3
    lora = run_config(path, *setting, "model.lora={r: 16}")
    choice = resolve_auto_parallel(lora, facts, Machine(visible_gpus=8))
    assert (choice.parallel.zero_stage, choice.parallel.tp, choice.parallel.pp) == (1, 1, 1)
    assert choice.note.startswith("parallel: auto → ZeRO-1 fits in 24 GB")
    picked = next(c for c in choice.candidates if c.recommended)
    assert picked.memory.trainable_params == 39_976_960
    assert picked.gradients_gb * GIB == 2 * 39_976_960  # the adapters' only
    ddp = next(c for c in choice.candidates if c.name == "DDP")
    assert not ddp.fits  # DDP keeps the frozen base in fp32: 25 GiB
    # LoRA trains with data parallelism only (rules.check_lora_layout): no tp or pp row
    assert {(c.tp, c.pp) for c in choice.candidates} == {(1, 1)}


def test_plan_shows_lora_and_qlora_and_refuses_quantize_without_lora(tmp_path):
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(LLAMA_7B))
    shape = ("--model", config_json, "--gpus", "2", "--gpu-memory", "24", "--seq-len", "1024")
    qlora = run_cli("plan", *shape, "--lora", "16", "--quantize", "4bit")
    assert qlora.returncode == 0, qlora.stderr
    assert (
        "LoRA r 16 on all-linear: 39,976,960 trainable parameters (39,976,960 in adapters; "
        "0.59% of the model); base weights 4bit (QLoRA): no gradients, no optimizer states"
    ) in qlora.stdout
    # a 7B in 4-bit plus adapters: plain DDP on two 24 GB GPUs
    assert "* DDP fits in 24 GB" in qlora.stdout
    rows = json.loads(run_cli("plan", *shape, "--lora", "16", "--json").stdout)
    ddp = next(row for row in rows if row["name"] == "DDP")
    assert not ddp["fits"] and ddp["gradients_gb"] == round(4 * 39_976_960 / GIB, 3)
    # FSDP rows count LoRA as ZeRO-3's do, but hold the frozen base's shards in fp32 (2 bytes more)
    by_name = {row["name"]: row for row in rows}
    assert {"FSDP", "FSDP + offload all"} <= by_name.keys()
    frozen = 6_738_415_616 - 39_976_960
    fsdp, zero3 = by_name["FSDP"], by_name["ZeRO-3"]
    assert fsdp["gradients_gb"] == zero3["gradients_gb"]
    assert abs(fsdp["weights_gb"] - zero3["weights_gb"] - 2 * frozen / 2 / GIB) < 2e-3
    assert "FSDP" not in qlora.stdout  # QLoRA is refused with FSDP (lora_check.check_lora)
    refused = run_cli("plan", *shape, "--quantize", "8bit")
    refusal_line(refused, "--quantize: QLoRA quantizes the frozen base of a LoRA run", "--lora R")
    import typing

    from dplaunch.config.schema import LoraConfig

    quantize = LoraConfig.model_fields["quantize"].annotation
    assert option_choices("plan", "--quantize") == [*typing.get_args(typing.get_args(quantize)[0])]


def test_auto_picks_ddp_when_ddp_fits():
    config = run_config(TINY_LLAMA, "parallel=auto", "launch.gpus=2", "launch.gpu_memory_gb=16")
    facts = ModelFacts.from_config_dict(config.model.config)
    choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=2))
    assert (choice.parallel.zero_stage, choice.parallel.tp, choice.parallel.pp) == (0, 1, 1)
    assert choice.note.startswith("parallel: auto → DDP fits in 16 GB")


def test_auto_asks_nvidia_smi_on_gpus_and_needs_an_answer(tmp_path):
    config = run_config(llama_7b_run_file(tmp_path / "7b.yaml"), "launch.gpus=8")
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=8), lambda: 80.0)
    assert (choice.parallel.zero_stage, choice.parallel.tp) == (1, 1)
    assert "80 GB per GPU from nvidia-smi" in choice.note
    with pytest.raises(UserError, match="launch.gpu_memory_gb: parallel: auto needs the memory"):
        resolve_auto_parallel(config, facts, Machine(visible_gpus=8), lambda: None)


def test_auto_on_cpu_ranks_keeps_ddp_unless_told_the_memory():
    config = run_config(TINY_LLAMA, "parallel=auto", "launch.gpus=2", "launch.cpu=true")
    facts = ModelFacts.from_config_dict(config.model.config)
    choice = resolve_auto_parallel(config, facts, Machine(visible_gpus=0))
    assert (choice.parallel.zero_stage, choice.parallel.tp, choice.parallel.pp) == (0, 1, 1)
    assert "CPU ranks have no GPU memory to plan for" in choice.note


def test_auto_refuses_explicit_parallel_flags_and_says_when_nothing_fits(tmp_path):
    path = llama_7b_run_file(tmp_path / "7b.yaml")
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    config = run_config(
        path, "parallel={auto: true, zero_stage: 2}", "launch.gpu_memory_gb=80", "launch.gpus=16"
    )
    with pytest.raises(UserError, match="auto picks zero_stage, offload, tp and pp itself"):
        resolve_auto_parallel(config, facts, Machine(visible_gpus=16))
    config = run_config(path, "launch.gpus=2", "launch.gpu_memory_gb=16")
    with pytest.raises(UserError, match="nothing fits: the smallest plan"):
        resolve_auto_parallel(config, facts, Machine(visible_gpus=2))


def test_auto_only_picks_a_layout_that_can_split_the_global_batch(tmp_path):
    # 16 GPUs, global batch 4: dp 16 or 8 cannot split it, so the smallest fitting plan with dp ≤ 4 wins
    path = llama_7b_run_file(tmp_path / "7b.yaml", global_batch_size=4)
    config = run_config(path, "launch.gpus=16", "launch.nodes=4", "launch.gpu_memory_gb=80")
    choice = resolve_auto_parallel(config, ModelFacts.from_config_dict(LLAMA_7B), Machine())
    assert 16 // (choice.parallel.tp * choice.parallel.pp) <= 4
    assert any(c.fits and c.dp == 16 for c in choice.candidates)  # would have fitted


def test_auto_pipelines_an_sft_run_only_when_the_pipeline_can_take_its_examples(tmp_path):
    # one KV head: no tp; 2 GPUs of 252 GB: only pp 2 fits without offload. Packed SFT examples
    # are refused with pp > 1 (data/sft_checks.py), so auto falls back to a data-parallel plan with offload
    from dplaunch.planning.auto import plan_candidates, run_workload

    path = llama_7b_run_file(tmp_path / "7b.yaml")
    for packing in (False, True):
        config = run_config(path, "model.task=sft", f"data.packing={str(packing).lower()}")
        workload = run_workload(config)
        assert workload.pipeline is not packing
        workload = dataclasses.replace(workload, micro_batch=8, fixed_micro_batch=8, seq_len=4096)
        table = plan_candidates(
            ModelFacts.from_config_dict({**LLAMA_7B, "num_key_value_heads": 1}),
            workload,
            gpus=2,
            gpus_per_node=2,
            gpu_memory_gb=252,
        )
        picked = next(c for c in table if c.recommended)
        assert (picked.pp, picked.offload == "none") == ((1, False) if packing else (2, True))


def test_auto_dry_run_runs_the_recommended_plan_and_prints_why(tmp_path):
    path = llama_7b_run_file(tmp_path / "7b.yaml")
    result = run_cli(
        "train",
        path,
        "--gpus",
        "16",
        "--nodes",
        "4",
        "--set",
        "launch.gpu_memory_gb=32",
        "--set",
        "model.attn_implementation=eager",
        "--master-port",
        "29677",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mesh: dp 4 × tp 4 × pp 1 = 16 ranks" in out and "ZeRO stage 1" in out
    assert "note: parallel: auto → ZeRO-1 with tp 4 fits in 32 GB" in out
    resolved = yaml.safe_load(out.split("run.yaml\n", 1)[1].split("\n---", 1)[0])
    assert resolved["parallel"] == {
        "zero_stage": 1,
        "offload": "none",
        "tp": 4,
        "pp": 1,
        "fsdp": None,
        "sp": 1,
        "auto": False,
    }
    assert '"autotp_size": 4' in out  # the rendered deepspeed.json
    assert not (tmp_path / "run").exists()

    tiny = run_cli(
        "train", TINY_LLAMA, "--cpu", "--gpus", "2", "--set", "parallel=auto", "--dry-run"
    )
    assert tiny.returncode == 0, tiny.stderr
    assert "engine: ddp" in tiny.stdout and "note: parallel: auto → DDP" in tiny.stdout


# -- the estimate against the bytes real ranks hold ---------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_each_rank_holds_are_within_10_percent_of_the_estimate(tmp_path, stage):
    from tests.memory_probe import PROBE_CONFIG, SEQ_LEN

    result = run_dplaunch(
        "launch",
        REPO / "tests" / "memory_probe.py",
        "--cpu",
        "--gpus",
        "2",
        "--zero",
        str(stage),
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "-o",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    held_by_rank = [json.loads(m) for m in re.findall(r"MEMORY (\{.*?\})", result.stdout)]
    assert sorted(r["rank"] for r in held_by_rank) == [0, 1]
    estimate = estimate_memory(
        ModelFacts.from_config_dict(PROBE_CONFIG),
        ranks(dp=2, zero_stage=stage),
        Workload(mixed_precision="no", micro_batch=2, seq_len=SEQ_LEN),
    )
    expected = {
        "parameters": estimate.weights_gb * GIB,
        "gradients": estimate.gradients_gb * GIB,
        "optimizer": estimate.optimizer_gb * GIB,
    }
    assert estimate.params_per_gpu == held_by_rank[0]["parameters_total"]  # the count is exact
    for held in held_by_rank:
        print(f"ZeRO-{stage} rank {held['rank']}: held {held}, estimated {expected}")
        for kind, estimated in expected.items():
            assert held[kind] == pytest.approx(estimated, rel=0.10), kind
        total = sum(held[kind] for kind in expected)
        assert total == pytest.approx(estimate.model_states_gb * GIB, rel=0.10)


@pytest.mark.multiprocess
def test_lora_bytes_each_zero_3_rank_holds_are_within_10_percent_of_the_estimate(tmp_path):
    # ZeRO-3 partitions the frozen base too; gradients and optimizer states are the adapters' only
    from dplaunch.planning.lora import LoraSpec, count_lora
    from tests.memory_probe import PROBE_CONFIG, SEQ_LEN

    flags = ("--cpu", "--gpus", "2", "--zero", "3", "--global-batch", "8", "--micro-batch", "2")
    result = run_dplaunch(
        "launch",
        REPO / "tests" / "memory_probe.py",
        *flags,
        "-o",
        tmp_path / "run",
        env=child_environment(PROBE_LORA_RANK="8"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    held_by_rank = [json.loads(m) for m in re.findall(r"MEMORY (\{.*?\})", result.stdout)]
    assert sorted(r["rank"] for r in held_by_rank) == [0, 1]
    facts = ModelFacts.from_config_dict(PROBE_CONFIG)
    lora = count_lora(facts, LoraSpec(r=8))
    estimate = estimate_memory(
        facts,
        ranks(dp=2, zero_stage=3),
        Workload(mixed_precision="no", micro_batch=2, seq_len=SEQ_LEN),
        lora=lora,
    )
    expected = {
        "parameters": estimate.weights_gb * GIB,
        "gradients": estimate.gradients_gb * GIB,
        "optimizer": estimate.optimizer_gb * GIB,
    }
    for held in held_by_rank:
        print(f"LoRA ZeRO-3 rank {held['rank']}: held {held}, estimated {expected}")
        for kind, estimated in expected.items():
            assert held[kind] == pytest.approx(estimated, rel=0.10), kind


# -- dplaunch verify ------------------------------------------------------------------------------


def test_a_shrunk_model_keeps_its_architecture_and_the_mesh_divisibility():
    import transformers

    from dplaunch.commands.verify import shrunk_model_config

    gqa_70b = {
        **LLAMA_7B,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
    }
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}
    qwen3 = {
        **LLAMA_7B,
        "model_type": "qwen3",
        "num_key_value_heads": 8,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "awq"},
    }
    for raw, tp, pp in (
        (LLAMA_7B, 4, 1),
        (LLAMA_7B, 1, 4),
        (gqa_70b, 8, 1),
        (gpt2, 2, 1),
        (qwen3, 2, 2),
    ):
        small = shrunk_model_config(raw, tp=tp, pp=pp)
        facts, real = ModelFacts.from_config_dict(small), ModelFacts.from_config_dict(raw)
        assert facts.model_type == real.model_type and facts.vocab_size == real.vocab_size
        assert facts.num_heads % tp == 0 and facts.num_kv_heads % tp == 0
        grouped = facts.num_heads > facts.num_kv_heads
        assert grouped == (real.num_heads > real.num_kv_heads)  # GQA stays GQA, MHA stays MHA
        assert facts.num_layers >= max(2, pp) and facts.num_layers % pp == 0
        assert "quantization_config" not in small and "torch_dtype" not in small
        fields = dict(small)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        )
        assert sum(p.numel() for p in model.parameters()) < 20e6  # small enough for CPU ranks


def verify(*args: object, timeout: float = 900) -> subprocess.CompletedProcess:
    return run_dplaunch("verify", *args, timeout=timeout)


@pytest.mark.multiprocess
def test_verify_passes_for_zero2_against_a_ddp_run_and_report_overlays_them(tmp_path, dp_reference):
    # the session's 2-rank DDP run (6 steps, global batch 8) serves as the reference
    out = tmp_path / "verify"
    result = verify(
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--zero",
        "2",
        *COMPARISON_FLAGS[2:],
        "--steps",
        COMPARISON_FLAGS[1],
        "--reference",
        dp_reference,
        "-o",
        out,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (out / "dp").exists()  # the reference was not run again
    table = result.stdout.split("verify: per-step training loss", 1)[1]
    assert f"ZeRO-2 dp 2 vs DDP (2 ranks, {dp_reference})" in table
    rows = [line.split() for line in table.splitlines() if re.match(r"\s+\d+\s+\d", line)]
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6]
    assert [float(row[1]) for row in rows] == pytest.approx(train_losses(out / "plan"), abs=1e-6)
    assert [float(row[2]) for row in rows] == pytest.approx(train_losses(dp_reference), abs=1e-6)
    header = json.loads((out / "plan" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["zero_stage"] == 2
    assert re.search(
        r"verify: PASS — largest relative gap \S+ \(step \d\) ≤ tolerance 1e-03", result.stdout
    )

    # the two runs as `dplaunch report` draws them
    report = run_dplaunch(
        "report", out / "plan", "--compare", dp_reference, "--out", tmp_path / "r"
    )
    assert report.returncode == 0, report.stderr
    for name in ("loss.png", "lr.png", "throughput.png", "memory.png", "eval.png"):
        png = (tmp_path / "r" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert summary.count("steps            6") == 2 and "ZeRO 2" in summary and "ZeRO 0" in summary
    assert "final loss" in report.stdout and f"plot: {tmp_path / 'r' / 'loss.png'}" in report.stdout


@pytest.mark.multiprocess
def test_verify_rehearses_a_7b_tensor_parallel_plan_on_cpu_with_a_shrunk_model(tmp_path):
    # the whole verify: the plan run, then its own DDP reference run
    path = llama_7b_run_file(tmp_path / "7b.yaml", parallel={"tp": 2}, mixed_precision="no")
    out = tmp_path / "verify"
    result = verify(
        path,
        "--cpu",
        "--gpus",
        "2",
        "--shrink",
        "--steps",
        "4",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--set",
        "data.max_length=64",
        "-o",
        out,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--shrink: llama with 2 layers, hidden 32, 2 heads / 2 KV heads" in result.stdout
    assert "(real: 32 layers, hidden 4096), random init, sequence length 64" in result.stdout
    assert train_losses(out / "dp") and not (out / "dp" / "deepspeed.json").exists()
    header = json.loads((out / "plan" / "metrics.jsonl").read_text().splitlines()[0])
    assert (header["tensor_parallel_size"], header["world_size"]) == (2, 2)
    assert "AutoTP dp 1 × tp 2 vs DDP (2 ranks" in result.stdout
    assert "verify: PASS" in result.stdout


@pytest.mark.multiprocess
def test_verify_fails_when_the_plan_does_not_average_gradients(tmp_path, dp_reference):
    steps = COMPARISON_FLAGS[1]
    result = verify(
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        *COMPARISON_FLAGS[2:],
        "--steps",
        steps,
        "--reference",
        dp_reference,
        "--inject-fault",
        "no-grad-average",
        "-o",
        tmp_path / "v",
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAULT INJECTED into the plan run: no-grad-average" in result.stdout
    assert (
        "dplaunch.train.gradient_faults --inject-fault no-grad-average" in result.stdout
    )  # the ranks' entry
    match = re.search(
        r"verify: FAIL — largest relative gap (\S+) \(step (\d)\) > tolerance", result.stdout
    )
    assert match and float(match.group(1)) > 1e-3 and int(match.group(2)) > 2, result.stdout[-1500:]
    # the first two steps agree (step 1 is before any update, step 2 follows warm-up's lr 0)
    losses, reference = train_losses(tmp_path / "v" / "plan"), train_losses(dp_reference)
    assert losses[:2] == pytest.approx(reference[:2], rel=1e-6) and losses != reference


@pytest.mark.multiprocess
def test_verify_refuses_a_reference_with_other_maths_before_running_anything(
    tmp_path, dp_reference
):
    result = verify(
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        *COMPARISON_FLAGS[2:],
        "--steps",
        "6",
        "--set",
        "train.lr=3e-3",
        "--reference",
        dp_reference,
        "-o",
        tmp_path / "v",
    )
    assert result.returncode == 2
    assert "--reference" in result.stderr and "train section differs: lr 0.001" in result.stderr
    assert not (tmp_path / "v").exists()


# -- dplaunch env --------------------------------------------------------------------------------


def test_env_shows_versions_gpus_port_and_deepspeed_ops():
    import importlib.metadata

    result = run_dplaunch("env")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for package in ("torch", "accelerate", "deepspeed", "transformers", "datasets"):
        assert re.search(
            rf"^{package}\s+{re.escape(importlib.metadata.version(package))}$", out, re.M
        )
    assert re.search(r"^python\s+\d+\.\d+", out, re.M)
    assert "GPUs                  none" in out and "CUDA_VISIBLE_DEVICES  ''" in out
    assert re.search(r"^port 29500\s+(free|IN USE)", out, re.M)
    assert re.search(r"^  cpu_adam\s+(compatible|NOT compatible)", out, re.M)
    fast = run_dplaunch("env", "--no-ops", "--json")
    assert json.loads(fast.stdout)["deepspeed_ops"] is None


# -- one estimate for the plan, `parallel: auto` and the GPU benchmark ---------------------------


def test_the_gpu_benchmark_checks_the_estimate_the_planner_makes(tmp_path):
    from benchmarks.gpu_report import run_estimate
    from dplaunch.planning.auto import plan_candidates, run_workload

    run = yaml.safe_load((REPO / "benchmarks" / "configs" / "llama-1b.yaml").read_text())
    config = build_run_config(run)
    facts = ModelFacts.from_config_dict(config.model.config)
    table = plan_candidates(facts, run_workload(config), gpus=1, gpus_per_node=1, gpu_memory_gb=141)
    ddp = next(c for c in table if c.name == "DDP")
    assert run_estimate(run) == ddp.memory
    assert ddp.memory.attn_implementation == "sdpa"  # what transformers runs for llama
    run["model"]["attn_implementation"] = "eager"
    eager = run_estimate(run)
    assert eager.attn_implementation == "eager"
    assert eager.activations_gb > 2 * ddp.activations_gb  # 32 heads × 2048² scores per layer


def test_plan_flag_and_run_file_key_name_the_same_attention_kernels():
    from typing import get_args

    from dplaunch.config.schema import ModelConfig

    kernels = ModelConfig.model_fields["attn_implementation"].annotation
    assert option_choices("plan", "--attn-implementation") == list(get_args(get_args(kernels)[0]))
    eager = run_cli(
        "plan",
        TINY_LLAMA,
        "--gpus",
        "2",
        "--gpu-memory",
        "16",
        "--set",
        "model.attn_implementation=eager",
    )
    assert eager.returncode == 0, eager.stderr
    assert "eager attention (keeps the s×s attention scores)" in eager.stdout
    wrong = run_cli(
        "plan",
        TINY_LLAMA,
        "--gpus",
        "2",
        "--gpu-memory",
        "16",
        "--set",
        "model.attn_implementation=fast",
    )
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("dplaunch: error: model.attn_implementation:")


# -- host RAM: every rank of a node loads the model at once ------------------------------------


def test_eight_ranks_that_each_load_a_fp32_7b_are_refused_on_a_128_gib_node():
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.plan import make_plan

    facts = ModelFacts.from_config_dict(LLAMA_7B)
    node = Machine(visible_gpus=8, host_memory_gb=128)
    bf16 = TrainConfig(mixed_precision="bf16", global_batch_size=64)

    def plan(machine: Machine = node, **parallel: object):
        return make_plan(LaunchConfig(gpus=8), ParallelConfig(**parallel), bf16, machine, facts)

    with pytest.raises(UserError) as refused:
        plan(zero_stage=2)
    # 8 × 4 bytes × 6.74 B parameters = 200.8 GiB
    assert str(refused.value).startswith(
        "launch.gpus_per_node: host RAM: 8 rank(s) per node × 25.1 GiB (the fp32 model at load) "
        "= 200.8 GiB of this node's 128.0 GiB"
    )
    assert "use ZeRO-3" in str(refused.value)
    assert not any("host RAM" in note for note in plan(zero_stage=3).notes)  # 8 × 3.1 GiB
    # offloading all of ZeRO-3's states keeps 18 bytes × Ψ/8 per rank in host RAM: a note
    offloaded = plan(zero_stage=3, offload="all")
    assert any(
        note.startswith("host RAM: 8 rank(s) per node × 14.1 GiB") for note in offloaded.notes
    )
    plan(Machine(visible_gpus=8), zero_stage=2)  # RAM unknown: nothing to check
    plan(Machine(visible_gpus=8, render_only=True, host_memory_gb=128), zero_stage=2)  # elsewhere


def test_qlora_ranks_are_charged_the_quantized_model_they_load_not_a_fp32_one():
    # bitsandbytes quantizes each weight as it loads: 8 QLoRA ranks of a 7B on a 128 GiB node
    # hold 8 × 3.7 GiB; charged 8 × 25.1 GiB of fp32 they were refused with "use ZeRO-3", which
    # builds a quantized model whole anyway
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.lora import LoraSpec
    from dplaunch.planning.plan import ModelChoices, make_plan

    qlora = ModelChoices(lora=LoraSpec(r=16, quantize="4bit"))
    facts = ModelFacts.from_config_dict(LLAMA_7B)
    node = Machine(visible_gpus=8, host_memory_gb=128)
    bf16 = TrainConfig(mixed_precision="bf16", global_batch_size=64)
    for zero_stage in (0, 3):
        plan = make_plan(LaunchConfig(gpus=8), ParallelConfig(zero_stage=zero_stage), bf16, node,
                         facts, qlora)  # fmt: skip
        assert not any("host RAM" in note for note in plan.notes)
    small = Machine(visible_gpus=8, host_memory_gb=24)
    with pytest.raises(UserError) as refused:
        make_plan(LaunchConfig(gpus=8), ParallelConfig(zero_stage=3), bf16, small, facts, qlora)
    assert "(the quantized model at load)" in str(refused.value)
    assert "ZeRO-3" not in refused.value.fix


def test_a_qlora_70b_whose_merged_export_cannot_fit_the_node_is_refused_before_launch():
    # 2 QLoRA ranks of a 70B load 2 × 37 GiB on a 128 GiB node and train; at the end rank 0
    # builds the base again for the merged model: in bf16, the checkpoint's dtype (130 GiB; it
    # was built in fp32, 260 GiB, and the check did not count it), so the run failed at export
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.lora import LoraSpec
    from dplaunch.planning.plan import ModelChoices, make_plan

    llama_70b = dict(LLAMA_7B, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                     num_key_value_heads=8, intermediate_size=28672, dtype="bfloat16")  # fmt: skip
    facts = ModelFacts.from_config_dict(llama_70b)
    node = Machine(visible_gpus=2, host_memory_gb=128)

    def plan(machine: Machine = node, **lora: object):
        spec = LoraSpec(r=16, quantize="4bit", **lora)  # type: ignore[arg-type]
        return make_plan(LaunchConfig(gpus=2), ParallelConfig(), TrainConfig(), machine, facts,
                         ModelChoices(lora=spec))  # fmt: skip

    with pytest.raises(UserError) as refused:
        plan()
    assert str(refused.value).startswith(
        "model.lora.export: host RAM at export: rank 0 builds the base (bfloat16) for the merged "
        "model, 130.0 GiB of this node's 128.0 GiB"
    ), str(refused.value)
    assert refused.value.fix.startswith("set model.lora.export: adapter-only")
    # the adapter alone: the base is never built, rank 0 holds the adapters
    assert not any("host RAM" in note for note in plan(export="adapter-only").notes)
    # a node with room for the bf16 base takes the merged export
    assert not any("host RAM" in note for note in plan(Machine(2, host_memory_gb=256)).notes)
    # CPU ranks rehearse it: noted, not refused
    rehearsal = make_plan(LaunchConfig(cpu=True, gpus=2), ParallelConfig(), TrainConfig(), node,
                          facts, ModelChoices(lora=LoraSpec(r=16, quantize="4bit")))  # fmt: skip
    assert any(note.startswith("host RAM at export") for note in rehearsal.notes)


def test_the_export_base_is_built_in_the_dtype_the_base_trained_in():
    from dplaunch.planning.lora import export_dtype

    assert export_dtype("bf16", None, "float32") == "bfloat16"
    assert export_dtype("fp16", None, None) == "float16"
    assert export_dtype("no", None, "bfloat16") == "float32"  # loaded and trained in fp32
    # QLoRA: the checkpoint's own 16-bit dtype, whatever the run's mixed precision
    assert export_dtype("no", "4bit", "bfloat16") == "bfloat16"
    assert export_dtype("bf16", "8bit", "float16") == "float16"
    assert export_dtype("bf16", "4bit", "float32") == "bfloat16"


def test_a_78b_on_two_gpus_is_refused_before_launch_in_one_line(tmp_path):
    path = llama_7b_run_file(tmp_path / "78b.yaml", parallel={"zero_stage": 0})
    data = yaml.safe_load(path.read_text())
    data["model"]["config"].update(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672)
    path.write_text(yaml.safe_dump(data))
    two_gpus = child_environment(CUDA_VISIBLE_DEVICES="0,1")  # the planner counts them from here
    run = ("train", path, "--gpus", "2", "--dry-run", "-o", tmp_path / "run")
    # 2 × 4 bytes × 78 B parameters: no machine this runs on has 584 GiB
    refused = run_cli(*run, env=two_gpus)
    refusal_line(
        refused, "launch.gpus_per_node: host RAM: 2 rank(s) per node × 292.0 GiB", "ZeRO-3"
    )
    assert not (tmp_path / "run").exists()
    # CPU ranks rehearse GPU plans: the same plan is noted, not refused
    rehearsal = run_cli(*run, "--cpu")
    assert rehearsal.returncode == 0, rehearsal.stderr
    assert "note: host RAM: 2 rank(s) per node × 292.0 GiB" in rehearsal.stdout
    assert "more than it has (CPU ranks: not refused" in rehearsal.stdout


def test_host_memory_is_the_slurm_jobs_share_when_it_was_given_one():
    from dplaunch.launching.devices import host_memory_gb

    machine = host_memory_gb({})
    assert machine is not None and machine > 0
    assert host_memory_gb({"SLURM_MEM_PER_NODE": "2048"}) == min(machine, 2.0)


def test_flash_attention_on_cpu_ranks_is_refused_before_launch(tmp_path):
    result = run_cli(
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--set",
        "model.attn_implementation=flash_attention_2",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    refusal_line(result, "model.attn_implementation: flash_attention_2 runs on CUDA GPUs only")
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_resumes_under_another_attention_kernel():
    # the kernels compute the same sums: switching to sdpa to save memory keeps the training
    from dplaunch.launching.resume import _check_same_training
    from dplaunch.run_directory.checkpoints import CheckpointInfo

    config = run_config(TINY_LLAMA, "model.attn_implementation=eager")
    saved = config.model_dump(mode="json")
    del saved["model"]["attn_implementation"]  # a run file from before the key existed
    _check_same_training(saved, config, CheckpointInfo(Path("step-1"), {"step": 1}))
