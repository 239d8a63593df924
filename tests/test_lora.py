"""LoRA and QLoRA training on real CPU ranks: the adapters alone train, the same on every layout;
checkpoints hold only them and resume exactly; the exports (a PEFT folder, the merged model) are
the trained model, under ZeRO-3 too (no empty adapter)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.helpers import (  # noqa: E402
    TINY_LLAMA,
    max_relative_gap,
    read_metrics,
    run_dplaunch,
    train,
    train_losses,
    write_config,
)

STEPS = ("--max-steps", "4", "--set", "train.eval_every=4")


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
    """The tiny Llama with rank-4 adapters on every linear layer and a trained head of its own."""
    folder = tmp_path_factory.mktemp("lora")
    return write_config(folder / "lora.yaml", TINY_LLAMA, model={"lora": {"r": 4, "dropout": 0.0}})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_file) -> dict[str, Path]:
    """One run per layout, each launched once: DDP on 1 (checkpoints every 2 steps) and 2 ranks,
    ZeRO-1, ZeRO-2, ZeRO-3 (checkpoints its last step) and FSDP (checkpoints every 2 steps) on 2;
    DDP on 1 and FSDP on 2 resumed from their run's step 2 in a run directory of their own."""
    folder = tmp_path_factory.mktemp("lora-runs")
    layouts = {
        "ddp1": ("--gpus", "1", "--set", "train.checkpoint_every=2"),
        "ddp2": ("--gpus", "2"),
        "zero1": ("--gpus", "2", "--zero", "1"),
        "zero2": ("--gpus", "2", "--zero", "2"),
        "zero3": ("--gpus", "2", "--zero", "3", "--set", "train.checkpoint_every=4"),
        "fsdp": ("--gpus", "2", "--fsdp", "full", "--set", "train.checkpoint_every=2"),
    }
    runs = {}
    for name, flags in layouts.items():
        runs[name] = folder / name
        train(runs[name], "--cpu", *flags, *STEPS, config=run_file)
    for name in ("ddp1", "fsdp"):
        step_2 = runs[name] / "checkpoints" / "step-2"
        runs[f"{name}_resumed"] = folder / f"{name}_resumed"
        train(runs[f"{name}_resumed"], "--cpu", *layouts[name], *STEPS, "--resume", step_2,
              config=run_file)  # fmt: skip
    return runs


def _config(run: Path):
    from dplaunch.config.schema import RunConfig

    return RunConfig.model_validate(yaml.safe_load((run / "run.yaml").read_text()))


def _eval_loss(model, run: Path) -> float:
    """The evaluation loss of MODEL on RUN's evaluation set, summed as the ranks sum it."""
    from dplaunch.train.data import Batcher, Sharding, for_evaluation, load_splits, tokenize
    from dplaunch.train.engines import loss_sums
    from dplaunch.train.modeling import load_tokenizer

    config = _config(run)
    task = config.model.task
    tokenizer = load_tokenizer(config.model)
    _, raw = load_splits(config.data, config.train.seed)
    dataset = tokenize(raw, tokenizer, for_evaluation(config.data, task), task)
    batcher = Batcher(
        dataset, Sharding(0, 1, 4, 1), pad_id=tokenizer.pad_token_id, task=task, seed=0
    )
    total, count = 0.0, 0.0
    with torch.no_grad():
        for batch, real in batcher.eval_micro_batches(4):
            losses, counts, _ = loss_sums(model(**batch).logits, batch["labels"], task)
            total += float(losses[:real].sum())
            count += float(counts[:real].sum())
    return total / count


