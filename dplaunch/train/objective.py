"""What the loop and the engines ask of a task's objective: the loss of a micro-batch when it is
not the model's own (Task.objective names the rank-side starter that builds it), its metrics,
and the parts online RL adds. A task's objective leaves what it lacks at these defaults, so the
loop asks every objective the same questions (train/preference.py's dpo, train/grpo.py's grpo)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Objective:
    """A task's own loss and metrics (subclassed by each task that has one)."""

    # online RL: turns a step's prompts into its micro-batches of completions before the step
    # (the loop times it as the `generate` phase); None: the step's micro-batches are the data's
    rollout: Callable[[int, list[dict[str, torch.Tensor]]], list[dict[str, Any]]] | None = None
    # samples to log at the next log line (rank 0's sampled completions with their rewards);
    # the loop writes them and empties the list
    shown: Sequence[dict[str, Any]] = ()

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of one micro-batch; its metrics are kept for the next log line."""
        raise NotImplementedError

    def log_record(self, reduce: Any) -> dict[str, float]:
        """The metrics since the last log line, summed over the ranks with REDUCE (Accelerate's
        reduce), as the log line's keys."""
        raise NotImplementedError

    def eval_sums(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed loss, counted items, correct predictions) of one evaluation batch."""
        raise NotImplementedError

    def eval_totals(self, batcher: Any) -> torch.Tensor | None:
        """This rank's (loss sum, items, correct) of a whole evaluation set when the objective
        evaluates otherwise than batch by batch (grpo: the rewards of sampled completions);
        None: the loop evaluates its batches through eval_sums."""
        return None
