"""Which experiment trackers train.report_to may name, and the package each needs.

The launcher checks before launch that each named tracker can be imported (the ranks would fail at
start); rank 0 opens them (dplaunch.train.trackers).
"""

from __future__ import annotations

import importlib.util

from dplaunch.errors import UserError

# what train.report_to may name besides "tensorboard": the module each imports, the package
# that brings it
EXTERNAL_TRACKERS = {
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "trackio": ("trackio", "trackio"),
}


def check_trackers_installed(report_to: list[str]) -> None:
    """Refuse, before launch, a tracker whose package is missing (the ranks would fail at start)."""
    missing = [
        EXTERNAL_TRACKERS[name][1]
        for name in report_to
        if name in EXTERNAL_TRACKERS
        and importlib.util.find_spec(EXTERNAL_TRACKERS[name][0]) is None
    ]
    if missing:
        raise UserError(
            "train.report_to",
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed",
            f"pip install {' '.join(missing)} (or 'dplaunch[trackers]'), or leave "
            f"{'it' if len(missing) == 1 else 'them'} out of train.report_to",
        )