def _check_the_exports(run: Path) -> None:
    """RUN/adapter on its base (PeftModel) and RUN/model (merged) give the same logits, and both
    the in-training model's last evaluation loss."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = run / "adapter"
    settings = json.loads((adapter / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(settings["base_model_name_or_path"])
    with_adapter = PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(run / "model")).eval()
    inputs = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            merged(inputs).logits, with_adapter(inputs).logits, rtol=0, atol=1e-5
        )
    (last_eval,) = [r["eval_loss"] for r in read_metrics(run) if r["type"] == "eval"][-1:]
    for model in (merged, with_adapter):
        assert math.isclose(_eval_loss(model, run), last_eval, rel_tol=1e-5)


def test_lora_trains_the_same_on_one_and_two_ranks_and_under_zero_1_2_and_3(runs):
    from dplaunch.train.modeling import load_model, load_tokenizer

    losses = {name: train_losses(run) for name, run in runs.items()}
    assert len(losses["ddp1"]) == 4 and losses["ddp1"][-1] < losses["ddp1"][0]
    assert max_relative_gap(losses["ddp2"], losses["ddp1"]) < 1e-5, losses
    for zero in ("zero1", "zero2", "zero3"):
        assert max_relative_gap(losses[zero], losses["ddp2"]) < 1e-5, (zero, losses)
    # the header counts the whole model, base and adapters, on every layout (ZeRO-3 partitions in
    # full); of those only the adapters and the head's copy train
    config = _config(runs["ddp2"])
    model = load_model(config.model, load_tokenizer(config.model), config.train.seed)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for name in ("ddp1", "ddp2", "zero1", "zero2", "zero3", "fsdp"):
        assert read_metrics(runs[name])[0]["parameters"] == total, name
    assert 0 < trained < total / 4, (trained, total)


def test_lora_resumed_at_step_2_continues_with_bit_identical_losses(runs):
    assert train_losses(runs["ddp1_resumed"]) == train_losses(runs["ddp1"])[2:]


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    from safetensors.torch import load_file

    from dplaunch.train.modeling import load_model, load_tokenizer

    config = _config(runs["ddp1"])
    base = load_model(
        config.model.model_copy(update={"lora": None}), load_tokenizer(config.model), 7
    )
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    step = runs["ddp1"] / "checkpoints" / "step-2"
    weights = load_file(str(step / "model.safetensors"))
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights)
    tensors = [path for path in step.iterdir() if path.suffix in (".safetensors", ".bin", ".pt")]
    held = sum(path.stat().st_size for path in tensors)
    # weights + Adam's two moments of rank-4 adapters; a full checkpoint would be 3 × base_bytes
    assert held < base_bytes / 2, (held, base_bytes, [p.name for p in tensors])
    # ZeRO-3: DeepSpeed's files hold no frozen base weight either
    zero3 = runs["zero3"] / "checkpoints" / "step-4" / "pytorch_model"
    assert sum(path.stat().st_size for path in zero3.iterdir()) < base_bytes


def test_the_zero3_adapter_holds_the_trained_values_and_the_exports_are_the_trained_model(
    runs, tmp_path
):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    run = runs["zero3"]
    adapter = run / "adapter"
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == 4 and settings["lora_alpha"] == 8
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    # the checkpoint of the last step: every rank's fp32 partitions joined
    gathered = get_fp32_state_dict_from_zero_checkpoint(
        str(run / "checkpoints" / "step-4"), tag="pytorch_model"
    )
    assert len(saved) == len(gathered) == 4 * 7 * 2
    for name, value in gathered.items():
        key = name.replace(".default.", ".")
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=name)
    # lora_B starts at zero: trained, it is not (the empty-adapter bug saved zeros or nothing)
    assert all(saved[k].abs().max() > 0 for k in saved if ".lora_B." in k)

    # the base of a random-init run is exported with the adapter, which names it
    assert settings["base_model_name_or_path"] == str((adapter / "base").resolve())
    _check_the_exports(run)

    # `dplaunch export --adapter` of the same checkpoint: the same adapter (the merged model is
    # written by the same code as at the end of training)
    exported = tmp_path / "exported"
    result = run_dplaunch("export", run, "--out", exported / "adapter", "--adapter")
    assert result.returncode == 0, result.stderr[-3000:]
    again = load_file(str(exported / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == saved.keys()
    for key in saved:
        torch.testing.assert_close(again[key], saved[key], rtol=0, atol=0, msg=key)


def test_lora_under_fsdp_trains_like_ddp_resumes_exactly_and_exports_ddps_adapter(runs, tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    run = runs["fsdp"]
    losses = train_losses(run)
    assert len(losses) == 4 and max_relative_gap(losses, train_losses(runs["ddp2"])) < 1e-5
    # resumed from step 2's shards: steps 3 and 4 exactly as the uninterrupted run's
    assert train_losses(runs["fsdp_resumed"]) == losses[2:]
    # the DCP checkpoint holds the adapters and their optimizer state only
    metadata = dcp.FileSystemReader(str(run / "checkpoints" / "step-2" / "fsdp")).read_metadata()
    weights = [key for key in metadata.state_dict_metadata if key.startswith("model.")]
    assert len(weights) == 4 * 7 * 2 and all(".lora_" in key for key in weights), weights[:4]

    # the exported adapter: DDP's (gathered from the shards), on its base with PeftModel
    adapter = run / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    reference = load_file(str(runs["ddp2"] / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == reference.keys() and len(saved) == 4 * 7 * 2
    for key in saved:
        torch.testing.assert_close(saved[key], reference[key], rtol=0, atol=1e-5, msg=key)
    assert all(saved[k].abs().max() > 0 for k in saved if ".lora_B." in k)
    _check_the_exports(run)

    # `dplaunch export --adapter` of the FSDP checkpoint (DCP read in one process): the same
    result = run_dplaunch(
        "export", run / "checkpoints" / "step-4", "--out", tmp_path / "adapter", "--adapter"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    again = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == saved.keys()
    for key in saved:
        torch.testing.assert_close(again[key], saved[key], rtol=0, atol=0, msg=key)


def test_qlora_trains_a_4bit_base_on_cpu_ranks_and_its_adapter_loads_on_the_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dplaunch.config.schema import RunConfig
    from dplaunch.train.modeling import load_model, load_tokenizer

    spec = RunConfig.model_validate(yaml.safe_load(TINY_LLAMA.read_text())).model
    base = tmp_path / "base-model"
    tokenizer = load_tokenizer(spec)
    load_model(spec, tokenizer, seed=3).save_pretrained(base)
    tokenizer.save_pretrained(base)
    lora = {"r": 4, "quantize": "4bit"}
    run_file = write_config(
        tmp_path / "qlora.yaml",
        model={"config": None, "name_or_path": str(base), "tokenizer": str(base), "lora": lora},
        train={"lr": 1.0e-2, "warmup_steps": 0},
    )
    run = tmp_path / "run"
    result = train(run, "--cpu", "--gpus", "1", "--max-steps", "4", config=run_file)
    losses = train_losses(run)
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    # under ZeRO-3 as peft builds it there (no device_map, 4-bit weights stored in bf16, which
    # ZeRO-3 partitions and gathers): 2 ranks train what 1 rank does
    zero3 = tmp_path / "zero3"
    train(zero3, "--cpu", "--gpus", "2", "--zero", "3", "--max-steps", "4", config=run_file)
    assert max_relative_gap(train_losses(zero3), losses) < 1e-5
    assert "4bit" in (run / "run.yaml").read_text() and "Traceback" not in result.stderr
    # 4 layers × (q, o: 4·(64+64); k, v: 4·(64+32); gate, up, down: 4·(64+128)) adapters train
    assert "LoRA: 16,384 of " in result.stdout + result.stderr
    settings = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(base)
    assert not (run / "adapter" / "base").exists()  # a pretrained base: named, not copied
    # the adapter on the full-precision base, and the merged model (the adapter merged into it)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    inputs = torch.randint(3, 259, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(inputs).logits, model(inputs).logits, rtol=0, atol=1e-5)


def test_a_classifier_with_lora_trains_its_head_in_full_and_the_adapters_only():
    from dplaunch.config.schema import ModelConfig
    from dplaunch.train.modeling import load_model, load_tokenizer

    spec = yaml.safe_load(TINY_LLAMA.read_text())["model"]
    spec.update(task="sequence-classification", num_labels=3, lora={"r": 4})
    config = ModelConfig.model_validate(spec)
    model = load_model(config, load_tokenizer(config), seed=7)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    head = [name for name in trained if ".score." in name]
    assert head and all("modules_to_save" in name for name in head), head
    others = [name for name in trained if name not in head]
    assert others and all(".lora_A." in name or ".lora_B." in name for name in others)
    assert not any("score" in name and "lora" in name for name in trained)  # no adapter on the head
    # the same adapters on every rank: their initialisation is seeded
    again = load_model(config, load_tokenizer(config), seed=7)
    for (name, left), right in zip(model.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(left, right, rtol=0, atol=0, msg=name)


def test_export_adapter_of_a_checkpoint_without_lora_is_refused_in_one_line(runs, tmp_path):
    import shutil

    from dplaunch.run_directory.files import file_record
    from tests.helpers import files_under, refusal_line

    checkpoint = tmp_path / "step-4"
    shutil.copytree(runs["zero3"] / "checkpoints" / "step-4", checkpoint)
    run_file = yaml.safe_load((checkpoint / "run.yaml").read_text())
    del run_file["model"]["lora"]
    (checkpoint / "run.yaml").write_text(yaml.safe_dump(run_file))
    # as a run without LoRA would have recorded it (the export verifies every file first)
    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    meta["files"]["run.yaml"] = file_record(checkpoint / "run.yaml")
    (checkpoint / "checkpoint.json").write_text(json.dumps(meta))
    before = files_under(tmp_path)
    result = run_dplaunch("export", checkpoint, "--out", tmp_path / "out", "--adapter")
    refusal_line(result, "--adapter: ", "has no model.lora", "drop --adapter")
    assert files_under(tmp_path) == before


def test_a_zero3_adapter_partitioned_across_ranks_is_saved_whole_and_trained(tmp_path):
    # ZeRO-3 keeps tensors under stage3_param_persistence_threshold whole on every rank; an
    # adapter above it is split across the ranks, where a rank's own copy is an empty partition
    # (the empty-adapter bug saves that). down_proj's lora_A here: 100 × 1024 elements
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    model = yaml.safe_load(TINY_LLAMA.read_text())["model"]
    model["config"].update(hidden_size=128, intermediate_size=1024, num_hidden_layers=2)
    model["lora"] = {"r": 100, "target_modules": ["down_proj"]}
    # no evaluation: a forward just before the export would leave the partitions gathered
    run_file = write_config(tmp_path / "wide.yaml", model=model, data={"eval_fraction": None})
    run = tmp_path / "run"
    flags = ("--cpu", "--gpus", "2", "--zero", "3", "--max-steps", "2")
    train(run, *flags, "--set", "train.checkpoint_every=2", config=run_file)
    threshold = json.loads((run / "deepspeed.json").read_text())["zero_optimization"][
        "stage3_param_persistence_threshold"
    ]
    saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    gathered = get_fp32_state_dict_from_zero_checkpoint(
        str(run / "checkpoints" / "step-2"), tag="pytorch_model"
    )
    assert len(saved) == len(gathered) == 2 * 2
    for name, value in gathered.items():
        key = name.replace(".default.", ".")
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=name)
    lora_a = [value for key, value in saved.items() if ".lora_A." in key]
    assert all(value.numel() > threshold for value in lora_a)  # partitioned in training
    assert all(value.abs().max() > 0 for key, value in saved.items() if ".lora_B." in key)


def test_an_fsdp_lora_export_gathers_the_adapters_only(monkeypatch):
    # the frozen base gathered whole in fp32 on rank 0 would not fit its host for a 70B model
    import torch.distributed.checkpoint.state_dict as dcp_state

    from dplaunch.config.schema import RunConfig
    from tests.helpers import one_rank_fsdp_engine

    spec = yaml.safe_load(TINY_LLAMA.read_text())
    spec["model"]["lora"] = {"r": 4}
    gathered: list[int] = []
    gather = dcp_state.get_model_state_dict

    def counted(model, **kwargs):
        state = gather(model, **kwargs)
        gathered.extend(value.numel() for value in state.values())
        return state

    with one_rank_fsdp_engine(RunConfig.model_validate(spec)) as engine:
        trained = {n: p.numel() for n, p in engine.model.named_parameters() if p.requires_grad}
        monkeypatch.setattr(dcp_state, "get_model_state_dict", counted)
        state = engine.trained_state()
    assert state.keys() == trained.keys()
    assert sum(gathered) == sum(trained.values())  # before: every weight of the model


def test_a_zero3_lora_export_gathers_the_adapters_only():
    # DeepSpeed's consolidated 16-bit state dict of the whole model (frozen base too) on rank 0
    # before; now it is asked to leave out what does not train (a spy on the engine's gather)
    from types import SimpleNamespace

    from dplaunch.train.engines import AccelerateEngine

    asked = []
    weight, adapter = torch.zeros(2, 2), torch.ones(2, 2, requires_grad=True)

    class ZeroThreeEngine:  # the DeepSpeed engine Accelerate hands back, as far as this needs
        def zero_optimization_partition_weights(self):
            return True

        def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
            asked.append(exclude_frozen_parameters)
            return {"lora_A.weight": adapter.detach()}

    unwrapped = SimpleNamespace(named_parameters=lambda: [("base.weight", weight),
                                                         ("lora_A.weight", adapter)])  # fmt: skip
    engine = AccelerateEngine.__new__(AccelerateEngine)
    engine.uses_deepspeed, engine.model = True, ZeroThreeEngine()
    engine.accelerator = SimpleNamespace(
        is_main_process=True, unwrap_model=lambda model, **_: unwrapped, get_state_dict=None
    )
    assert engine.trained_state().keys() == {"lora_A.weight"} and asked == [True]


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory) -> Path:
    """The tiny Llama saved as a pretrained checkpoint in bf16 (config.json says so)."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.train.modeling import load_model, load_tokenizer

    spec = RunConfig.model_validate(yaml.safe_load(TINY_LLAMA.read_text())).model
    base = tmp_path_factory.mktemp("bf16-base")
    tokenizer = load_tokenizer(spec)
    load_model(spec, tokenizer, seed=3).to(torch.bfloat16).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


