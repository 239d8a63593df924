"""The FSDP2 engine: PyTorch's ``fully_shard`` per decoder block, then the root, over the
data-parallel ranks (parallel.fsdp), behind the loop's StepEngine interface.

`full` shards every parameter over all data-parallel ranks (a 1-D mesh: ZeRO-3's layout);
`hybrid` (HSDP) shards inside a node and replicates across nodes (a 2-D mesh, replicate × shard).
With tp, the decoder's linear layers are first split over the tensor-parallel ranks as the
model's Hugging Face ``tp_plan`` says (DTensor), then sharded over a (shard × tp) mesh.
Accelerate only gives the process group, the device and the collectives: its FSDP plugin does not
shard on CPU ranks (it wraps DDP under MULTI_CPU), so the sharding is applied here, as torchtitan
does, the same code on CPU and GPU.

Checkpoints are torch.distributed.checkpoint (DCP): every rank writes its own shards into
CHECKPOINT/fsdp/, and any number of ranks loads them (DCP re-shards on load): no conversion.

With model.lora, peft has wrapped the model before it comes here (train/modeling.py): its blocks
are sharded like any, frozen base weights and adapters in the same unit (FSDP2 reduces only the
gradients that exist), the optimizer holds the adapters only, checkpoints hold only what trains,
and the exports are train/lora.py's, from the gathered trained values (``trained_state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dplaunch.planning.plan import Plan
from dplaunch.run_directory.layout import FSDP_TAG, FSDP_TRAINER_FILE
from dplaunch.train.chunked_loss import ChunkedTokenLoss, token_loss_chunk
from dplaunch.train.engines import (
    EngineBase,
    RunFileHyperparameters,
    build_optimizer,
    forward_options,
)
from dplaunch.train.lora import is_lora_model, trained_state
from dplaunch.train.phase_clock import PhaseClock

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the classes HF names in ``_no_split_modules`` (LlamaDecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def device_mesh(plan: Plan) -> tuple[Any, Any | None]:
    """(FSDP's mesh, the tensor-parallel mesh or None): (shard,) for full, (replicate, shard) for
    hybrid; with tp a (shard, tp) mesh, tp fastest as in planning/mesh.py."""
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if plan.target == "gpu" else "cpu"
    dp, shard, tp = plan.data_parallel_size, plan.fsdp_shard_size, plan.tensor_parallel_size
    if tp > 1:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("shard", "tp"))
        return mesh["shard"], mesh["tp"]
    if plan.fsdp == "hybrid":
        names = ("replicate", "shard")
        return init_device_mesh(device, (dp // shard, shard), mesh_dim_names=names), None
    return init_device_mesh(device, (dp,), mesh_dim_names=("shard",)), None


# the tp_plan styles of transformers' models this engine applies, as torch's parallel styles
TP_STYLES = ("colwise", "rowwise")


def tensor_parallelize(model: torch.nn.Module, tp_mesh: Any) -> int:
    """Split the decoder's linear layers over tp_mesh as the model's HF ``base_model_tp_plan``
    says (DTensor, torch's ColwiseParallel/RowwiseParallel); returns how many layers it split."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tp_plan: tensor parallelism cannot split it"
        )
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        raise ValueError(f"{type(model).__name__}'s tp_plan uses styles {unknown}, not {TP_STYLES}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = getattr(model, model.base_model_prefix)
    parallelize_module(base, tp_mesh, {key: styles[style]() for key, style in plan.items()})
    return sum(1 for p in base.parameters() if getattr(p, "device_mesh", None) is tp_mesh)


def _by_mesh(parameters: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    # FSDP × TP: the split layers' gradients live on the 2-D mesh, the others' on the shard mesh
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_mesh.setdefault(getattr(parameter.grad, "device_mesh", None), []).append(
                parameter.grad
            )
    return by_mesh


def _whole(norm: torch.Tensor) -> torch.Tensor:
    # a DTensor norm (partial sums over the shards) as the plain tensor every rank agrees on
    return getattr(norm, "full_tensor", lambda: norm)()


def gradient_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of the sharded gradients, a plain tensor equal on every rank (collective)."""
    norms = [
        _whole(torch.nn.utils.get_total_norm(grads)) for grads in _by_mesh(parameters).values()
    ]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over gradients that may live on different meshes (FSDP × TP), which
    torch's cannot stack; returns the norm before clipping as a plain tensor."""
    by_mesh = _by_mesh(parameters)
    if len(by_mesh) <= 1:
        return _whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    total = gradient_norm(parameters)
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    for grads in by_mesh.values():
        for grad in grads:
            grad.mul_(coefficient)
    return total


def shard_model(
    model: torch.nn.Module, plan: Plan, compile_blocks: bool, *, reference: bool = False
) -> list[str]:
    """fully_shard each decoder block, then the root (embeddings, final norm, head); returns what
    the start-up log says about it. A REFERENCE model (dpo) only runs forwards: its root is
    resharded after each, as its blocks are."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh, tp_mesh = device_mesh(plan)
    split = tensor_parallelize(model, tp_mesh) if tp_mesh is not None else 0
    dtype = PRECISION_DTYPES.get(plan.mixed_precision)
    # 16-bit compute from fp32 sharded master weights; gradients reduced in fp32
    precision = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None
    )
    options: dict[str, Any] = {"mesh": mesh, "mp_policy": precision}
    if plan.offload == "all":
        # CPU ranks: the same policy (sharded states kept on the host, stepped there) without
        # pinned memory, which needs an accelerator
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=plan.target == "gpu")
    blocks = decoder_blocks(model)
    # named before fully_shard renames the classes (FSDPLlamaDecoderLayer)
    kind = type(blocks[0]).__name__ if blocks else "no block class (_no_split_modules)"
    for block in blocks:
        if compile_blocks:
            # the block's forward only: FSDP's hooks stay outside the compiled graph, and the
            # state-dict names stay the model's own (no _orig_mod.)
            block.forward = torch.compile(block.forward)
        fully_shard(block, **options)
    # the root's parameters are needed again at once by the backward: not resharded after forward
    fully_shard(model, reshard_after_forward=reference, **options)
    shard, replicate = mesh.size(-1), (mesh.size(0) if mesh.ndim == 2 else 1)
    lines = [
        f"FSDP2 {plan.fsdp}: {len(blocks)} × {kind} + root sharded over {shard} rank(s)"
        + (f", replicated {replicate}×" if replicate > 1 else "")
        + (
            f", {split} weights split over tp {tp_mesh.size()} (the model's tp_plan)"
            if split
            else ""
        )
        + (f", compute in {plan.mixed_precision} (fp32 reduction)" if dtype else "")
        + (", parameters/gradients/optimizer offloaded to CPU" if plan.offload == "all" else "")
    ]
    if compile_blocks:
        lines.append(
            "decoder blocks compiled with torch.compile (inductor): the first steps include compiling"
        )
    return lines


def _ensure_process_group(plan: Plan) -> None:
    # one rank has no process group from Accelerate; the mesh and DCP need one (of size 1)
    if not dist.is_initialized():
        dist.init_process_group(
            plan.process_group_backend, store=dist.HashStore(), rank=0, world_size=1
        )


class FsdpEngine(EngineBase):
    """One optimizer step under FSDP2: micro-batches accumulate, gradients reduce-scattered at
    each backward (ZeRO-3's memory: no unsharded gradient kept between micro-batches)."""

    def __init__(self, accelerator: Any, model: Any, plan: Plan, config: Any, scheduler_for: Any):
        _ensure_process_group(plan)
        self.accelerator = accelerator
        self.device = accelerator.device
        # the seconds of each step's forward, backward and optimizer step (train/phase_clock.py)
        self.clock = PhaseClock(self.device)
        self.rank = dist.get_rank()
        self.task = config.model.task
        self.forward_options = forward_options(self.task)
        self.max_grad_norm = config.train.max_grad_norm
        # model.lora: peft wrapped the model first (modeling.py); its blocks are sharded like any
        # (frozen base weights and trained adapters in one unit: only the adapters get gradients,
        # only they are reduce-scattered and in the optimizer); checkpoints hold only what trains
        self.lora = is_lora_model(model)
        self.lines = shard_model(model, plan, config.train.compile)
        self.model = model
        # train.loss_chunk: the head and the token loss a chunk at a time, fused (the root keeps
        # the head gathered from its forward to the end of the backward)
        chunk = token_loss_chunk(plan, self.task)
        self.chunked = ChunkedTokenLoss(model, chunk, config.data.max_length) if chunk else None
        if self.chunked is not None:
            self.lines.append(self.chunked.line())
        self.optimizer = build_optimizer(model, config.train, plan)
        self.scheduler = scheduler_for(self.optimizer)
        # fp16 (GPU): loss scaling, the sharded gradients unscaled before clipping
        self.scaler = torch.amp.GradScaler("cuda") if plan.mixed_precision == "fp16" else None

    def layout_lines(self) -> list[str]:
        """What the start-up log says about the engine beyond the plan."""
        return self.lines

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.chunked is None or self.objective is not None:
            return super().forward_loss(batch)
        return self.chunked.mean(self.model, batch, **self.forward_options)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        model, optimizer, clock = self.model, self.optimizer, self.clock
        model.train()
        clock.start()

        def backward(loss: torch.Tensor, _total: torch.Tensor) -> None:
            # the mean over the step's micro-batches, as Accelerate's backward divides it
            loss = loss / len(micro_batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            clock.lap("backward")

        total = self.micro_batch_loop(micro_batches, backward)
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        grad_norm = None
        parameters = [p for p in model.parameters() if p.grad is not None]
        if self.max_grad_norm > 0:
            grad_norm = clip_grad_norm(parameters, self.max_grad_norm)
        elif self.guard is not None and self.guard.enabled and self.guard.judges_gradient:
            # the guard's own norm would be a DTensor (and cannot stack FSDP × TP's two meshes)
            grad_norm = gradient_norm(parameters)
        skip = self.guard is not None and self.guard.judge(total, grad_norm, parameters, None)
        if not skip:
            self._optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        clock.lap("step")
        return total / len(micro_batches)

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
            self.scheduler.step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # an overflow skipped the update (and lowered the scale): the schedule does not move on
        if self.scaler.get_scale() >= before:
            self.scheduler.step()

    def save(self, directory: str) -> None:
        """Every rank writes its shards of the model and optimizer (DCP); rank 0 the schedule."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": self._checkpointed(model_state), "optimizer": optimizer_state},
            checkpoint_id=str(Path(directory) / FSDP_TAG),
        )
        if self.rank == 0:
            trainer = {"scheduler": self.scheduler.state_dict()}
            if self.scaler is not None:
                trainer["scaler"] = self.scaler.state_dict()
            torch.save(trainer, Path(directory) / FSDP_TRAINER_FILE)

    def load(self, directory: str) -> None:
        """Read a DCP checkpoint written on any number of ranks into this rank's shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        run_file = RunFileHyperparameters(self.optimizer.param_groups, self.scheduler)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": self._checkpointed(model_state), "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(Path(directory) / FSDP_TAG))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            # a LoRA checkpoint holds no frozen base weights: they stay as built
            options=StateDictOptions(strict=not self.lora),
        )
        trainer = torch.load(Path(directory) / FSDP_TRAINER_FILE, weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        if self.scaler is not None and "scaler" in trainer:
            self.scaler.load_state_dict(trainer["scaler"])
        run_file.restore(self.optimizer.param_groups)

    def load_universal(self, directory: str, step: int) -> None:
        """Restore a checkpoint of any layout from its universal form (train/universal.py): each
        rank reads its own shards of every tensor."""
        from dplaunch.train import universal_load
        from dplaunch.train.universal import UniversalReader

        reader = UniversalReader(Path(directory))
        run_file = RunFileHyperparameters(self.optimizer.param_groups, self.scheduler)
        universal_load.load_sharded(reader, self.model, self.optimizer, self.lora)
        universal_load.load_scheduler(reader, self.scheduler)
        run_file.restore(self.optimizer.param_groups)
        reader.close()

    def _checkpointed(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """What of the model a checkpoint holds: all of it, or (LoRA) only what trains."""
        return trained_state(model_state, self.model) if self.lora else model_state

    def _full_state(self) -> dict[str, Any]:
        """The full weights gathered to rank 0, on the CPU (empty on the others); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def trained_state(self) -> dict[str, torch.Tensor] | None:
        """The gathered values of what trains (a LoRA model's adapters) on rank 0, None on the
        others (train/lora_export.py's export_run); every rank calls it. Only they are gathered:
        the frozen base of a large model would not fit rank 0's host memory in fp32."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=True
        )
        state = get_model_state_dict(self.model, options=options)
        if self.rank != 0:
            return None
        return {
            key: value.detach().float() for key, value in trained_state(state, self.model).items()
        }

    def export(self, directory: str, tokenizer: Any) -> None:
        """The full weights gathered to rank 0 (on the CPU), written as one HF model + tokenizer."""
        state = self._full_state()
        if self.rank == 0:
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(directory)
        dist.barrier()


def consolidated_fsdp_state_dict(directory: Path) -> dict[str, Any]:
    """The full model state dict of an FSDP checkpoint, read in one process (`dplaunch export`)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        # "no process group: loading into this process" is what is wanted here
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys({"model"}, checkpoint_id=str(directory / FSDP_TAG))
    return state["model"]
