"""The seconds of a step's phases (forward, backward, step), which the forecast predicts one by one.

An engine calls ``lap(phase)`` after each phase of each micro-batch: the time since the previous
lap (or ``start``) is added to that phase. On GPUs a lap waits for the device, which costs the
overlap of host and device: the loop times only a few steps there (``enabled``); on CPU ranks
every step is timed. The end-of-run comparison (train/loop.py) names the phase, and so the term
of the forecast, that was most wrong.

A step's own seconds (``StepTimes``) are the device's only when the device is idle where the step
begins and ends: a GPU runs behind the host, and without a wait the clock reads how long the host
took to queue the work. The non-finite guard waits every step (its verdict); with
``train.on_nonfinite: off`` nothing does, so the loop waits around the few steps it times.
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
            wait_for_device()
        return time.perf_counter()


def wait_for_device() -> None:
    """Wait until the GPU has run everything queued on it."""
    import torch

    torch.cuda.synchronize()


class StepTimes:
    """Every step's seconds and phases, for the end-of-run comparison with the forecast: the
    median step after the first WARMUP (engines build buffers, DDP rebuilds its buckets), of the
    steps that began and ended on an idle device."""

    WARMUP = 2
    # the steps of a launch a GPU run times phase by phase (each lap waits for the device)
    GPU_PHASE_STEPS = range(3, 8)

    def __init__(self) -> None:
        self.seconds: list[float] = []
        # whether each step began and ended on an idle device (its seconds are the device's)
        self.idle: list[bool] = []
        self.phases: list[dict[str, float]] = []
        self._cuda = False
        self._synced = True
        self._waits = False
        self._ended_idle = True

    def begin(self, device: Any, synced: bool) -> None:
        """The next step starts on DEVICE; SYNCED: something waits for the device every step
        (the non-finite guard's verdict). Unsynced on a GPU, the loop waits at the end of the
        steps of GPU_PHASE_STEPS and of the one before them, so that these begin and end idle."""
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        step = len(self.seconds) + 1
        timed = range(self.GPU_PHASE_STEPS.start - 1, self.GPU_PHASE_STEPS.stop)
        self._waits = self._cuda and not synced and step in timed
        self._synced = synced

    @property
    def phase_timed(self) -> bool:
        """Whether a GPU times the next step phase by phase."""
        return len(self.seconds) + 1 in self.GPU_PHASE_STEPS

    def end(self, began: float, phases: dict[str, float]) -> None:
        """The step that began at BEGAN (time.perf_counter) has been queued: on a GPU that no one
        waits for every step, wait for it if it is timed; then record it."""
        if self._waits:
            wait_for_device()
        ended_idle = not self._cuda or self._synced or self._waits
        self.add(time.perf_counter() - began, phases, idle=ended_idle and self._ended_idle)
        self._ended_idle = ended_idle

    def add(self, seconds: float, phases: dict[str, float], idle: bool) -> None:
        self.seconds.append(seconds)
        self.idle.append(idle)
        if set(PHASES) <= set(phases):
            self.phases.append(dict(phases))

    def _steady(self, values: list[Any]) -> list[Any]:
        return values[self.WARMUP :] if len(values) > self.WARMUP else values

    def median_step(self) -> float | None:
        """The median step after the warm-up of those that began and ended on an idle device
        (None: none did)."""
        steady = [
            s for s, idle in self._steady(list(zip(self.seconds, self.idle, strict=True))) if idle
        ]
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
