"""Step engines: what one optimizer step means for a parallel layout, behind one interface.

The loop only calls ``train_step(micro_batches) -> loss``, ``eval_batch(batch) -> (loss_sum, count,
correct)``, ``current_lr()``, ``save``/``load``, ``export`` and ``layout_lines()``, and reads the
attributes of ``StepEngine``; ``EngineBase`` holds what the engines share. DDP, ZeRO and AutoTP run
through Accelerate (``accelerator.backward`` averages gradients, AccelerateEngine), FSDP2 through
torch (train/fsdp.py), the pipeline through DeepSpeed's engine (train/pipeline.py), Ulysses'
sequence parallelism as AccelerateEngine with another loss (train/sequence_parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from dplaunch.planning.plan import Plan
from dplaunch.tasks import task_of
from dplaunch.train.lora import is_lora_model, trained_state
from dplaunch.train.objective import Objective
from dplaunch.train.phase_clock import PhaseClock


class StepEngine(Protocol):
    """The interface the training loop drives."""

    # the model as the engine holds it (wrapped by Accelerate, sharded by FSDP, ...)
    model: Any
    # train.on_nonfinite's guard (set by the loop): judges each step's loss and gradients on
    # every rank together, before the update (after it where DeepSpeed's pipeline steps itself)
    guard: Any
    # save() writes every rank's RNG itself (else the Checkpointer does, train/checkpoint.py)
    saves_rng: bool
    # each rank of a sequence-parallel group evaluates its own slice: its sums count
    evaluates_slices: bool
    # the seconds of each step's phases (train/phase_clock.py; None: the engine does not time them)
    clock: Any

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns their mean loss (no host sync)."""

    def eval_batch(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed loss, counted items, correct predictions) of one evaluation batch."""

    def current_lr(self) -> float:
        """The learning rate of the last step."""

    def save(self, directory: str) -> None:
        """Write this rank's part of a checkpoint (model, optimizer, scheduler, RNG)."""

    def load(self, directory: str) -> None:
        """Restore a checkpoint written by save()."""

    def load_universal(self, directory: str, step: int) -> None:
        """Restore a checkpoint of any layout from its universal form (train/universal.py),
        reached at optimizer step STEP."""

    def export(self, directory: str, tokenizer: Any) -> None:
        """Write one consolidated HF model (safetensors) + tokenizer; every rank calls it."""

    def layout_lines(self) -> list[str]:
        """What the start-up log says about the engine beyond the plan."""


