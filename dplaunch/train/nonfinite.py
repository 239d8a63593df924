"""The non-finite guard (train.on_nonfinite): a NaN/Inf loss or gradient norm stops the run or
skips that update, the same way on every rank.

Each optimizer step, every rank puts its verdict (its own loss; the gradient norm) into one small
tensor that is all-reduced, so all ranks skip or stop at the same step and the message names the
rank(s) whose loss went bad. One all-reduce and one host sync per optimizer step (`off` has none).

How an update is skipped:
- DDP (Accelerate): judged after the last micro-batch's backward (gradients averaged) and before
  ``optimizer.step()``; a skipped step leaves weights, optimizer state (Adam's moments and step
  count) and the scheduler untouched, and its gradients are dropped.
- DeepSpeed (ZeRO, AutoTP, pipeline): DeepSpeed steps inside its backward. Its own overflow check
  discards an update whose global gradient norm is not finite (fp32: ZeRO's grad-norm check;
  bf16: ``check_grad_overflow``, on by default; fp16: the loss scaler): it zeroes the gradients and
  steps neither the optimizer nor the scheduler. A NaN loss on one rank makes the averaged
  gradient NaN on all of them, so all discard it. The guard reads DeepSpeed's verdict
  (``engine.was_step_applied()``) after the step; should DeepSpeed ever apply an update despite a
  non-finite loss, the run stops instead of skipping (the weights are no longer good).
- fp16: an overflowing gradient is the loss scaler's business (it lowers the scale and skips);
  only a non-finite loss counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dplaunch.stop_signals import EXIT_NONFINITE  # noqa: F401 — the guard's own exit status

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NonFinite:
    """What went non-finite at one step, as every rank agrees."""

    step: int
    loss_ranks: tuple[int, ...]
    gradient: bool
    # DeepSpeed applied the update anyway: the weights are bad, skipping is no longer possible
    applied: bool = False

    def describe(self) -> str:
        if self.loss_ranks:
            # a NaN loss makes the averaged gradient NaN on every rank too: the loss is the cause
            many = len(self.loss_ranks) > 1
            ranks = ", ".join(map(str, self.loss_ranks))
            return f"step {self.step}: non-finite loss on rank{'s' if many else ''} {ranks}"
        return f"step {self.step}: non-finite gradient norm (the loss was finite on every rank)"


class NonFiniteGuard:
    """Judges each optimizer step; the loop asks it afterwards whether to go on."""

    def __init__(self, mode: str, max_skipped: int, accelerator: Any, mixed_precision: str):
        self.mode = mode
        self.max_skipped = max_skipped
        self.accelerator = accelerator
        # fp16: overflowing gradients are the loss scaler's (DeepSpeed's or torch's) to skip
        self.judges_gradient = mixed_precision != "fp16"
        self.step = 0
        self.event: NonFinite | None = None
        self.skipped_in_a_row = 0
        self.skipped_total = 0
        # why the guard stopped the run (set by the loop), else None
        self.stop_reason: str | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def begin(self, step: int) -> None:
        """Step STEP (1-based) is about to be trained."""
        self.step, self.event = step, None

    def judge(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None, parameters: Any, deepspeed: Any
    ) -> bool:
        """After the step's last backward: True when the update must not be applied (or was not,
        under DeepSpeed). ``loss``: this rank's loss of the step; ``grad_norm``: the clipped
        gradients' norm when known; ``deepspeed``: the DeepSpeed engine that already stepped."""
        if not self.enabled:
            return False
        import torch  # here: the launcher reads EXIT_NONFINITE without importing torch

        accelerator = self.accelerator
        flags = torch.zeros(accelerator.num_processes + 1, device=loss.device)
        flags[accelerator.process_index] = (~torch.isfinite(loss.detach().float())).float()
        discarded = False
        if deepspeed is not None:
            discarded = not deepspeed.was_step_applied()
            gradient_bad: Any = discarded and self.judges_gradient
        elif self.judges_gradient:
            if grad_norm is None:
                grads = [p.grad for p in parameters if p.grad is not None]
                grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            gradient_bad = ~torch.isfinite(grad_norm.to(loss.device).float())
        else:
            gradient_bad = False
        flags[-1] = float(gradient_bad) if isinstance(gradient_bad, bool) else gradient_bad
        if accelerator.num_processes > 1:
            flags = accelerator.reduce(flags, reduction="sum")
        values = flags.tolist()
        loss_ranks = tuple(rank for rank, value in enumerate(values[:-1]) if value > 0)
        gradient = values[-1] > 0
        if not loss_ranks and not gradient:
            return False
        applied = deepspeed is not None and not discarded
        self.event = NonFinite(self.step, loss_ranks, gradient, applied)
        return True

    def verdict(self) -> str | None:
        """After the step: None to go on, else why the run must stop. Counts skipped steps."""
        event = self.event
        if event is None:
            self.skipped_in_a_row = 0
            return None
        if self.mode == "stop":
            return f"{event.describe()} (train.on_nonfinite: stop)"
        if event.applied:
            return (
                f"{event.describe()}, and DeepSpeed applied the update (its overflow check is off): "
                "the weights are no longer good"
            )
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if self.skipped_in_a_row > self.max_skipped:
            return (
                f"{event.describe()}: {self.skipped_in_a_row} updates in a row skipped, more than "
                f"train.max_skipped_steps {self.max_skipped}"
            )
        return None
