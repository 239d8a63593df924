"""Loading the universal form (dplaunch/train/universal.py) into a running engine: every rank takes
its own part of each parameter, one parameter at a time.

- DDP: every rank holds the whole model and the torch optimizer's whole state.
- DeepSpeed (ZeRO-0/1/2/3, offload, AutoTP, the pipeline's stages): through DeepSpeed's own
  tensor-fragment API (deepspeed.utils.safe_set_full_fp32_param / safe_set_full_optimizer_state),
  which writes each rank's fragment of the fp32 master weights and Adam's moments; AutoTP's slice
  of a parameter is cut as the affine map AutoTP recorded for it (deepspeed.checkpoint.affine).
- FSDP2 / HSDP / FSDP × TP: torch.distributed.checkpoint reads each rank's DTensor shards straight
  from the safetensors files (torch's HuggingFaceStorageReader), re-sharding as it loads.

The scheduler's position comes from universal.json; the caller puts the run file's learning-rate
settings back afterwards (train/engines.py's RunFileHyperparameters).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from dplaunch.run_directory.layout import UNIVERSAL_MODEL_DIR, UNIVERSAL_OPTIMIZER_DIR
from dplaunch.train.universal import MOMENTS, STEP, UniversalReader, state_key


def check_names(reader: UniversalReader, names: Iterable[str], where: str) -> None:
    """Refuse a universal checkpoint that does not hold exactly the parameters that train here."""
    held, trained = set(reader.names()), set(names)
    if held != trained:
        missing, unexpected = sorted(trained - held), sorted(held - trained)
        raise ValueError(
            f"{reader.directory} does not fit the model {where} trains (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )


def _step_like(old: Any, step: torch.Tensor, device: Any) -> Any:
    # torch's Adam keeps a float tensor (on the parameter's device when fused or capturable),
    # DeepSpeed's CPU Adam an int
    if isinstance(old, torch.Tensor):
        return step.to(device=old.device, dtype=old.dtype).clone()
    if old is None:
        return step.to(device=device).clone()
    return type(old)(step.item())


# ---------------------------------------------------------------------------------------------
# DDP: whole tensors everywhere


def load_whole(
    reader: UniversalReader, named: list[tuple[str, torch.nn.Parameter]], optimizer: Any
) -> None:
    """NAMED (the trained parameters, whole on this rank) and the torch OPTIMIZER's state."""
    check_names(reader, (name for name, _ in named), "this run")
    fused = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for name, parameter in named:
        with torch.no_grad():
            parameter.copy_(reader.weight(name))
        if not reader.has_state(name):
            continue
        state = {key: reader.state(name, key).to(parameter.device) for key in MOMENTS}
        step = reader.state(name, STEP)
        state[STEP] = step.to(parameter.device if fused else "cpu").clone()
        optimizer.state[parameter] = state


# ---------------------------------------------------------------------------------------------
# DeepSpeed


class TensorParallelSlicer:
    """AutoTP's slice of a whole parameter on this rank, cut as the engine's module records it
    (its universal-checkpoint info: an affine map per split parameter)."""

    def __init__(self, module: Any):
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        info = getattr(module, UNIVERSAL_CHECKPOINT_INFO, None) or {}
        self.maps = (info.get("affine_map") or {}).get("params", {})

    def __call__(self, name: str, whole: torch.Tensor, key: str, shape: Any) -> torch.Tensor:
        if tuple(whole.shape) == tuple(shape):
            return whole
        from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap
        from deepspeed.utils import groups

        entry = self.maps.get(f"^{re.escape(name)}$")
        if entry is None:
            raise ValueError(f"AutoTP recorded no affine map for {name}: cannot cut its slice")
        rank = groups.get_tensor_model_parallel_rank()
        return ParamAffineMap.from_dict(entry).extract(whole, rank, SCALE_POWER_BY_STATE[key])


