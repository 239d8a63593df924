"""What the contender scripts share: the rendered run they all read, the data, the step clock."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

from dplaunch.run_directory.files import read_plan_file, read_run_file


def read_rendered_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run.yaml, plan.json) of a directory written by `dplaunch config --out`."""
    return read_run_file(run_dir), read_plan_file(run_dir)


def backend(plan: dict[str, Any]) -> str:
    """The process-group backend the plan implies: gloo on CPU ranks, NCCL on GPUs."""
    return "gloo" if plan["target"] == "cpu" else "nccl"


def build_model(run: dict[str, Any], pad_token_id: int) -> Any:
    """The run file's randomly initialised causal LM, seeded like dplaunch seeds it."""
    from transformers import AutoConfig, AutoModelForCausalLM, set_seed

    fields = dict(run["model"]["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.pad_token_id = pad_token_id
    set_seed(run["train"]["seed"])
    return AutoModelForCausalLM.from_config(config)


def dplaunch_fuses_adamw(model: Any, run_dir: Path) -> bool:
    """Whether dplaunch's loop would use the fused AdamW kernel for this run, so the peers use the
    same optimizer implementation (it changes the speed, not the maths)."""
    from dplaunch.config.schema import RunConfig
    from dplaunch.planning.plan import Plan
    from dplaunch.train.engines import build_optimizer

    config = RunConfig.model_validate(read_run_file(run_dir))
    plan = Plan.from_dict(read_plan_file(run_dir))
    return bool(build_optimizer(model, config.train, plan).defaults.get("fused"))


class StepClock:
    """Wall-clock time after each optimizer step, one JSON line per step (written by rank 0)."""

    def __init__(self, path: Path | None):
        self._file = path.open("w", buffering=1) if path is not None else None

    def tick(self, step: int) -> None:
        if self._file is not None:
            # the process's peak resident memory so far (GB), as dplaunch's memory_gb on CPU
            peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB
            record = {"step": step, "time": time.time(), "memory_gb": round(peak_gb, 4)}
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
