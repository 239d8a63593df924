"""Experiment trackers beside metrics.jsonl (train.report_to), opened by rank 0.

wandb, MLflow and Trackio go through Accelerate's tracker classes; TensorBoard stays dplaunch's
own writer (RUN/tensorboard/, as before). Each gets the run's resolved run file as its config
and the same scalars as metrics.jsonl (`train/loss`, `eval/eval_loss`…, at their step), under
the run directory's name. Credentials stay where the user keeps them (WANDB_API_KEY, the
MLflow server's variables): the trackers read them from the environment, and dplaunch writes no
environment variable into the run directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dplaunch.config.trackers import EXTERNAL_TRACKERS
from dplaunch.run_directory.layout import MLFLOW_DIR


def open_trackers(report_to: list[str], run_dir: Path, config: dict[str, Any]) -> list[Any]:
    """Started Accelerate trackers for the external names in REPORT_TO, config stored."""
    trackers = []
    name = run_dir.name
    for wanted in report_to:
        if wanted not in EXTERNAL_TRACKERS:
            continue
        tracker = _tracker(wanted, name, run_dir)
        tracker.start()
        tracker.store_init_configuration(flat_config(config))
        trackers.append(tracker)
    return trackers


def _tracker(kind: str, name: str, run_dir: Path) -> Any:
    from accelerate.tracking import MLflowTracker, TrackioTracker, WandBTracker

    if kind == "wandb":
        # the project from WANDB_PROJECT (else "dplaunch"); the run's files in the run directory
        # unless WANDB_DIR says otherwise; WANDB_MODE=offline works as wandb documents it
        project = os.environ.get("WANDB_PROJECT", "dplaunch")
        return WandBTracker(
            project, name=name, dir=os.environ.get("WANDB_DIR", str(run_dir.absolute()))
        )
    if kind == "mlflow":
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # mlflow's own default is a database in the working directory (which mlflow-skinny
            # cannot open): a file store in the run directory instead
            # the run directory keeps the run in one place (mlflow 3 wants this opt-in for a
            # file store, which it keeps in maintenance; a server or database is the user's call)
            import mlflow

            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / MLFLOW_DIR).absolute().as_uri())
        # MLFLOW_EXPERIMENT_NAME, MLFLOW_TAGS… are read by Accelerate's tracker
        return MLflowTracker(experiment_name="dplaunch", run_name=name)
    # trackio: the project from TRACKIO_PROJECT (else "dplaunch"), stored locally unless
    # trackio is told of a Space
    return TrackioTracker(os.environ.get("TRACKIO_PROJECT", "dplaunch"), name=name)


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The run file as flat `section.key` values (MLflow's parameters are flat strings)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = (
                value if isinstance(value, (bool, int, float, str)) else str(value)
            )
    return flat