def _export_at_the_end(base: Path, run_dir: Path, lora: dict, mixed_precision: str) -> None:
    """export_run as the end of training calls it, the trained state that of adapters with
    lora_B set away from its zero start (an engine that hands it over, on one process)."""
    from types import SimpleNamespace

    from dplaunch.config.schema import RunConfig
    from dplaunch.train.lora_export import export_run
    from dplaunch.train.modeling import load_model, load_tokenizer

    spec = yaml.safe_load(TINY_LLAMA.read_text())
    spec["model"] = {"name_or_path": str(base), "tokenizer": str(base), "lora": lora}
    spec["train"]["mixed_precision"] = mixed_precision
    config = RunConfig.model_validate(spec)
    tokenizer = load_tokenizer(config.model)
    unquantized = config.model.lora.model_copy(update={"quantize": None})
    trained = load_model(config.model.model_copy(update={"lora": unquantized}), tokenizer, seed=3)
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, parameter in trained.named_parameters():
        if parameter.requires_grad:
            state[name] = torch.randn(parameter.shape, generator=generator) * 0.05
    engine = SimpleNamespace(
        trained_state=lambda: state, accelerator=SimpleNamespace(wait_for_everyone=lambda: None)
    )
    export_run(engine, config, tokenizer, run_dir)


