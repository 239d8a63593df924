"""The seconds of a step's phases (forward, backward, step), which the forecast predicts one by one.

An engine calls ``lap(phase)`` after each phase of each micro-batch: the time since the previous
lap (or ``start``) is added to that phase. On GPUs a lap waits for the device, which costs the
overlap of host and device: the loop times only a few steps there (``enabled``); on CPU ranks
every step is timed. The end-of-run comparison (train/loop.py) names the phase, and so the term
of the forecast, that was most wrong.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("forward", "backward", "step")


class PhaseClock:
    """Accumulates the seconds of each phase of the current step."""

    def __init__(self, device: Any = None):
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        self.enabled = not self.cuda
        # phases the engine runs in one call and times together (DeepSpeed steps inside
        # Accelerate's backward): the comparison with the forecast joins them on both sides
        self.joined: tuple[str, ...] = ()
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        """A step begins: its phases start from zero."""
        self.seconds = {}
        if self.enabled:
            self._last = self._now()

    def lap(self, phase: str) -> None:
        """PHASE just ended."""
        if not self.enabled:
            return
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()


class StepTimes:
    """Every step's seconds and phases, for the end-of-run comparison with the forecast: the
    median step after the first WARMUP (engines build buffers, DDP rebuilds its buckets)."""

    WARMUP = 2
    # the steps a GPU run times phase by phase (each lap waits for the device)
    GPU_PHASE_STEPS = range(3, 8)

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.phases: list[dict[str, float]] = []

    def add(self, seconds: float, phases: dict[str, float]) -> None:
        self.seconds.append(seconds)
        if set(PHASES) <= set(phases):
            self.phases.append(dict(phases))

    def _steady(self, values: list[Any]) -> list[Any]:
        return values[self.WARMUP :] if len(values) > self.WARMUP else values

    def median_step(self) -> float | None:
        """The median step after the warm-up (None: no step trained)."""
        steady = self._steady(self.seconds)
        return _median(steady) if steady else None

    def median_phases(self) -> dict[str, float] | None:
        """Each phase's median over the timed steps after the warm-up (None: none timed)."""
        steady = self._steady(self.phases)
        if not steady:
            return None
        return {phase: _median([p[phase] for p in steady]) for phase in PHASES}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
