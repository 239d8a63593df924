"""What a process dplaunch starts does not import: DeepSpeed's optional MLflow.

`import deepspeed` runs deepspeed.autotuning.autotuner, which imports MLflow whenever it is
installed (the [trackers] extra installs it) to log autotuning trials. MLflow brings fastapi,
starlette, opentelemetry and the Databricks SDK: measured 1.5 s of the 1.9 s that importing
DeepSpeed takes (mlflow-skinny 3.18, deepspeed 0.19.8, this machine, python -X importtime). Every
rank imports DeepSpeed — DeepSpeed's engines directly, the others through Accelerate's
unwrap_model — and no rank runs DeepSpeed's autotuner.

While DeepSpeed's package runs its import, MLflow counts as not installed (the autotuner catches
the ImportError and sets has_mlflow = False). Before and after, nothing changes: a run that
reports to MLflow imports it as usual, and a process that imported MLflow first keeps it.
"""

from __future__ import annotations

import importlib.abc
import sys

# the package whose import skips the optional imports below, and those imports
SKIPPING_PACKAGE = "deepspeed"
SKIPPED_IMPORTS = frozenset({"mlflow"})


class SkipWhileImporting(importlib.abc.MetaPathFinder):
    """A finder that refuses SKIPPED_IMPORTS while SKIPPING_PACKAGE's own import is running."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 — importlib's signature
        if name in SKIPPED_IMPORTS and _initializing(SKIPPING_PACKAGE):
            raise ModuleNotFoundError(
                f"{name} is not imported while {SKIPPING_PACKAGE} is (dplaunch.train.lean_imports)",
                name=name,
            )
        return None


def _initializing(package: str) -> bool:
    # the import system marks a module's spec while its body runs (CPython importlib._bootstrap:
    # spec._initializing, set around exec_module since 3.4)
    module = sys.modules.get(package)
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def skip_unused_imports() -> None:
    """Install the finder in this process (once; first, so it is asked before the path)."""
    if not any(isinstance(finder, SkipWhileImporting) for finder in sys.meta_path):
        sys.meta_path.insert(0, SkipWhileImporting())
