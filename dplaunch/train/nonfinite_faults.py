"""TEST ONLY: the non-finite faults of tests/test_nonfinite.py, set in the ranks' environment as
DPLAUNCH_TEST_NONFINITE:

- "STEP:RANK" makes RANK's loss NaN at step STEP (1-based, as in metrics.jsonl): what the guard
  (train/nonfinite.py) must catch on every layout;
- "STEP:omit" leaves step STEP's batch out untrained: the reference run a skipped step must equal.

Unset, as in every real run, nothing here does anything: the loop asks once at start-up and the
guard knows nothing of it. It lives in the ranks because the NaN must come out of a real forward
of real ranks started by `dplaunch train`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dplaunch.run_directory.environment import NONFINITE_FAULT_ENV


@dataclass(frozen=True)
class NonFiniteFault:
    """A NaN loss on one rank at one step, or that step's batch left out."""

    step: int
    # a rank's number, or "omit"
    target: str

    @property
    def omitted_step(self) -> int | None:
        """The step whose batch is read and dropped untrained, if this fault omits one."""
        return self.step if self.target == "omit" else None

    def install(self, model: Any, rank: int, current_step: Any) -> None:
        """A forward hook on MODEL that makes this rank's loss NaN while CURRENT_STEP() is the
        fault's step (training only; nothing on the other ranks)."""
        if self.target == "omit" or int(self.target) != rank:
            return

        def poison(module: Any, _inputs: Any, output: Any) -> Any:
            if module.training and current_step() == self.step:
                if getattr(output, "loss", None) is not None:
                    output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(poison)


def nonfinite_fault_from_environment() -> NonFiniteFault | None:
    """The fault DPLAUNCH_TEST_NONFINITE asks for; None when unset (every real run)."""
    text = os.environ.get(NONFINITE_FAULT_ENV, "")
    if not text:
        return None
    step, _, target = text.partition(":")
    if not step.isdigit() or not (target == "omit" or target.isdigit()):
        raise ValueError(f"{NONFINITE_FAULT_ENV}={text!r}: expected STEP:RANK or STEP:omit")
    return NonFiniteFault(int(step), target)
