"""The learning-rate schedules of `train.scheduler`: transformers' `get_scheduler` curves, built here.

`transformers.optimization` imports `transformers.trainer_utils`, which imports peft when it is
installed, and peft imports bitsandbytes, whose kernels `torch.compile` at import: 1.8 s of CPU on
every rank of every run, LoRA or not (measured on this repository's test environment). The curves
themselves are a few lines each; they are written here with transformers' arithmetic, operation
for operation, so a run's learning rates are bit-identical to `get_scheduler`'s
(tests/test_engines.py compares every name over warm-up, decay and past the end). Each is a
`LambdaLR` over a `functools.partial` of a module-level function, as transformers builds them, so
a scheduler's state_dict is the same as before and older checkpoints load unchanged.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

# transformers' defaults for the two curves with a free parameter
COSINE_CYCLES = 0.5
RESTART_CYCLES = 1
POLYNOMIAL_LR_END = 1e-7
POLYNOMIAL_POWER = 1.0


def _warming(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _progress(step: int, warmup: int, total: int) -> float:
    return float(step - warmup) / float(max(1, total - warmup))


def _constant(_: int) -> float:
    return 1


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    return 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    progress = _progress(step, warmup, total)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(COSINE_CYCLES) * 2.0 * progress)))


def _cosine_with_restarts(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warming(step, warmup)
    progress = _progress(step, warmup, total)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(RESTART_CYCLES) * progress) % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float) -> float:
    # LambdaLR multiplies by the initial rate: the curve ends at POLYNOMIAL_LR_END / lr_init
    if step < warmup:
        return _warming(step, warmup)
    if step > total:
        return POLYNOMIAL_LR_END / lr_init
    remaining = 1 - (step - warmup) / (total - warmup)
    decayed = (lr_init - POLYNOMIAL_LR_END) * remaining**POLYNOMIAL_POWER + POLYNOMIAL_LR_END
    return decayed / lr_init


def learning_rate_schedule(
    name: str, optimizer: Any, *, warmup_steps: int, total_steps: int
) -> Any:
    """The `torch.optim.lr_scheduler.LambdaLR` that `transformers.get_scheduler(name, optimizer,
    num_warmup_steps=warmup_steps, num_training_steps=total_steps)` returns, for the names of
    `train.scheduler`."""
    from torch.optim.lr_scheduler import LambdaLR

    spans = {"warmup": warmup_steps, "total": total_steps}
    curves = {
        "constant": _constant,
        "constant_with_warmup": partial(_constant_with_warmup, warmup=warmup_steps),
        "linear": partial(_linear, **spans),
        "cosine": partial(_cosine, **spans),
        "cosine_with_restarts": partial(_cosine_with_restarts, **spans),
    }
    if name == "polynomial":
        lr_init = optimizer.defaults["lr"]
        if not lr_init > POLYNOMIAL_LR_END:
            raise ValueError(
                f"lr_end ({POLYNOMIAL_LR_END}) must be smaller than initial lr ({lr_init})"
            )
        curves[name] = partial(_polynomial, **spans, lr_init=lr_init)
    return LambdaLR(optimizer, curves[name])