def _partition_of(whole: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Rank RANK's SIZE elements of WHOLE flattened, zero-padded past its end (ZeRO-3's last
    partitions)."""
    flat = whole.flatten()
    piece = torch.zeros(size, dtype=whole.dtype)
    held = flat[rank * size : (rank + 1) * size]
    piece[: held.numel()] = held
    return piece


def _new_step(optimizer: Any, step: torch.Tensor, device: Any) -> Any:
    """Adam's step counter as OPTIMIZER keeps it: DeepSpeed's CPU Adam an int for its kernel,
    torch's a float tensor, on the parameter's DEVICE only when fused or capturable (as its own
    first step would put it)."""
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":
        return int(step.item())
    groups = optimizer.param_groups
    on_device = any(group.get("fused") or group.get("capturable") for group in groups)
    return step.to(device=device if on_device else "cpu", dtype=torch.float32).clone()


class DeepSpeedParameters:
    """The values of a DeepSpeed engine's parameters, each as this rank holds it: the whole
    parameter, or AutoTP's slice of it (cut as the engine's module records)."""

    def __init__(self, reader: UniversalReader, engine: Any, named: list[tuple[str, Any]]):
        self.reader = reader
        self.names = {id(parameter): name for name, parameter in named}
        self.slicer = TensorParallelSlicer(engine.module)
        self.step: torch.Tensor | None = None

    def name(self, parameter: Any) -> str | None:
        return self.names.get(id(parameter))

    def weight(self, parameter: Any) -> torch.Tensor:
        name = self.names[id(parameter)]
        shape = getattr(parameter, "ds_shape", parameter.shape)
        return self.slicer(name, self.reader.weight(name), "fp32", shape)

    def moments(self, parameter: Any) -> dict[str, torch.Tensor]:
        """Adam's moments of PARAMETER (empty when the source never stepped it)."""
        name = self.names[id(parameter)]
        if not self.reader.has_state(name):
            return {}
        self.step = self.reader.state(name, STEP)
        shape = getattr(parameter, "ds_shape", parameter.shape)
        return {key: self.slicer(name, self.reader.state(name, key), key, shape) for key in MOMENTS}


def _load_zero3(values: DeepSpeedParameters, zero: Any, inner: Any) -> None:
    """ZeRO-3: each rank's partition of every parameter into its flat fp32 sub-groups and Adam's
    state beside them (created here: DeepSpeed creates it at the first step), then the model's
    own partitions from the fp32 ones, as DeepSpeed's universal loader does."""
    for sub, parameters in enumerate(zero.fp16_groups):
        flat = zero.fp32_partitioned_groups_flat[sub]
        moments = {key: torch.zeros_like(flat) for key in MOMENTS}
        stepped = False
        for parameter in parameters:
            if values.name(parameter) is None:
                continue
            _, offset, size = zero.grad_position[zero.get_param_id(parameter)]
            rank = zero._get_param_partition_rank(parameter)
            flat.data.narrow(0, offset, size).copy_(
                _partition_of(values.weight(parameter), size, rank)
            )
            for key, value in values.moments(parameter).items():
                moments[key].narrow(0, offset, size).copy_(_partition_of(value, size, rank))
                stepped = True
        if stepped:
            inner.state[flat] = {**moments, STEP: _new_step(inner, values.step, flat.device)}
    for sub, flat in enumerate(zero.fp32_partitioned_groups_flat):
        if flat.numel():
            zero.fp16_partitioned_groups_flat[sub].data.copy_(flat.data)
        updated = zero.unflatten(
            zero.fp16_partitioned_groups_flat[sub], zero.fp16_partitioned_groups[sub]
        )
        for partitioned, value in zip(zero.fp16_partitioned_groups[sub], updated, strict=True):
            partitioned.data = value.data