@pytest.mark.parametrize(
    ("lora", "mixed_precision", "dtype"),
    [
        ({"r": 4, "quantize": "4bit"}, "no", torch.bfloat16),  # QLoRA: the checkpoint's dtype
        ({"r": 4}, "bf16", torch.bfloat16),  # mixed precision: its 16-bit dtype
        ({"r": 4}, "no", torch.float32),  # an fp32 run trained its base in fp32
    ],
)
def test_the_merged_export_builds_the_base_in_the_dtype_it_trained_in(
    bf16_base, tmp_path, lora, mixed_precision, dtype
):
    # a 70B QLoRA base rebuilt in fp32 on rank 0 was 280 GB of host RAM; in bf16 it is half that
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _export_at_the_end(bf16_base, tmp_path, lora, mixed_precision)
    weights = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert {value.dtype for value in weights.values()} == {dtype}
    # the merged model loads with from_pretrained, the adapter on its base with PeftModel
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(bf16_base, dtype=dtype)
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    inputs = torch.randint(3, 259, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(inputs).logits.float()
        # merging rounds each merged weight to the base's dtype once
        torch.testing.assert_close(merged(inputs).logits, expected, rtol=0, atol=0.05)


def test_an_adapter_only_export_writes_the_adapter_without_building_the_base(
    bf16_base, tmp_path, monkeypatch
):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import dplaunch.train.lora_export as lora_export

    _export_at_the_end(bf16_base, tmp_path / "merged", {"r": 4}, "no")

    def no_base(*args, **kwargs):
        raise AssertionError("the adapter-only export built the base")

    monkeypatch.setattr(lora_export, "load_model", no_base)
    run = tmp_path / "adapter-only"
    _export_at_the_end(bf16_base, run, {"r": 4, "export": "adapter-only"}, "no")
    assert not (run / "model").exists()
    # the same adapter as the merged export's, which names the base it loads on
    saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    reference = load_file(str(tmp_path / "merged" / "adapter" / "adapter_model.safetensors"))
    assert saved.keys() == reference.keys() and len(saved) == 4 * 7 * 2
    for key in saved:
        torch.testing.assert_close(saved[key], reference[key], rtol=0, atol=0, msg=key)
    settings = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(bf16_base)
    base = AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32)
    PeftModel.from_pretrained(base, run / "adapter")
