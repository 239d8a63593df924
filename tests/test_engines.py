"""The step engines' own decisions, unit-tested in one process with the settings of GPU plans."""

from __future__ import annotations

import json
import types
import typing

import pytest
import torch

from dplaunch.config.schema import Scheduler
from dplaunch.train.engines import _settle_step_counters, build_optimizer
from tests.helpers import one_rank_script

TRAIN = types.SimpleNamespace(lr=1e-3, weight_decay=0.1)
GPU_PLAN = types.SimpleNamespace(offload="none", target="gpu")
CPU_PLAN = types.SimpleNamespace(offload="none", target="cpu")


def _model(device: str) -> torch.nn.Module:
    # a weight (decayed group) and a bias (no-decay group): two parameter groups, as in a real run
    return torch.nn.Linear(4, 3, device=device)


def _load_like_deepspeed_universal(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    # what DeepSpeed's ZeRO-3 universal loader (0.19) leaves: the saved step, read on the CPU
    # (ds_to_universal maps there), one tensor shared by every parameter's state
    shared = torch.tensor(4.0)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            optimizer.state[parameter]["step"] = shared
    return shared


def test_a_gpu_plans_fused_adamw_gets_its_resumed_step_counters_on_its_parameters_device():
    # the CPU has no second device: parameters on "meta" stand in for a GPU's. Fused AdamW steps
    # only with `step` on its parameter's device (pytorch#104767), where torch's own
    # load_state_dict puts it; the universal loader leaves it on the CPU
    optimizer = build_optimizer(_model("meta"), TRAIN, GPU_PLAN)
    assert all(group["fused"] for group in optimizer.param_groups)
    shared = _load_like_deepspeed_universal(optimizer)
    _settle_step_counters(optimizer)
    steps = [state["step"] for state in optimizer.state.values()]
    assert len(steps) == 2
    assert all(step.device.type == "meta" and step.dtype == torch.float32 for step in steps)
    assert steps[0] is not steps[1] and all(step is not shared for step in steps)

    # the placement torch's load_state_dict gives the same optimizer
    reference = build_optimizer(_model("meta"), TRAIN, GPU_PLAN)
    saved = {
        "state": {index: {"step": torch.tensor(4.0)} for index in range(2)},
        "param_groups": reference.state_dict()["param_groups"],
    }
    reference.load_state_dict(saved)
    assert [s["step"].device for s in reference.state.values()] == [s.device for s in steps]


def test_resumed_step_counters_are_unshared_and_keep_their_value():
    # fused AdamW steps on CPU parameters too: a shared counter would advance once per group
    model = _model("cpu")
    for fused_plan in (GPU_PLAN, CPU_PLAN):
        optimizer = build_optimizer(model, TRAIN, fused_plan)
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        _load_like_deepspeed_universal(optimizer)
        _settle_step_counters(optimizer)
        optimizer.step()
        steps = [float(state["step"]) for state in optimizer.state.values()]
        devices = {state["step"].device.type for state in optimizer.state.values()}
        assert steps == [5.0, 5.0] and devices == {"cpu"}, (fused_plan, steps)


ENGINE_DTYPES = """
import json, os, sys, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                          deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=json.loads(sys.argv[2])))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
engine, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
inner = engine.optimizer  # ZeRO's optimizer (ZeRO-1 in bf16: DeepSpeed's BF16_Optimizer)
accumulation = getattr(inner, "gradient_accumulation_dtype", None) or inner.grad_acc_dtype
print(json.dumps({"optimizer": type(inner).__name__, "accumulation": str(accumulation),
                  "reduction": str(engine.communication_data_type)}))
"""


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_accumulates_and_reduces_a_bf16_plans_gradients_in_fp32(stage):
    # the deepspeed.json of an 8-GPU bf16 plan, run by one CPU rank (only the batch trio changes)
    from dplaunch.launching.ports import free_port
    from dplaunch.rendering.deepspeed_config import deepspeed_config_dict
    from tests.helpers import plan_for

    plan = plan_for(gpus=8, visible=8, zero_stage=stage, mixed_precision="bf16")
    config = deepspeed_config_dict(plan, max_grad_norm=1.0)
    config.update(
        train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1
    )
    engine = one_rank_script(ENGINE_DTYPES, str(free_port()), json.dumps(config))
    assert (engine["accumulation"], engine["reduction"]) == ("torch.float32",) * 2, engine


class _ScaledLinear(torch.nn.Module):
    """A model with the HF output the engine reads: .loss, multiplied by the batch's factor."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, inputs, factor):
        return types.SimpleNamespace(loss=self.linear(inputs).sum() * factor)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_an_fp16_step_skipped_on_overflow_does_not_move_the_learning_rate_schedule(fused):
    # DDP in fp16 steps through torch's GradScaler, which Accelerate builds only on GPUs; here one
    # for the CPU. A fused AdamW is always called by GradScaler and skips inside its kernel
    from accelerate import Accelerator
    from transformers import get_scheduler

    from dplaunch.train.engines import AccelerateEngine

    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model = _ScaledLinear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = get_scheduler("linear", optimizer.optimizer, 2, 10)
    engine = AccelerateEngine(
        accelerator, model, optimizer, scheduler, 1.0, "sequence-classification"
    )

    def step(factor: float) -> None:
        engine.train_step([{"inputs": torch.ones(3, 4), "factor": torch.tensor(factor)}])

    step(1.0)
    assert scheduler.last_epoch == 1
    weights = model.linear.weight.detach().clone()
    step(float("inf"))  # an overflow: no update, the same learning rate next step
    assert torch.equal(model.linear.weight, weights)
    assert scheduler.last_epoch == 1 and accelerator.scaler.get_scale() == 2.0**7
    step(1.0)
    assert scheduler.last_epoch == 2 and not torch.equal(model.linear.weight, weights)


class _CudaMemory:
    """torch.cuda's memory readers as a GPU with 80 GB would answer them (bytes)."""

    def max_memory_allocated(self, device):
        return 61_234_000_000

    def max_memory_reserved(self, device):
        return 70_500_000_000

    def mem_get_info(self, device):
        return 8_250_000_000, 80_000_000_000


def test_a_gpu_rank_logs_reserved_and_free_memory_beside_the_peak_of_its_tensors():
    from dplaunch.train.metrics import memory_fields

    assert memory_fields(torch.device("cuda", 3), cuda=_CudaMemory()) == {
        "memory_gb": 61.234,
        "memory_reserved_gb": 70.5,
        "memory_free_gb": 8.25,
        "memory_total_gb": 80.0,
    }
    # CPU ranks keep one field: the process's peak resident memory
    cpu = memory_fields(torch.device("cpu"))
    assert list(cpu) == ["memory_gb"] and 0 < cpu["memory_gb"] < 1000


@pytest.mark.parametrize("name", typing.get_args(Scheduler))
def test_every_learning_rate_schedule_is_bit_identical_to_transformers_get_scheduler(name):
    # dplaunch builds the curves itself (train/schedules.py: transformers' module imports peft and
    # bitsandbytes on every rank); warm-up, decay, the last step, past the end, and a state_dict
    # saved by one loads into the other
    from transformers import get_scheduler

    from dplaunch.train.schedules import learning_rate_schedule

    for warmup, total in [(0, 7), (3, 11), (5, 5)]:
        if name == "polynomial" and warmup == total:
            continue  # transformers divides by zero there as well
        theirs_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=3e-4)
        ours_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=3e-4)
        theirs = get_scheduler(
            name, theirs_optimizer, num_warmup_steps=warmup, num_training_steps=total
        )
        ours = learning_rate_schedule(name, ours_optimizer, warmup_steps=warmup, total_steps=total)
        rates = [], []
        for _ in range(total + 3):
            rates[0].append(theirs.get_last_lr()[0])
            rates[1].append(ours.get_last_lr()[0])
            theirs_optimizer.step(), ours_optimizer.step()
            theirs.step(), ours.step()
        assert rates[1] == rates[0], (name, warmup, total)
        assert (
            len(set(rates[0])) > 1
            or name == "constant"
            or (name, warmup) == ("constant_with_warmup", 0)
        )
        resumed = learning_rate_schedule(
            name,
            torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=3e-4),
            warmup_steps=warmup,
            total_steps=total,
        )
        resumed.load_state_dict(theirs.state_dict())
        assert resumed.get_last_lr() == theirs.get_last_lr()
