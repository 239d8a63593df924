"""Every name in a run directory, declared once: the launcher writes and the ranks read by these.

    RUN/
      run.yaml, plan.json   the resolved run file and the plan (the ranks do what was printed)
      deepspeed.json        DeepSpeed's config, when the plan uses DeepSpeed
      accelerate.yaml       `accelerate launch --config_file` (accelerate-nodeR.yaml on node R > 0)
      launch.sh             the exact launch command (launch-nodeR.sh on node R > 0)
      resume.json           the checkpoint the ranks continue from (written by every `dplaunch train`)
      dplaunch.lock         the live job writing here: its key, dplaunch's pid and host (removed at its end)
      stopped.json          why rank 0 stopped before the last step (read by `dplaunch train`)
      metrics.jsonl         one record per line, rank 0 only; tensorboard/ mirrors its scalars
      errors/rank-N.txt     the traceback of a failing rank
      errors/build-OP.txt   the output of the launcher's build of DeepSpeed's op OP
      checkpoints/          complete step-N/ folders, `latest`, saves in progress (see below)
      model/                the trained model a finished run exports (save_pretrained); merged under LoRA
      adapter/              a LoRA run's adapter, a PEFT folder (PeftModel.from_pretrained(base, adapter/))
        base/               its untrained base when that is randomly initialised (model.config)
      model-last/           with train.keep_best and train.export_last: the last step (model/ is
      adapter-last/         the best evaluation's checkpoint); adapter-last/ under LoRA
      job.sbatch, logs/     the SLURM job's script and logs (`dplaunch slurm`)
      trainjob.yaml         the Kubernetes job's manifests (`dplaunch k8s`; pytorchjob.yaml)
      .requeue-JOBID        a job's ranks checkpointed to be requeued (in logs/ from job.sbatch)

    RUN/checkpoints/
      step-4/               complete: every rank finished writing before it got this name
        checkpoint.json     the data position (step, epoch), the layout that wrote it, and the size
                            and CRC-32 of every other file (checked before a resume); written last
        run.yaml, plan.json the resolved run file and plan of the run that wrote it
        hf/                 the model's HF config files and tokenizer (`dplaunch export` needs no Hub)
        pytorch_model/      DeepSpeed's checkpoint under ZeRO/TP (pipeline/ for the pipeline engine)
        rng-rank-N.pt       every rank's RNG, for engines whose own save has none
        data-position-N.json  data.streaming: where data-parallel rank N's lanes stand
      latest                "step-4": the newest complete checkpoint
      .tmp-step-6/          a save in progress (or killed): never read, removed by the next save
      universal-step-4/     step-4 re-sharded for another data-parallel size; `done` when finished
      damaged-step-8/       a checkpoint whose files did not verify, set aside (never deleted)

Pure names: no file is read or written here (dplaunch.run_directory.files does that).
"""

from __future__ import annotations

import re
from collections.abc import Callable

RUN_FILE = "run.yaml"
PLAN_FILE = "plan.json"
DEEPSPEED_FILE = "deepspeed.json"
ACCELERATE_FILE = "accelerate.yaml"
LAUNCH_SCRIPT = "launch.sh"
# the launcher tells the ranks where to resume from (always written by `dplaunch train`)
RESUME_FILE = "resume.json"
# rank 0 says why it stopped before the last step (signal or train.stop_after_steps)
STOP_FILE = "stopped.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# RUN/errors/rank-N.txt: the traceback of a failing rank (written by dplaunch.train.__main__)
ERRORS_DIR = "errors"
CHECKPOINTS_DIR = "checkpoints"
# RUN/model: the trained model a finished run exports (save_pretrained)
EXPORT_DIR = "model"
# RUN/adapter: a LoRA run's trained adapter (peft's save_pretrained: adapter_config.json,
# adapter_model.safetensors); RUN/model then holds the adapter merged into the base
ADAPTER_DIR = "adapter"
# RUN/adapter/base: the untrained base of a LoRA run on a model.config (random init), which
# exists nowhere else; the adapter's base_model_name_or_path names it
BASE_MODEL_DIR = "base"
# train.export_last beside train.keep_best: the last step's export (EXPORT_DIR is the best's)
EXPORT_LAST_DIR = "model-last"
ADAPTER_LAST_DIR = "adapter-last"
# `dplaunch slurm`: RUN/job.sbatch and the job's RUN/logs/
SBATCH_SCRIPT = "job.sbatch"
LOGS_DIR = "logs"
# `dplaunch k8s`: the job's manifests (a TrainJob, or with --kind pytorchjob a PyTorchJob, after
# the ConfigMap of the run file), one file for `kubectl apply -f`
TRAINJOB_FILE = "trainjob.yaml"
PYTORCHJOB_FILE = "pytorchjob.yaml"
# + the SLURM job id: the job's ranks checkpointed on the time-limit signal, so requeue it
REQUEUE_MARK_PREFIX = ".requeue-"
# held while a job writes the run directory: a second job is refused (launching/rundir.py)
RUN_LOCK_FILE = "dplaunch.lock"
# files a finished or running training run leaves; their presence means "this is a run"
RUN_MARKERS = (METRICS_FILE, CHECKPOINTS_DIR)
# where runs go without --output-dir: runs/NAME-YYYYmmdd-HHMMSS (relative to the working directory)
DEFAULT_RUNS_DIR = "runs"
# `dplaunch verify`'s run directory: the plan's run and the pure-DDP one it is compared with
VERIFY_PLAN_DIR = "plan"
VERIFY_REFERENCE_DIR = "dp"
# `dplaunch report`'s default folder (RUN/report/) and its text summary beside the plots
REPORT_DIR = "report"
REPORT_SUMMARY_FILE = "summary.txt"
# train.report_to mlflow: the local tracking store in RUN/mlruns/
MLFLOW_DIR = "mlruns"
# `dplaunch launch` of TensorFlow/Horovod scripts: the workers this node's launcher starts
WORKERS_FILE = "workers.json"
# the nodes' automatic-restart agreement: RUN/restarts/attempt-N/node-R.json and decision.json
RESTARTS_DIR = "restarts"
RESTART_DECISION_FILE = "decision.json"
# RUN/errors/: written by the supervisor that saw a collective time out; the other nodes'
# supervisors watch for it and have their ranks dump their stacks too
STACKS_REQUEST_FILE = "dump-stacks.request"
# RUN/errors/: NCCL's flight recorder dumps of the last collectives (torch appends the rank)
NCCL_TRACE_FILE_PREFIX = "nccl-trace-rank-"
# `dplaunch doctor`'s write test in the run directory (+ host name and pid), removed after it
DOCTOR_PROBE_PREFIX = ".doctor-write-"
# `dplaunch doctor` and `dplaunch calibrate`: the folder their ranks run in (RUN/doctor/,
# RUN/calibrate/; without -o runs/doctor, and calibrate's in the user's cache) and the file
# their ranks report to; calibrate keeps its ranks' output in a log
DOCTOR_DIR = "doctor"
DOCTOR_RESULT_FILE = "all-reduce.json"
CALIBRATE_DIR = "calibrate"
CALIBRATE_RESULT_FILE = "measurements.json"
CALIBRATE_LOG_FILE = "ranks.log"