def _load_partitioned(
    values: DeepSpeedParameters, inner: Any, groups: list[list[Any]], flats: list[Any]
) -> None:
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer): the whole parameter on every rank, and this
    rank's fragment of its fp32 master weight and of Adam's state in the flat partition of its
    group (where DeepSpeed's tensor-fragment mapping says it lies)."""
    for parameters, flat in zip(groups, flats, strict=True):
        moments = {key: torch.zeros_like(flat) for key in MOMENTS}
        stepped = False
        for parameter in parameters:
            if values.name(parameter) is None:
                continue
            whole = values.weight(parameter)
            with torch.no_grad():
                parameter.data.copy_(whole.to(parameter.dtype))
            mapping = parameter._hp_mapping
            state = values.moments(parameter)
            if mapping is None:
                continue  # no fragment of it in this rank's partition
            lp, hp = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
            mapping.hp_fragment.data.copy_(whole.flatten().narrow(0, lp.start, lp.numel))
            for key, value in state.items():
                fragment = value.flatten().narrow(0, lp.start, lp.numel)
                moments[key].narrow(0, hp.start, hp.numel).copy_(fragment)
                stepped = True
        if stepped:
            inner.state[flat] = {**moments, STEP: _new_step(inner, values.step, flat.device)}


def load_deepspeed(
    reader: UniversalReader,
    engine: Any,
    named: list[tuple[str, torch.nn.Parameter]],
    global_step: int,
    *,
    whole_model: bool = True,
) -> None:
    """The DeepSpeed ENGINE's parameters NAMED (its module's trained ones, by the model's names;
    a pipeline stage's own: not the WHOLE_MODEL) and their optimizer state, at any ZeRO stage,
    offloaded or not; GLOBAL_STEP: the optimizer steps taken (the engine's own counters)."""
    if whole_model:
        check_names(reader, (name for name, _ in named), "this run")
    zero = engine.optimizer
    inner = _torch_optimizer(zero)
    values = DeepSpeedParameters(reader, engine, named)
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        _load_zero3(values, zero, inner)
    elif hasattr(zero, "single_partition_of_fp32_groups"):
        _load_partitioned(values, inner, zero.bit16_groups, zero.single_partition_of_fp32_groups)
    elif hasattr(zero, "fp32_groups_flat_partition"):
        _load_partitioned(values, inner, zero.bf16_groups, zero.fp32_groups_flat_partition)
    else:
        # no ZeRO optimizer: the torch optimizer holds each parameter's state itself
        for _, parameter in named:
            whole = values.weight(parameter)
            with torch.no_grad():
                parameter.data.copy_(whole.to(parameter.dtype))
            state = values.moments(parameter)
            if state:
                device = parameter.device
                state = {key: value.to(device) for key, value in state.items()}
                inner.state[parameter] = {**state, STEP: _new_step(inner, values.step, device)}
    engine.global_steps = global_step
    engine.global_samples = global_step * engine.train_batch_size()


def _torch_optimizer(optimizer: Any) -> Any:
    # Accelerate's wrapper → (DeepSpeed's ZeRO optimizer →) the torch optimizer that really steps
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


# ---------------------------------------------------------------------------------------------
# FSDP2


def load_sharded(reader: UniversalReader, model: Any, optimizer: Any, lora: bool) -> None:
    """FSDP2's DTensor parameters (only what trains, under LoRA) and the OPTIMIZER's state: every
    rank reads only its shards of each tensor through torch.distributed.checkpoint (collective),
    straight from the safetensors files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from dplaunch.train.lora import trained_state

    model_state = get_model_state_dict(model)
    if lora:
        model_state = trained_state(model_state, model)
    check_names(reader, model_state, "this run")
    dcp.load(
        model_state,
        storage_reader=HuggingFaceStorageReader(str(reader.directory / UNIVERSAL_MODEL_DIR)),
    )
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=not lora))
    # a fresh optimizer's state is created (as by a step of zeros) and then filled in place
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    moments = {}
    for name, own in optimizer_state["state"].items():
        if reader.has_state(name):
            moments.update({state_key(name, key): own[key] for key in MOMENTS})
            own[STEP] = _step_like(own.get(STEP), reader.state(name, STEP), "cpu")
    dcp.load(
        moments,
        storage_reader=HuggingFaceStorageReader(str(reader.directory / UNIVERSAL_OPTIMIZER_DIR)),
    )
    set_optimizer_state_dict(model, optimizer, optimizer_state)


def load_scheduler(reader: UniversalReader, scheduler: Any) -> None:
    """The scheduler's position (its state_dict) as the source saved it."""
    state = reader.scheduler_state()
    if state is None:
        return
    # a per-group entry (lr_lambdas, base_lrs, _last_lr) of a source whose optimizer had other
    # groups (DeepSpeed drops a LoRA run's empty no-decay group) keeps this one's: the position
    # is what carries over, and the run file's settings are put back afterwards
    own = scheduler.state_dict()
    groups = len(own.get("base_lrs", ()))
    state = {
        key: own[key] if key in own and isinstance(value, list) and len(value) != groups else value
        for key, value in state.items()
    }
    scheduler.load_state_dict(state)
