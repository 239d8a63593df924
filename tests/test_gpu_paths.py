"""The ranks' GPU-only branches, run on this GPU-less machine with the device faked: CUDA's random
generators, the process group a GPU plan asks for, where a quantized base loads. Each test fails
on the code before its fix (GPU readiness, round 2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers import TINY_LLAMA

torch = pytest.importorskip("torch")
from torch.distributed.tensor import DTensor  # noqa: E402


class FakeCuda:
    """torch.cuda on a machine of ``count`` GPUs, this process on GPU ``current``: one real
    generator per GPU (torch's default_generators), CUDA already initialised."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0):
        import torch.cuda.random as cuda_random

        self.generators = tuple(torch.Generator().manual_seed(100 + i) for i in range(count))
        self.current = current
        for module in (torch.cuda, cuda_random):
            monkeypatch.setattr(module, "device_count", lambda: count, raising=False)
            monkeypatch.setattr(module, "current_device", lambda: self.current, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "default_generators", self.generators, raising=False)
        monkeypatch.setattr(cuda_random, "_lazy_init", lambda: None)
        monkeypatch.setattr(cuda_random, "is_initialized", lambda: True)
        # CUDA is up: a state set now goes into its generator at once (and a missing one raises)
        monkeypatch.setattr(cuda_random, "_lazy_call", lambda callback, **_: callback())


@pytest.mark.parametrize(
    "saved_on,resumed_on",
    [
        ((4, 0), (1, 0)),  # rank 0 of a 4-GPU FSDP run, resumed on 1 GPU
        ((4, 2), (2, 1)),  # rank 2 on cuda:2 of 4, resumed where it runs on cuda:1 of 2
    ],
)
def test_a_rank_restores_its_own_gpus_generator_on_fewer_gpus_than_it_saved_on(
    tmp_path, monkeypatch, saved_on, resumed_on
):
    from dplaunch.train.checkpoint import load_rng_state, save_rng_state

    saving = FakeCuda(monkeypatch, *saved_on)
    own = saving.generators[saving.current]
    own.manual_seed(1234)
    expected = torch.randint(0, 2**30, (4,), generator=own)
    own.manual_seed(1234)
    save_rng_state(tmp_path, rank=2)
    resuming = FakeCuda(monkeypatch, *resumed_on)
    others = [g.get_state() for i, g in enumerate(resuming.generators) if i != resuming.current]
    load_rng_state(tmp_path, rank=2)  # before: one state per saved GPU, IndexError past cuda:0
    restored = resuming.generators[resuming.current]
    assert torch.equal(torch.randint(0, 2**30, (4,), generator=restored), expected)
    left = [g.get_state() for i, g in enumerate(resuming.generators) if i != resuming.current]
    assert all(torch.equal(a, b) for a, b in zip(left, others, strict=True))


def _gpu_plan(**parallel):
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.plan import Machine, make_plan

    return make_plan(LaunchConfig(gpus=2), ParallelConfig(**parallel), TrainConfig(),
                     Machine(render_only=True))  # fmt: skip


def test_the_ranks_of_an_fsdp_offload_plan_make_their_group_with_gloo_beside_nccl(monkeypatch):
    import accelerate
    import torch.distributed as dist

    from dplaunch.config.schema import RunConfig
    from dplaunch.train import fsdp
    from dplaunch.train.loop import make_accelerator

    made: list[str] = []

    class Recorder:  # what the ranks hand Accelerate
        def __init__(self, kwargs_handlers, **_):
            made.extend(h.backend for h in kwargs_handlers if hasattr(h, "backend"))

    monkeypatch.setattr(accelerate, "Accelerator", Recorder)
    plan = _gpu_plan(fsdp="full", offload="all")
    config = RunConfig.model_validate(yaml.safe_load(TINY_LLAMA.read_text()))
    make_accelerator(plan, config, Path("unused"))
    # one rank alone: the FSDP engine makes the group of one itself
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: made.append(backend))
    fsdp._ensure_process_group(plan)
    assert made == ["cuda:nccl,cpu:gloo", "cuda:nccl,cpu:gloo"]


def test_a_quantized_base_loads_on_the_plans_device_and_under_zero3_without_a_device_map(
    monkeypatch,
):
    pytest.importorskip("bitsandbytes")
    from transformers.integrations import HfDeepSpeedConfig

    from dplaunch.config.schema import LoraConfig
    from dplaunch.train.lora import quantization_options

    qlora = LoraConfig(r=4, quantize="4bit")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert quantization_options(qlora, on_gpu=True)["device_map"] == {"": torch.device("cuda", 1)}
    # `--cpu` ranks on a GPU machine keep the base on the CPU they compute on
    assert quantization_options(qlora, on_gpu=False)["device_map"] == {"": "cpu"}
    # ZeRO-3 registered (as Accelerate does before the model is built): transformers refuses
    # any device_map ("DeepSpeed Zero-3 is not compatible with passing a device_map"), and
    # ZeRO-3 partitions the 4-bit weights stored in the compute dtype
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 2})
    options = quantization_options(qlora, on_gpu=True)
    assert "device_map" not in options
    config = options["quantization_config"]
    assert config.bnb_4bit_quant_storage == config.bnb_4bit_compute_dtype == torch.bfloat16
    del zero3


def test_the_fsdp_reference_is_sharded_block_by_block_never_moved_whole_to_the_device(
    monkeypatch, tmp_path
):
    # model.to(device) before fully_shard put the whole fp32 reference on every GPU (4 bytes a
    # parameter, offload: all too) while the plan counts it sharded: a 70 B DPO run went out of
    # memory on any GPU. fully_shard moves each block's parameters itself, as the policy's
    from torch.distributed.fsdp import FSDPModule

    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.plan import Machine, make_plan
    from dplaunch.train.modeling import load_model, load_tokenizer
    from dplaunch.train.preference import build_reference, response_logps
    from tests.helpers import REPO, one_rank_fsdp_engine

    run = yaml.safe_load((REPO / "configs" / "dpo.yaml").read_text())
    run["parallel"] = {"fsdp": "full", "offload": "all"}
    config = RunConfig.model_validate(run)
    launch = config.launch.model_copy(update={"cpu": True, "gpus": 1})
    plan = make_plan(launch, config.parallel, config.train, Machine())
    moved: list[str] = []
    real_to = torch.nn.Module.to

    def spy(module, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and not isinstance(module, FSDPModule):
            moved.append(f"{type(module).__name__} to {device}")
        return real_to(module, *args, **kwargs)

    tokenizer = load_tokenizer(config.model)
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    with one_rank_fsdp_engine(config) as engine:
        monkeypatch.setattr(torch.nn.Module, "to", spy)
        reference, described = build_reference(
            config, plan, accelerator, engine, tmp_path, tokenizer
        )
        monkeypatch.undo()
        assert plan.engine == "fsdp" and moved == []
        assert described["kind"] == "a frozen copy, FSDP2 full-sharded as the policy"
        assert all(isinstance(p, DTensor) for p in reference.module.parameters())
        # it computes the starting weights' log-probabilities
        ids = torch.randint(3, 259, (4, 12), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "labels": ids.masked_fill(torch.arange(12) < 6, -100)}  # fmt: skip
        start = load_model(config.model, tokenizer, config.train.seed)
        with torch.no_grad():
            expected = response_logps(start, batch)[0]
        assert torch.allclose(reference.logps(None, batch), expected, atol=1e-5)
