"""Every DPLAUNCH_* environment variable, declared once: what the launcher tells its ranks (and a
launcher on another node) besides the run directory's files, and the fault seams the tests set.

Pure names and their readers: nothing here starts or writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# RUN/errors/: where a rank writes its traceback and, after a collective timed out, its stack
ERRORS_DIR_ENV = "DPLAUNCH_ERRORS_DIR"
# the supervising dplaunch's pid: the ranks stop when it is gone (train/rank_process.py)
SUPERVISOR_PID_ENV = "DPLAUNCH_SUPERVISOR_PID"
# launch.timeout_minutes, for scripts that build their own process group (dplaunch launch)
TIMEOUT_MINUTES_ENV = "DPLAUNCH_TIMEOUT_MINUTES"
# how many automatic restarts (launch.max_restarts) came before this launch
RESTARTS_ENV = "DPLAUNCH_RESTARTS"
# the job a `dplaunch train` belongs to, set by a launcher that starts one dplaunch per node or
# pod (Ray, Kubernetes): the key of the run directory's lock (launching/rundir.py job_identity)
JOB_ID_ENV = "DPLAUNCH_JOB_ID"
# set by `dplaunch train` for its ranks when its own output is an interactive terminal: the
# terminal's width in columns. Unset (a file, a pipe, a SLURM log): one line per logged step.
PROGRESS_ENV = "DPLAUNCH_PROGRESS"
# makes dplaunch.train.script prefix a TensorFlow worker's traceback with "[rankN]: " (torch's
# ranks get it from torch), how the launcher finds the error of the rank that failed first
TRACEBACK_PREFIX_ENV = "DPLAUNCH_TRACEBACK_PREFIX"
# set for the launchers dplaunch starts with srun: they must never start srun again
UNDER_SRUN_ENV = "DPLAUNCH_UNDER_SRUN"
# the marker file a node's launcher touches instead of exiting 75 (set by the sbatch script for
# srun, whose --kill-on-bad-exit takes any other status for a failure)
REQUEUE_MARK_ENV = "DPLAUNCH_REQUEUE_MARK"
# megabytes of a dataset the launch check reads (data/checks.py; 0: each file's first record)
DATA_CHECK_MB_ENV = "DPLAUNCH_DATA_CHECK_MB"
# megabytes a checkpoint conversion may hold in host memory at once (dplaunch/train/convert.py):
# the shards being written and the parameter being read; the state itself may be any size
CONVERT_MEMORY_ENV = "DPLAUNCH_CONVERT_MEMORY_MB"

# the tests' fault seams, read only where the fault happens (never set in a real run):
# a checkpoint save that sleeps or hits a file size limit at a step (train/checkpoint_faults.py)
CHECKPOINT_FAULT_ENV = "DPLAUNCH_TEST_CHECKPOINT_FAULT"
# a non-finite loss at a step on a rank, or its batch left out (train/nonfinite_faults.py)
NONFINITE_FAULT_ENV = "DPLAUNCH_TEST_NONFINITE"
# a folder where each rank writes the collectives of one step (train/collective_spy.py), and
# that step (1-based; default 3): what the forecast's collectives are checked against
COLLECTIVE_SPY_ENV = "DPLAUNCH_COLLECTIVE_SPY"
COLLECTIVE_SPY_STEP_ENV = "DPLAUNCH_COLLECTIVE_SPY_STEP"


def restarts_so_far(environ: Mapping[str, str] | None = None) -> int:
    """In a rank: how many automatic restarts came before this launch."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get(RESTARTS_ENV, "0"))
    except ValueError:
        return 0
