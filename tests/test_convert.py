"""`dplaunch convert` and the resume decisions around it, without training: checkpoints written
here as an FSDP2 run writes them (torch.distributed.checkpoint), with random states.

- A state five times the conversion's memory budget (DPLAUNCH_CONVERT_MEMORY_MB) converts within
  it, into the universal form and from there into an FSDP checkpoint: the peak RSS of the command
  minus that of the same conversion of a tiny state stays under the budget.
- Every form converts back into the same universal form, tensor for tensor.
- `plan --resume` and `train --resume` say in one line what a resume converts; what cannot hold
  the state (no disk for the conversion, GPUs too small for it) is refused before launch.
(The resumes themselves, on real ranks: tests/test_layout_matrix*.py.)
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers import TINY_LLAMA, child_environment, plan_for, run_cli, run_dplaunch

BUDGET_MB = 64


def fsdp_checkpoint(root: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A complete FSDP2 checkpoint (step 2) of a Llama of HIDDEN × LAYERS with random weights and
    Adam state, as a 2-rank run saves it; returns it and its state's bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from dplaunch.config.load import load_run_config

    checkpoint = root / "checkpoints" / "step-2"
    checkpoint.mkdir(parents=True)
    config = yaml.safe_load(TINY_LLAMA.read_text())
    model = config["model"]["config"]
    model.update(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers)
    model.update(num_attention_heads=8, num_key_value_heads=8)
    # the resolved run file, as the launcher copies it into every checkpoint
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    resolved = load_run_config(root / "run.yaml").model_dump(mode="json")
    (checkpoint / "run.yaml").write_text(yaml.safe_dump(resolved))
    plan = plan_for(2, cpu=True, fsdp="full", global_batch_size=8, micro_batch_size=2)
    (checkpoint / "plan.json").write_text(json.dumps(plan.to_dict()))
    fields = dict(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(fields.pop("model_type"), **fields)
        )
    generator = torch.Generator().manual_seed(hidden)
    state = {}
    for name, parameter in built.named_parameters():
        state[f"model.{name}"] = torch.randn(parameter.shape, generator=generator)
        state[f"optimizer.state.{name}.exp_avg"] = torch.randn(parameter.shape, generator=generator)
        state[f"optimizer.state.{name}.exp_avg_sq"] = torch.rand(
            parameter.shape, generator=generator
        )
        state[f"optimizer.state.{name}.step"] = torch.tensor(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(checkpoint / "fsdp"), no_dist=True)
    scheduler = {
        "base_lrs": [1e-3, 1e-3],
        "last_epoch": 2,
        "_step_count": 3,
        "_last_lr": [1e-3, 1e-3],
    }
    torch.save({"scheduler": scheduler}, checkpoint / "trainer_state.pt")
    size = sum(tensor.numel() * 4 for tensor in state.values())
    meta = {**plan.header(), "step": 2, "epoch": 0, "steps_per_epoch": 249, "engine": "fsdp"}
    (checkpoint / "checkpoint.json").write_text(json.dumps({**meta, "size_bytes": size}))
    return checkpoint, size


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("convert")
    return {
        "tiny": fsdp_checkpoint(root / "tiny", 64, 1),
        # 30.7 M parameters: 370 MB of weights and Adam state, 5.8 × the budget
        "large": fsdp_checkpoint(root / "large", 384, 16),
    }


def _peak_rss_mb(output: str) -> float:
    return float(re.findall(r"peak RSS (\d+) MB", output)[-1])


def test_a_state_five_times_the_memory_budget_converts_within_it(tmp_path, checkpoints):
    env = child_environment(DPLAUNCH_CONVERT_MEMORY_MB=str(BUDGET_MB))
    peaks: dict[str, dict[str, float]] = {}
    for kind, (checkpoint, _) in checkpoints.items():
        universal, fsdp = tmp_path / f"{kind}-universal", tmp_path / f"{kind}-fsdp"
        first = run_dplaunch(
            "convert", checkpoint, "--to", "universal", "--out", universal, env=env
        )
        assert first.returncode == 0, first.stderr[-3000:]
        second = run_dplaunch("convert", universal, "--to", "fsdp", "--out", fsdp, env=env)
        assert second.returncode == 0, second.stderr[-3000:]
        peaks[kind] = {"universal": _peak_rss_mb(first.stdout), "fsdp": _peak_rss_mb(second.stdout)}
    large_size = checkpoints["large"][1]
    assert large_size > 5 * (BUDGET_MB << 20)
    for step in ("universal", "fsdp"):
        # what the state adds to the interpreter and its libraries (the tiny state's conversion)
        added = peaks["large"][step] - peaks["tiny"][step]
        assert added * 1e6 <= BUDGET_MB << 20, (step, peaks)
    print("conversion peaks (MB):", peaks, "state:", large_size / 1e6, "MB")


def test_every_form_converts_back_into_the_same_universal_form(tmp_path, checkpoints):
    from dplaunch.train.convert import write_universal
    from dplaunch.train.universal import MOMENTS, STEP, UniversalReader

    checkpoint, _ = checkpoints["tiny"]
    forms = {}
    for form in ("universal", "fsdp", "deepspeed"):
        result = run_cli("convert", checkpoint, "--to", form, "--out", tmp_path / form)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((tmp_path / form / "checkpoint.json").read_text())["format"] == form
        back = tmp_path / f"{form}-back"
        write_universal(
            tmp_path / form, back, memory_bytes=64 << 20, say=lambda _: None, progress=False
        )
        forms[form] = UniversalReader(back)
    reference = UniversalReader(tmp_path / "universal")
    for form, reader in forms.items():
        assert reader.names() == reference.names(), form
        for name, weight, state in reference.entries():
            assert reader.weight(name).equal(weight), (form, name)
            for key in (*MOMENTS, STEP):
                assert reader.state(name, key).equal(state[key]), (form, name, key)
        assert reader.scheduler_state() == reference.scheduler_state(), form
    # and each as a Hugging Face model (`--to hf`, which is `dplaunch export`): the same weights
    from safetensors.torch import load_file

    for form in ("fsdp", "deepspeed", "universal"):
        result = run_cli("convert", tmp_path / form, "--to", "hf", "--out", tmp_path / f"{form}-hf")
        assert result.returncode == 0, result.stderr[-3000:]
        weights = load_file(str(tmp_path / f"{form}-hf" / "model.safetensors"))
        for name in reference.names():
            assert weights[name].equal(reference.weight(name)), (form, name)


def test_the_universal_model_folder_is_a_hugging_face_weights_folder(tmp_path, checkpoints):
    from transformers import AutoConfig, AutoModelForCausalLM

    from dplaunch.train.universal import UniversalReader

    checkpoint, _ = checkpoints["tiny"]
    out = tmp_path / "universal"
    assert run_cli("convert", checkpoint, "--to", "universal", "--out", out).returncode == 0
    config = yaml.safe_load((checkpoint / "run.yaml").read_text())["model"]["config"]
    fields = dict(config)
    folder = out / "model"
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    reader = UniversalReader(out)
    for name, parameter in model.named_parameters():
        assert parameter.detach().equal(reader.weight(name)), name


def test_convert_refuses_in_one_line_what_it_cannot_do(tmp_path, checkpoints):
    checkpoint, _ = checkpoints["large"]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "something").write_text("x")
    result = run_cli("convert", checkpoint, "--to", "universal", "--out", taken)
    assert result.returncode == 2 and "--out: " in result.stderr and "not empty" in result.stderr
    # a parameter (with its Adam state) larger than an eighth of the budget
    env = child_environment(DPLAUNCH_CONVERT_MEMORY_MB="8")
    out = tmp_path / "small-budget"
    result = run_cli("convert", checkpoint, "--to", "universal", "--out", out, env=env)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dplaunch: error: DPLAUNCH_CONVERT_MEMORY_MB: ") and "set " in line
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_plan_and_train_say_what_a_resume_converts_and_about_how_long(tmp_path, checkpoints):
    checkpoint, _ = checkpoints["tiny"]
    run_file = checkpoint / "run.yaml"
    result = run_cli("plan", run_file, "--gpus", "2", "--gpu-memory", "16", "--resume", checkpoint)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith(f"resume: {checkpoint} (step 2): conversion: FSDP2 full dp 2 → "), line
    assert "converted once into its universal form before the ranks start, about" in line
    dry = run_cli(
        "train", run_file, "--cpu", "--gpus", "2", "--zero", "3", "--resume", checkpoint,
        "-o", tmp_path / "run", "--dry-run",
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    notes = [
        line for line in dry.stdout.splitlines() if line.startswith("resume note: conversion:")
    ]
    assert len(notes) == 1 and "FSDP2 full dp 2 → ZeRO-3 dp 2 (another engine)" in notes[0]
    # an FSDP layout loads it as it is (torch.distributed.checkpoint re-shards as it loads)
    same = run_cli(
        "train", run_file, "--cpu", "--gpus", "1", "--fsdp", "full", "--resume", checkpoint,
        "-o", tmp_path / "run-fsdp", "--dry-run",
    )  # fmt: skip
    assert same.returncode == 0 and "resume note: conversion" not in same.stdout, same.stdout


def test_a_resume_that_cannot_hold_the_state_is_refused_with_the_numbers(
    tmp_path, checkpoints, monkeypatch
):
    import shutil

    from dplaunch.config.schema import RunConfig
    from dplaunch.errors import UserError
    from dplaunch.launching import devices, resume

    checkpoint, size = checkpoints["large"]
    config = RunConfig.model_validate(yaml.safe_load((checkpoint / "run.yaml").read_text()))
    zero3 = plan_for(2, cpu=True, zero_stage=3, global_batch_size=8, micro_batch_size=2)
    # a conversion the run directory's disk has no room for
    monkeypatch.setattr(
        shutil, "disk_usage", lambda _path: SimpleNamespace(total=0, used=0, free=size // 2)
    )
    refused = r"^--resume: converting .* needs about 0\.4 GB free in .*, which has 0\.2 GB"
    with pytest.raises(UserError, match=refused):
        resume.plan_resume(tmp_path / "run", str(checkpoint), config, zero3)
    monkeypatch.undo()
    # GPUs (faked: 0.4 GiB each) that cannot hold the weights, gradients and Adam state (16
    # bytes a parameter) under DDP
    monkeypatch.setattr(devices, "smallest_gpu_memory_gb", lambda *_: 0.4)
    ddp_on_gpus = plan_for(2, visible=2, global_batch_size=8, micro_batch_size=2)
    refused = r"^launch\.gpus: the checkpoint's state .* takes 0\.5 GiB per GPU under DDP dp 2, "
    with pytest.raises(UserError, match=refused + r"more than a GPU's 0\.4 GiB"):
        resume.plan_resume(tmp_path / "run", str(checkpoint), config, ddp_on_gpus)
    # ZeRO-3 shares it over the 2 GPUs: they hold it
    zero3_on_gpus = plan_for(2, visible=2, zero_stage=3, global_batch_size=8, micro_batch_size=2)
    assert resume.plan_resume(
        tmp_path / "run", str(checkpoint), config, zero3_on_gpus
    ).point.convert


def test_adam_step_counters_are_loaded_where_each_optimizer_keeps_them():
    # a GPU branch, faked: fused (or capturable) torch Adam keeps its step on the parameter's
    # device, the plain one on the CPU, DeepSpeed's CPU Adam as an int for its kernel
    import torch

    from dplaunch.train.universal_load import _new_step

    step = torch.tensor(7.0)
    fused = SimpleNamespace(param_groups=[{"fused": True}])
    plain = SimpleNamespace(param_groups=[{"fused": False, "capturable": False}])
    assert _new_step(fused, step, torch.device("meta")).device.type == "meta"
    assert _new_step(plain, step, torch.device("meta")).device.type == "cpu"
    cpu_adam = type("DeepSpeedCPUAdam", (), {"param_groups": [{}]})()
    assert _new_step(cpu_adam, step, "cpu") == 7 and isinstance(
        _new_step(cpu_adam, step, "cpu"), int
    )