class EngineBase:
    """What the engines share: StepEngine's defaults, the evaluation forward and the learning rate."""

    guard: Any = None
    saves_rng = False
    evaluates_slices = False
    clock: Any = None
    # the task's own loss, when not the model's (dpo's, grpo's: train/objective.py)
    objective: Objective | None = None
    model: Any
    optimizer: Any
    device: Any
    task: str
    forward_options: dict[str, Any]

    def layout_lines(self) -> list[str]:
        """What the start-up log says about the engine beyond the plan."""
        return []

    @torch.no_grad()
    def eval_batch(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed loss, counted items, correct predictions) of one evaluation batch."""
        self.model.eval()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.objective is not None:
            return self.objective.eval_sums(self.model, batch)
        output = self.model(**batch, **self.forward_options)
        return loss_sums(output.logits, batch["labels"], self.task)

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss: the model's own, or the preference objective's."""
        if self.objective is not None:
            return self.objective.loss(self.model, batch)
        return self.model(**batch, **self.forward_options).loss

    def current_lr(self) -> float:
        """The learning rate of the last step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def micro_batch_loop(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        backward: Callable[[torch.Tensor, torch.Tensor], None],
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> torch.Tensor:
        """The step's micro-batches in turn, the same for every engine: each moved to the
        device, its loss (the model's or the objective's, times its share of the step's tokens
        when rows differ in length: data.py) taken and timed as the forward, then
        BACKWARD(loss, the losses so far) — the engine's backward, and whatever it does after
        each (Accelerate: the optimizer step it skips until the last) — inside AROUND's context
        (Accelerate's accumulate). The sum of their losses, detached (no host sync)."""
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            scale = batch.pop("loss_scale", None)
            with around():
                loss = self.forward_loss(batch)
                if scale is not None:
                    loss = loss * scale
                total += loss.detach().float()
                self.clock.lap("forward")
                backward(loss, total)
        return total


def forward_options(task: str) -> dict[str, Any]:
    """Keyword arguments of every forward. A causal LM builds a KV cache in every forward unless
    told not to, in training too: a copy of each layer's keys and values, held until the backward
    is done (2-5 % of a CPU step)."""
    return {"use_cache": False} if task_of(task).causal else {}


def parameter_groups(model: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The trained parameters (name, parameter) with weight decay and without (biases, norms), in
    model order: the optimizer's two groups, whose order is the order of its state (a checkpoint's
    optimizer file numbers the parameters so: dplaunch/train/checkpoint_sources.py)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        # ZeRO-3 builds a pretrained model already partitioned: its own shape is ds_shape
        ndim = len(getattr(parameter, "ds_shape", parameter.shape))
        (no_decay if ndim < 2 or "norm" in name.lower() else decay).append((name, parameter))
    return decay, no_decay


def build_optimizer(model: Any, train: Any, plan: Plan) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms; DeepSpeedCPUAdam when ZeRO offloads it."""
    decay, no_decay = ([parameter for _, parameter in group] for group in parameter_groups(model))
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if plan.offload != "none" and plan.engine != "fsdp":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=train.lr, adamw_mode=True)
    # FSDP's CPU offload steps torch's AdamW on the host's shards
    fused = plan.target == "gpu" and plan.offload == "none"
    return torch.optim.AdamW(groups, lr=train.lr, fused=fused)


class AccelerateEngine(EngineBase):
    """DDP, ZeRO-1/2/3 and AutoTP: the Accelerate idiom, with gradient accumulation and clipping."""

    # accelerate's save_state stores the RNG of every rank next to the model and optimizer
    saves_rng = True

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        max_grad_norm: float,
        task: str,
    ):
        self.accelerator = accelerator
        self.device = accelerator.device
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.task = task
        self.uses_deepspeed = accelerator.distributed_type.value == "DEEPSPEED"
        # the seconds of each step's forward, backward and optimizer step (train/phase_clock.py)
        self.clock = PhaseClock(accelerator.device)
        if self.uses_deepspeed:
            # Accelerate's backward runs DeepSpeed's engine.step() too: one phase
            self.clock.joined = ("backward", "step")
        # model.lora: checkpoints hold only what trains (adapters, modules_to_save) and its
        # optimizer state; the frozen base is built again from the run file on resume
        self.lora = is_lora_model(accelerator.unwrap_model(model))
        self.forward_options = forward_options(task)
        if not self.uses_deepspeed:
            # DDP checkpoints hold the unwrapped model's weights, so they load on any rank count
            # (one rank has no DDP wrapper, and its keys lack the "module." prefix)
            accelerator.register_save_state_pre_hook(self._save_unwrapped)
            accelerator.register_load_state_pre_hook(self._load_unwrapped)

    def layout_lines(self) -> list[str]:
        """What the start-up log says about the engine beyond the plan."""
        # DeepSpeed's engine compiles itself; under DDP Accelerate returns the compiled wrapper
        if getattr(self.model, "is_compiled", False) or hasattr(self.model, "_orig_mod"):
            return [
                "model compiled with torch.compile (inductor): the first steps include compiling"
            ]
        return []

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        self.model.train()
        self.clock.start()
        total = self.micro_batch_loop(
            micro_batches, self._backward_and_step, lambda: self.accelerator.accumulate(self.model)
        )
        return total / len(micro_batches)

    def _backward_and_step(self, loss: torch.Tensor, total: torch.Tensor) -> None:
        """Accelerate's backward (it divides by the accumulation), then the optimizer step, which
        Accelerate skips but at the step's last micro-batch (sync_gradients)."""
        accelerator, model, clock = self.accelerator, self.model, self.clock
        accelerator.backward(loss)
        clock.lap("backward")
        grad_norm = None
        # DeepSpeed clips inside its step (gradient_clipping in the JSON)
        if accelerator.sync_gradients and self.max_grad_norm > 0 and not self.uses_deepspeed:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        skip = (
            accelerator.sync_gradients
            and self.guard is not None
            and self.guard.judge(
                total, grad_norm, model.parameters(), model if self.uses_deepspeed else None
            )
        )
        if not skip:
            scale_before = self._loss_scale() if accelerator.sync_gradients else None
            self.optimizer.step()
            if accelerator.sync_gradients and not self._step_skipped(scale_before):
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("step")

    def _loss_scale(self) -> float | None:
        # fp16 under DDP: torch's GradScaler (DeepSpeed keeps its own and reports its overflows)
        scaler = self.accelerator.scaler
        return None if scaler is None else scaler.get_scale()

    def _step_skipped(self, scale_before: float | None) -> bool:
        """Whether the optimizer step just taken skipped its update (fp16 overflow): then the
        learning-rate schedule must not move on either."""
        if self.accelerator.optimizer_step_was_skipped:
            return True
        # Accelerate counts a step as skipped only when GradScaler does not call optimizer.step();
        # fused AdamW (GPU plans) is always called and skips inside its kernel. An overflow is
        # what makes GradScaler.update() lower the scale
        return scale_before is not None and self.accelerator.scaler.get_scale() < scale_before

    def save(self, directory: str) -> None:
        # DDP: model, optimizer, scheduler (registered), RNG of every rank; DeepSpeed: its own
        # checkpoint (ZeRO shards of every rank) under tag pytorch_model, plus scheduler and RNG
        frozen_left_out = (
            {"exclude_frozen_parameters": True} if self.lora and self.uses_deepspeed else {}
        )
        self.accelerator.save_state(directory, safe_serialization=True, **frozen_left_out)

    def load(self, directory: str) -> None:
        run_file = RunFileHyperparameters(
            _torch_optimizer(self.optimizer).param_groups, self.scheduler
        )
        # a LoRA checkpoint holds no frozen base weights: they stay as built
        partial = {}
        if self.lora:
            partial = {"load_module_strict": False} if self.uses_deepspeed else {"strict": False}
        self.accelerator.load_state(directory, **partial)
        # accelerate restores its micro-step counter from the checkpoint; gradient accumulation
        # must restart at a step boundary with this run's accumulation (the GPU count may differ)
        self.accelerator.step = 0
        # loading a torch optimizer's state replaces its group dicts: the new ones
        run_file.restore(_torch_optimizer(self.optimizer).param_groups)
        if self.uses_deepspeed:
            _settle_step_counters(self.optimizer)

    def load_universal(self, directory: str, step: int) -> None:
        """Restore a checkpoint of any layout from its universal form (train/universal.py)."""
        from dplaunch.train import universal_load
        from dplaunch.train.universal import UniversalReader

        reader = UniversalReader(Path(directory))
        optimizer = _torch_optimizer(self.optimizer)
        run_file = RunFileHyperparameters(optimizer.param_groups, self.scheduler)
        if self.uses_deepspeed:
            named = trained_parameters(self.model.module)
            universal_load.load_deepspeed(reader, self.model, named, step)
        else:
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            universal_load.load_whole(reader, trained_parameters(model), optimizer)
        universal_load.load_scheduler(reader, _torch_scheduler(self.scheduler))
        self.accelerator.step = 0
        run_file.restore(_torch_optimizer(self.optimizer).param_groups)
        reader.close()

    def _save_unwrapped(self, models: list[Any], weights: list[dict], _directory: str) -> None:
        for index, model in enumerate(models):
            if index < len(weights):
                weights[index] = self.accelerator.get_state_dict(model, unwrap=True)
                if self.lora:
                    weights[index] = trained_state(
                        weights[index], self.accelerator.unwrap_model(model)
                    )

    def _load_unwrapped(self, models: list[Any], _directory: str) -> None:
        for index, model in enumerate(models):
            models[index] = self.accelerator.unwrap_model(model)

    def trained_state(self) -> dict[str, torch.Tensor] | None:
        """The values of what trains (a LoRA model's adapters), whole, on the CPU, on rank 0 (None
        on the others); every rank calls it (a ZeRO-3 gather is collective)."""
        if self.uses_deepspeed and self.model.zero_optimization_partition_weights():
            # ZeRO-3: gather what trains only, not the frozen base in 16 bits on rank 0's host
            state = self.model._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
        else:
            state = self.accelerator.get_state_dict(self.model)
        if not self.accelerator.is_main_process or not state:
            return None
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        return {
            key.removeprefix("_orig_mod."): value.detach().float().cpu()
            for key, value in trained_state(state, unwrapped).items()
        }

    def export(self, directory: str, tokenizer: Any) -> None:
        accelerator = self.accelerator
        state = accelerator.get_state_dict(self.model)  # gathers ZeRO-3 shards on rank 0
        if state is not None:
            # a torch.compile'd model's keys carry its wrapper's prefix: from_pretrained would
            # find none of its weights and initialise them at random
            state = {key.removeprefix("_orig_mod."): value for key, value in state.items()}
        unwrapped = accelerator.unwrap_model(self.model, keep_torch_compile=False)
        unwrapped.save_pretrained(
            directory,
            state_dict=state,
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            safe_serialization=True,
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(directory)
        accelerator.wait_for_everyone()


def trained_parameters(model: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of what trains, by the model's own names (a compiled model's wrapper
    prefix dropped)."""
    return [
        (name.removeprefix("_orig_mod."), parameter)
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    ]


class RunFileHyperparameters:
    """The run file's optimizer settings, taken before a checkpoint is loaded and put back after.

    A checkpoint restores the optimizer's groups (weight decay, betas, eps) and the scheduler's
    base learning rates as they were saved, but a resumed run trains with its run file's (the
    resume check notes each change): the schedule's position is the checkpoint's, its base lr and
    shape (warmup, total steps, kind: the lambdas, never saved) the run file's. It also undoes
    DeepSpeed's ZeRO-3 universal loader (0.19), which copies group 0's settings into every group
    (the no-decay group would get the weight decay)."""

    def __init__(self, groups: list[dict[str, Any]], scheduler: Any):
        self.settings = [
            {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
            for group in groups
        ]
        self.scheduler = _torch_scheduler(scheduler)
        self.base_lrs = list(self.scheduler.base_lrs)

    def restore(self, groups: list[dict[str, Any]]) -> None:
        scheduler = self.scheduler
        scheduler.base_lrs = list(self.base_lrs)
        lambdas = getattr(scheduler, "lr_lambdas", None)
        for index, (group, own) in enumerate(zip(groups, self.settings, strict=True)):
            group.update(own)
            group["initial_lr"] = self.base_lrs[index]
            if lambdas is not None:
                group["lr"] = self.base_lrs[index] * lambdas[index](scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]


def _torch_scheduler(scheduler: Any) -> Any:
    # Accelerate's wrapper → the torch scheduler
    while hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler
    return scheduler


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # Accelerate's wrapper → (DeepSpeed's ZeRO optimizer →) the torch optimizer that really steps
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _settle_step_counters(optimizer: Any) -> None:
    # DeepSpeed's universal-checkpoint loaders (0.19) put `step` in the optimizer's state as it was
    # saved: on the CPU (ds_to_universal maps to it), and under ZeRO-3 one tensor shared by every
    # parameter group. torch's Adam increments it in place, so a shared one would advance once per
    # group per step and skew the bias correction: one tensor per state, as a fresh optimizer has.
    # And fused (GPU) or capturable AdamW needs it as float32 on its parameter's device, where
    # torch's own load_state_dict would have put it (else "Expected all tensors to be on the same
    # device" in _fused_adamw_, pytorch#104767); the other kinds keep it on the CPU.
    inner = _torch_optimizer(optimizer)
    on_device = any(group.get("fused") or group.get("capturable") for group in inner.param_groups)
    for parameter, state in inner.state.items():
        step = state.get("step")
        if not isinstance(step, torch.Tensor):
            continue
        if on_device:
            state["step"] = step.to(device=parameter.device, dtype=torch.float32, copy=True)
        else:
            state["step"] = step.clone()


def loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, task: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy, number of predictions and number correct (per row weight applied by caller)."""
    if task_of(task).classifies:
        losses = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        correct = (logits.argmax(-1) == labels).float()
        return losses, torch.ones_like(losses), correct
    return token_sums(logits[:, :-1], labels[:, 1:])


def token_sums(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: summed cross-entropy, labelled tokens and correct predictions of LOGITS against
    LABELS already aligned with them (the next token at each position, -100 where none)."""
    logits = logits.float()
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        reduction="none",
        ignore_index=-100,
    ).view(labels.shape)
    mask = (labels != -100).float()
    correct = ((logits.argmax(-1) == labels).float() * mask).sum(-1)
    return losses.sum(-1), mask.sum(-1), correct
