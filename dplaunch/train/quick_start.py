"""What makes a rank start sooner: no import it never uses, no garbage collection while it starts.

Imports. `import deepspeed` runs deepspeed.autotuning.autotuner, which imports MLflow whenever it is
installed (the [trackers] extra installs it) to log autotuning trials. MLflow brings fastapi,
starlette, opentelemetry and the Databricks SDK: measured 1.5 s of the 1.9 s that importing
DeepSpeed takes (mlflow-skinny 3.18, deepspeed 0.19.8, this machine, python -X importtime). Every
rank imports DeepSpeed — DeepSpeed's engines directly, the others through Accelerate's
unwrap_model — and no rank runs DeepSpeed's autotuner.

While DeepSpeed's package runs its import, MLflow counts as not installed (the autotuner catches
the ImportError and sets has_mlflow = False). Before and after, nothing changes: a run that
reports to MLflow imports it as usual, and a process that imported MLflow first keeps it.

Garbage collection. Importing torch, transformers, Accelerate, datasets and DeepSpeed creates
about 760,000 objects; the cyclic collector runs over and over meanwhile (its thresholds count
allocations) and finds almost nothing to free: 0.8 of the 4.1 s these imports take in one
process on this machine. A training rank pauses the collector from its first line until its
engine is ready, then collects once, moves what start-up built (modules, the model, the
libraries' objects) out of the collector's sight (gc.freeze) and resumes it: the training
steps' collections no longer walk start-up's objects either. Reference counting frees memory
as usual meanwhile; only cycles wait for the one collection. That collection would walk every
object too (0.40 s of a tiny DDP rank's start): the objects of the libraries the rank imported
before building anything (torch, Accelerate, transformers, datasets) are frozen as soon as they
are imported, so it walks only what came after — 306,000 objects instead of 736,000, 0.15 s.
What those imports left as garbage stays (about 11,000 small objects, what a full collection after
every import frees); the model, the data and the engine, built after, are collected as before.
"""

from __future__ import annotations

import gc
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
                f"{name} is not imported while {SKIPPING_PACKAGE} is (dplaunch.train.quick_start)",
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


def pause_collector() -> None:
    """No cyclic garbage collection until resume_collector(): a rank's start-up."""
    gc.disable()


def freeze_imports() -> None:
    """Keep the objects that exist now (the libraries' modules, classes and functions, which
    never become garbage) out of resume_collector's collection: called once they are imported,
    before the rank builds its model, data and engine."""
    gc.freeze()


def resume_collector() -> None:
    """Collect start-up's cycles once, keep what remains out of later collections, resume."""
    gc.collect()
    gc.freeze()
    gc.enable()