# inside RUN/checkpoints/
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
# the model's HF config (config.json, generation_config.json) and tokenizer, in every checkpoint:
# `dplaunch export` builds the model from them, without the pretrained weights or the Hub
MODEL_FILES_DIR = "hf"
TEMP_PREFIX = ".tmp-"
# a committed checkpoint whose files do not verify, set aside by the launcher (never deleted):
# RUN/checkpoints/damaged-step-N, no longer read, rotated or replaced
DAMAGED_PREFIX = "damaged-"
# a ZeRO checkpoint converted for another data-parallel size: RUN/checkpoints/universal-step-N
UNIVERSAL_PREFIX = "universal-"
# written last into a universal conversion: what it was made from
UNIVERSAL_DONE_FILE = "done"
# the universal form of a checkpoint (dplaunch/train/universal.py): its description, the fp32
# weights (an HF weights folder) and the optimizer state, by the model's own parameter names
UNIVERSAL_FILE = "universal.json"
UNIVERSAL_MODEL_DIR = "model"
UNIVERSAL_OPTIMIZER_DIR = "optimizer"
# accelerate's tag of the DeepSpeed checkpoint inside save_state's directory
DEEPSPEED_TAG = "pytorch_model"
# the pipeline engine's tag (dplaunch/train/pipeline.py)
PIPELINE_TAG = "pipeline"
# the FSDP engine's torch.distributed.checkpoint folder (every rank's shards + .metadata) and its
# scheduler / loss-scaler state (dplaunch/train/fsdp.py)
FSDP_TAG = "fsdp"
FSDP_TRAINER_FILE = "trainer_state.pt"

STEP_DIR = re.compile(r"^step-(\d+)$")


def node_file(name: str, node_rank: int) -> str:
    """NAME on node 0, NAME-nodeR on node R > 0 (nodes may share the run directory)."""
    if node_rank == 0:
        return name
    stem, dot, suffix = name.partition(".")
    return f"{stem}-node{node_rank}{dot}{suffix}"


def restart_attempt_dir(attempt: int) -> str:
    """RUN/restarts/attempt-N: the nodes' failures and node 0's decision for restart N."""
    return f"attempt-{attempt}"


def node_failure_file(node_rank: int) -> str:
    """What node R's launch failed of, in its restart attempt's folder."""
    return f"node-{node_rank}.json"


def step_dir(step: int) -> str:
    """The name of the complete checkpoint of STEP."""
    return f"step-{step}"


def rank_error_file(rank: int | str) -> str:
    """The traceback file of a failing rank, in RUN/errors/."""
    return f"rank-{rank}.txt"


def op_build_log_file(op: str) -> str:
    """RUN/errors/build-OP.txt: the output of the launcher's build of a DeepSpeed op."""
    return f"build-{op}.txt"


def rank_stacks_file(rank: int | str) -> str:
    """RUN/errors/stacks-rank-N.txt: a rank's Python stack, dumped when a collective timed out."""
    return f"stacks-rank-{rank}.txt"


def rank_of(file_name: str, name_of: Callable[[int | str], str]) -> int | None:
    """The rank whose file (as ``name_of`` names it, e.g. rank_error_file) FILE_NAME is; None when
    it is not one of those files."""
    prefix, suffix = name_of("*").split("*")
    if not (file_name.startswith(prefix) and file_name.endswith(suffix)):
        return None
    rank = file_name[len(prefix) : len(file_name) - len(suffix)]
    return int(rank) if rank.isdigit() else None


def data_position_file(data_parallel_rank: int) -> str:
    """A stream's position inside a checkpoint: where one data-parallel rank's lanes stand."""
    return f"{DATA_POSITION_PREFIX}{data_parallel_rank}.json"


DATA_POSITION_PREFIX = "data-position-"


def digests_part_file(rank: int | str) -> str:
    """A save in progress: the sizes and digests of the files rank RANK read back (merged into
    checkpoint.json by rank 0, then removed)."""
    return f".digests-rank-{rank}.json"


def rng_state_file(rank: int) -> str:
    """A rank's RNG state file inside a checkpoint."""
    return f"rng-rank-{rank}.pt"
