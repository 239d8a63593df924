"""Shared test helpers: the tiny models and data, running dplaunch as a user would (a process, or
its main() in this process for refusals), runs in the background, plans and model shapes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from dplaunch.launching.ports import free_port
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.run_directory.environment import CHECKPOINT_FAULT_ENV
from dplaunch.run_directory.layout import METRICS_FILE

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "examples" / "tiny-llama.yaml"
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"
# supervised fine-tuning of a tiny Llama on chat data (byte-level tokenizer, inline chat template)
SFT_CONFIG = REPO / "configs" / "sft.yaml"
# a GPT-2 with tied input/output embeddings, for the pipeline's tied-weight handling
TINY_GPT2_CONFIG = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_positions": 128,
    "vocab_size": 259,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "tie_word_embeddings": True,
}


def child_environment(**extra: str) -> dict[str, str]:
    """The environment ranks run in during tests: one thread each, no GPU, no hub access.

    Processes started without dplaunch (a test's own torchrun or DeepSpeed script) build
    DeepSpeed's ops where dplaunch's ranks do, so the suite JIT-builds them once, not twice."""
    from dplaunch.launching.deepspeed_ops import torch_extensions_dir

    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


def cpu_rank_environment(**extra: str) -> dict[str, str]:
    """child_environment plus what dplaunch sets for CPU ranks that a library reads while it is
    imported (launching/prepare.rank_environment): the suite's fork server imports with it."""
    return child_environment(DS_ACCELERATOR="cpu", **extra)


def fake_nvidia_smi(folder: Path, body: str) -> str:
    """An `nvidia-smi` shell script in ``folder`` running ``body``; returns a PATH that finds it first.

    dplaunch asks `--query-gpu=index,uuid,memory.total,compute_cap,name --format=csv,noheader,nounits`:
    ``body`` echoes rows such as "0, GPU-0a, 32768, 7.0, Tesla V100-SXM2-32GB"."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def run_dplaunch(
    *args: Any, timeout: float = 600, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`dplaunch ARGS…` in a subprocess, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "dplaunch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_environment(),
        cwd=cwd or REPO,
        check=False,
    )


def run_cli(
    *args: Any, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 0
) -> subprocess.CompletedProcess:
    """`dplaunch ARGS…` through the CLI's main() in this process, its exit status and output
    captured as run_dplaunch gives them, for what fails before any rank starts (a process start
    costs about a second). Everything a command may change in its process is set for the call and
    put back after it: os.environ (ENV, as the ranks' environment by default), the working
    directory, sys.argv, signal handlers, logging, warnings filters, and the port and GPU claims
    dplaunch holds. An exception that escapes main() comes back as its traceback on stderr with
    exit status 1, as a process would show it. (TIMEOUT is run_dplaunch's; unused here.)"""
    import contextlib
    import io
    import logging
    import signal
    import traceback
    import warnings

    from dplaunch.cli import main
    from dplaunch.launching import ports

    out, err = io.StringIO(), io.StringIO()
    saved_environ, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]
    saved_handlers = {number: signal.getsignal(number) for number in handled}
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    claims, held = len(ports._claims), set(ports._held)
    environment = env or child_environment()  # before the clear: it copies os.environ
    os.environ.clear()
    os.environ.update(environment)
    status = 0
    try:
        os.chdir(cwd or REPO)
        sys.argv = ["dplaunch", *map(str, args)]
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            with contextlib.redirect_stderr(err):
                try:
                    main()
                except SystemExit as exit:
                    code = exit.code
                    status = code if isinstance(code, int) else (0 if code is None else 1)
                    if not isinstance(code, int | None):
                        print(code, file=sys.stderr)
                except Exception:  # noqa: BLE001 — a process would print it and exit 1
                    traceback.print_exc()
                    status = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        for number, handler in saved_handlers.items():
            signal.signal(number, handler)
        root.handlers[:], root.level = saved_logging
        for handle in ports._claims[claims:]:
            os.close(handle)
        del ports._claims[claims:]
        ports._held.intersection_update(held)
    return subprocess.CompletedProcess(
        ["dplaunch", *map(str, args)], status, out.getvalue(), err.getvalue()
    )


def loopback_node_argv(
    config: Path, node_rank: int, port: int, run_dir: Path, *flags: Any, gpus: int = 2
) -> list[str]:
    """`dplaunch train` for one of 2 "nodes" of gpus/2 CPU ranks each (one by default) meeting on
    loopback (one command per node, torchrun-style)."""
    return [
        sys.executable, "-m", "dplaunch", "train", str(config), "--cpu", "--gpus", str(gpus),
        "--nodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
        "--master-port", str(port), *map(str, flags), "-o", str(run_dir),
    ]  # fmt: skip


def run_loopback_nodes(
    config: Path,
    run_dir: Path,
    *flags: Any,
    gpus: int = 2,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Both loopback "nodes" of loopback_node_argv on PORT (unset: a free one), run to the end;
    their outputs (each must exit 0)."""
    port = port or free_port()
    nodes = [
        subprocess.Popen(
            loopback_node_argv(config, rank, port, run_dir, *flags, gpus=gpus),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env or child_environment(),
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for rank, node in enumerate(nodes):
        assert node.returncode == 0, f"node {rank}:\n{outputs[rank][-4000:]}"
    return outputs


def one_rank_script(script: str, *args: str) -> Any:
    """Run SCRIPT (python -c, e.g. a one-rank DeepSpeed process) with ARGS in the ranks'
    environment; the JSON of its last output line."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=child_environment(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def refusal_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """The one `dplaunch: error:` line of a refused command (exit 2, no traceback), holding every
    expected text."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dplaunch: error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def files_under(root: Path) -> list[str]:
    """Every path below ``root``, to show that a refused command wrote nothing."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl."""
    return [
        json.loads(line)
        for line in (run_dir / METRICS_FILE).read_text().splitlines()
        if line.strip()
    ]


def train_losses(run_dir: Path) -> list[float]:
    """Per-step losses (log_every must be 1)."""
    return [r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"]


def train(
    run_dir: Path,
    *args: Any,
    config: Path = TINY_LLAMA,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `dplaunch train CONFIG -o run_dir ARGS…` and insist that it succeeds."""
    result = run_dplaunch("train", config, "-o", run_dir, *args, timeout=timeout, env=env)
    assert result.returncode == 0, (
        f"dplaunch train failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def write_config(path: Path, base: Path = TINY_LLAMA, **sections: dict[str, Any]) -> Path:
    """A run file derived from ``base`` with some sections' keys replaced."""
    data = yaml.safe_load(base.read_text())
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {})
            data[section].update(values)
        else:
            data[section] = values
    path.write_text(yaml.safe_dump(data))
    return path


def max_relative_gap(left: list[float], right: list[float]) -> float:
    """Largest |a − b| / |b| over paired steps."""
    assert len(left) == len(right) and left, (left, right)
    return max(abs(a - b) / abs(b) for a, b in zip(left, right, strict=True))


def sbatch_options(script: str) -> dict[str, str | None]:
    """The #SBATCH options of a script, parsed like sbatch does for these simple cases."""
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --") :].partition("=")
            options[name] = value or None
    return options


def cache_hub_dataset(
    hf_home: Path,
    name: str,
    config: str,
    splits: dict[str, dict[str, list]],
    class_names: dict[str, list[str]] | None = None,
    shards: int = 1,
) -> Path:
    """Put hub dataset NAME (configuration CONFIG) into HF_HOME's datasets cache as `datasets`
    prepares a download: <namespace>___<snake_name>/<config>/0.0.0/<hash>/ with dataset_info.json
    and each split in SHARDS Arrow stream files. Offline, `load_dataset(NAME, CONFIG)` reads it
    (the hub-data tests train on it). CLASS_NAMES makes those columns ClassLabels; the others
    are typed from their values. Returns the folder."""
    import pyarrow as pa
    from datasets import ClassLabel, Dataset, DatasetInfo, Features, SplitDict, SplitInfo
    from datasets.naming import camelcase_to_snakecase

    snake = camelcase_to_snakecase(name.split("/")[-1])
    folder = hf_home / "datasets" / "___".join([*name.split("/")[:-1], snake]) / config
    folder = folder / "0.0.0" / "5d1c0ffee"
    folder.mkdir(parents=True)
    features = None
    split_dict = SplitDict(dataset_name=snake)
    for split, columns in splits.items():
        if features is None:
            typed = Dataset.from_dict(columns).features
            features = Features(
                {
                    column: ClassLabel(names=(class_names or {})[column])
                    if column in (class_names or {})
                    else feature
                    for column, feature in typed.items()
                }
            )
        dataset = Dataset.from_dict(columns, features=features)
        table = dataset.data.table
        bounds = [len(dataset) * shard // shards for shard in range(shards + 1)]
        lengths = [bounds[i + 1] - bounds[i] for i in range(shards)]
        for shard in range(shards):
            suffix = f"-{shard:05d}-of-{shards:05d}" if shards > 1 else ""
            with pa.OSFile(str(folder / f"{snake}-{split}{suffix}.arrow"), "wb") as sink:
                with pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table.slice(bounds[shard], lengths[shard]), max_chunksize=4)
        split_dict.add(
            SplitInfo(
                name=split,
                num_bytes=table.nbytes,
                num_examples=len(dataset),
                shard_lengths=lengths if shards > 1 else None,
                dataset_name=snake,
            )
        )
    DatasetInfo(
        features=features, splits=split_dict, config_name=config, dataset_name=snake
    ).write_to_directory(str(folder))
    return folder


def option_choices(command: str, option: str) -> list[str]:
    """The values a command's option accepts: the Literal its typer parameter is typed with."""
    import inspect
    import typing

    from dplaunch.cli import COMMANDS

    for parameter in inspect.signature(COMMANDS[command]).parameters.values():
        annotation = parameter.annotation
        info = annotation.__metadata__[0]  # in Annotated, typer.Option's first name is its default
        if option in (info.default, *(info.param_decls or ())):
            choices = typing.get_args(annotation)[0]  # Literal[...] or Literal[...] | None
            if typing.get_origin(choices) is not typing.Literal:
                choices = next(a for a in typing.get_args(choices) if a is not type(None))
            return list(typing.get_args(choices))
    raise KeyError(option)


def spy_environment(run_dir: Path, **extra: str) -> dict[str, str]:
    """The ranks' environment with the collective spy on (dplaunch/train/collective_spy.py): rank
    R writes RUN_DIR.collectives/rank-R.json, the collectives of step 3, beside the run directory."""
    from dplaunch.run_directory.environment import COLLECTIVE_SPY_ENV

    return child_environment(**{COLLECTIVE_SPY_ENV: str(collectives_folder(run_dir))}, **extra)


def collectives_folder(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.collectives"


def assert_forecast_collectives(run_dir: Path) -> None:
    """Rank 0's collectives of the spied step (groups of more than one rank) are, op by op and
    byte for byte, those the forecast counts for the run's layout (planning/forecast.py)."""
    from collections import Counter
    from dataclasses import replace

    from dplaunch.config.schema import RunConfig
    from dplaunch.launching.prepare import model_facts
    from dplaunch.planning.auto import run_workload
    from dplaunch.planning.forecast import step_collectives
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.files import read_plan_file, read_run_file

    config = RunConfig.model_validate(read_run_file(run_dir))
    plan = Plan.from_dict(read_plan_file(run_dir))
    workload = replace(run_workload(config), micro_batch=plan.micro_batch_size)
    forecast = step_collectives(
        model_facts(config.model),
        plan.dims,
        workload,
        guard=config.train.on_nonfinite != "off",
        clip=config.train.max_grad_norm > 0,
    )
    expected = Counter((c.op, int(c.bytes), c.ranks) for c in forecast)
    spied = json.loads((collectives_folder(run_dir) / "rank-0.json").read_text())["collectives"]
    seen = Counter((c["op"], c["bytes"], len(c["ranks"])) for c in spied if len(c["ranks"]) > 1)
    assert seen == expected, (
        f"spied but not forecast: {dict(seen - expected)}; forecast but not spied: "
        f"{dict(expected - seen)}"
    )


# ---------------------------------------------------------------- runs in the background

# two CPU ranks of plain data parallelism
DDP = ("--cpu", "--gpus", "2")
# the checkpoint faults a rank injects (train/checkpoint_faults.py): "STEP:KIND=VALUE"
FAULT = CHECKPOINT_FAULT_ENV


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Per-step losses over all launches of a run; a step logged again after a resume wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"}


def latest(run_dir: Path) -> str:
    """The name of a run's newest complete checkpoint (checkpoints/latest)."""
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def start_train(
    run_file: Path, run_dir: Path, *args: str, slurm_step: bool = False, **env: str
) -> subprocess.Popen:
    """`dplaunch train` in the background (a process we can signal), output in run_dir.log.

    slurm_step: in a process group of its own (signal them all, as SLURM signals a step), with
    SIGUSR1 ignored, as the bash wrapper of dplaunch's SLURM script leaves it."""
    log = open(f"{run_dir}.log", "w")  # noqa: SIM115 — closed with the process by finish_train()
    return subprocess.Popen(
        [sys.executable, "-m", "dplaunch", "train", str(run_file), "-o", str(run_dir), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_environment(**env),
        cwd=REPO,
        text=True,
        start_new_session=slurm_step,
        preexec_fn=(lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN)) if slurm_step else None,
    )


def finish_train(process: subprocess.Popen, run_dir: Path, timeout: float = 300) -> tuple[int, str]:
    """Wait for a start_train run; its exit status and log."""
    code = process.wait(timeout=timeout)
    return code, Path(f"{run_dir}.log").read_text()


def wait_while_running(
    condition, what: str, process: subprocess.Popen, timeout: float = 240
) -> None:
    """Wait for CONDITION; fail when PROCESS ends first or TIMEOUT passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"dplaunch ended ({process.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def rank_pids(run_dir: Path) -> dict[int, int]:
    """PID of each training rank of a run (the processes running `dplaunch.train RUN_DIR`)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dplaunch.train" in argv and str(run_dir.absolute()).encode() in argv:
            for item in environ:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = int(entry.name)
    return pids


def start_dplaunch(
    tmp: Path, *args, env: dict[str, str] | None = None, cwd: Path = REPO, umask=None
):
    """`dplaunch ARGS…` in the background, output to files (read with `output`)."""
    out, err = (tmp / "dplaunch.out").open("w"), (tmp / "dplaunch.err").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "dplaunch", *map(str, args)],
        stdout=out,
        stderr=err,
        env=env or child_environment(),
        cwd=cwd,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


def output(tmp: Path) -> tuple[str, str]:
    """(stdout, stderr) of a start_dplaunch process so far."""
    return (tmp / "dplaunch.out").read_text(), (tmp / "dplaunch.err").read_text()


def run_processes(marker: str) -> list:
    """Live processes whose command line mentions ``marker`` (a run dir or script in tmp_path)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == os.getpid():
                continue
            if marker in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except psutil.Error:
            continue
    return found


def wait_for(condition, timeout: float, what: str):
    """CONDITION's first true value, asked every 0.2 s; fail after TIMEOUT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def last_line(text: str) -> str:
    """The last line of TEXT that is not blank."""
    return [line for line in text.splitlines() if line.strip()][-1]


# ---------------------------------------------------------------- TensorFlow-style workers

# what every worker script starts with: its TF_CONFIG index, and say() that prints at once
WORKER_PRELUDE = """
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
def say(text):
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()
say(f"worker {index} ready")
"""
# a worker body that prints its TF_CONFIG and visible devices
PRINTS_TF_CONFIG = """
say("TF_CONFIG " + os.environ["TF_CONFIG"])
say("DEVICES " + repr(os.environ["CUDA_VISIBLE_DEVICES"]))
"""


def worker_script(tmp: Path, name: str, body: str) -> Path:
    """A TensorFlow-style worker script in TMP: WORKER_PRELUDE, then BODY."""
    path = tmp / name
    path.write_text(WORKER_PRELUDE + body)
    return path


def tf_configs(stdout: str) -> list[dict]:
    """The TF_CONFIG each worker printed (PRINTS_TF_CONFIG), by worker index."""
    found = [json.loads(line[10:]) for line in stdout.splitlines() if line.startswith("TF_CONFIG ")]
    return sorted(found, key=lambda config: config["task"]["index"])


# ---------------------------------------------------------------- plans and model shapes

# a small Llama's shape (4 layers, 4 heads, 2 KV heads), as config.json gives it
LLAMA = ModelFacts.from_config_dict(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 259,
    }
)


def plan_for(gpus=None, visible=0, render_only=False, model=None, **kwargs):
    """make_plan for GPUS (VISIBLE of them here) with launch/parallel/train keys as KWARGS."""
    from dplaunch.config.schema import LaunchConfig, ParallelConfig, TrainConfig
    from dplaunch.planning.plan import Machine, make_plan

    launch = LaunchConfig(
        gpus=gpus, **{k: v for k, v in kwargs.items() if k in LaunchConfig.model_fields}
    )
    parallel = ParallelConfig(
        **{k: v for k, v in kwargs.items() if k in ParallelConfig.model_fields}
    )
    train = TrainConfig(**{k: v for k, v in kwargs.items() if k in TrainConfig.model_fields})
    return make_plan(
        launch, parallel, train, Machine(visible_gpus=visible, render_only=render_only), model
    )


def synthetic_profile(device: str = "CPU test", per_node: int = 2, **changes: Any):
    """A hardware profile of round numbers for in-process forecasts: one dense and one attention
    rate, every collective 200 µs + 1 GB/s, no overlap, no measured overheads (``changes``: any
    field, e.g. dense=…, overheads=…)."""
    import dataclasses

    from dplaunch.planning.profiles import (
        CALIBRATED,
        OPS,
        AttentionPoint,
        DensePoint,
        Link,
        Profile,
    )

    dtypes = ("fp32", "bf16")
    profile = Profile(
        device=device,
        devices_per_node=per_node,
        nodes=1,
        interconnect="shared memory",
        source=CALIBRATED,
        peak_flops=dict.fromkeys(dtypes, 1e11),
        dense=tuple(DensePoint(dtype, 256, 256, 5e10) for dtype in dtypes),
        attention=tuple(AttentionPoint("sdpa", dtype, 128, 2e10) for dtype in dtypes),
        collectives={"intra": {op: Link(2e-4, 1e9) for op in OPS}},
        overlap=0.0,
        optimizer_s_per_param=2e-9,
        cpu_adam_s_per_param=1e-9,
        host_device_bytes_per_s=5e9,
    )
    return dataclasses.replace(profile, **changes)


def llama_facts(hidden: int, layers: int, heads: int = 4) -> ModelFacts:
    """The facts of a Llama of HIDDEN × LAYERS (the byte-level vocabulary, untied head)."""
    return ModelFacts.from_config_dict(
        {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": hidden * 8 // 3 // 8 * 8,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "vocab_size": 259,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
        }
    )


def ranks(dp: int = 1, tp: int = 1, pp: int = 1, sp: int = 1, **layout: Any):
    """The layout of dp × tp × pp (× sp) ranks on one node, as the estimate takes it."""
    from dplaunch.planning.rules import ParallelDims

    world = dp * tp * pp * sp
    return ParallelDims(world, world, tp, pp, sp=sp, **layout)


# a 7B Llama's config.json (never built: the planner reads shapes only)
LLAMA_7B = dict(
    model_type="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
)


def llama_7b_run_file(path: Path, parallel: object = "auto", **train: object) -> Path:
    """A run file for a 7B Llama config (never built here) with the tiny-llama data."""
    data = yaml.safe_load(TINY_LLAMA.read_text())
    data["name"] = "llama-7b"
    data["model"]["config"] = dict(LLAMA_7B)
    data["data"]["max_length"] = 2048
    data["train"].update(
        {"global_batch_size": 16, "micro_batch_size": 1, "mixed_precision": "bf16"}
    )
    data["train"].update(train)
    data["parallel"] = parallel
    path.write_text(yaml.safe_dump(data))
    return path


def run_config(path: Path, *assignments: str):
    """The RunConfig of the run file PATH with --set ASSIGNMENTS."""
    from dplaunch.config.load import build_run_config

    data = yaml.safe_load(path.read_text())
    return build_run_config(data, assignments=list(assignments), base_dir=path.parent)


# ---------------------------------------------------------------- what a command imports

HEAVY = ("torch", "accelerate", "deepspeed", "transformers", "datasets")


def heavy_imports(*args: Any, env: dict[str, str] | None = None) -> list[str]:
    """The libraries of HEAVY that `dplaunch ARGS…` imported, run in a fresh process (whatever
    its exit status): the command line must stay fast and torch-free until ranks start."""
    probe = (
        "import sys\n"
        f"sys.argv = ['dplaunch', *{[str(arg) for arg in args]!r}]\n"
        "from dplaunch.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env or child_environment(),
        check=False,
    )
    line = next((x for x in result.stderr.splitlines() if x.startswith("HEAVY ")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(line[len("HEAVY ") :].replace("'", '"'))


@contextlib.contextmanager
def one_rank_fsdp_engine(config: Any, guard_mode: str | None = None) -> Iterator[Any]:
    """The FSDP engine of CONFIG (a RunConfig) on one CPU rank in this process: the same
    fully_shard, DTensor parameters and collectives as a launched rank, over a group of one that
    is destroyed afterwards (with the "[rank0]:" excepthook torch installs with it: later tests
    of this process print their own tracebacks). ``guard_mode``: train.on_nonfinite's guard,
    attached as the loop does."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from dplaunch.planning.plan import Machine, make_plan
    from dplaunch.train.fsdp import FsdpEngine
    from dplaunch.train.modeling import load_model, load_tokenizer
    from dplaunch.train.nonfinite import NonFiniteGuard

    parallel = config.parallel.model_copy(update={"fsdp": "full"})
    launch = config.launch.model_copy(update={"cpu": True, "gpus": 1})
    plan = make_plan(launch, parallel, config.train, Machine())
    model = load_model(config.model, load_tokenizer(config.model), seed=config.train.seed)
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    excepthook = sys.excepthook
    try:
        engine = FsdpEngine(
            accelerator, model, plan, config, lambda _: SimpleNamespace(step=lambda: None)
        )
        if guard_mode is not None:
            engine.guard = NonFiniteGuard(guard_mode, 3, accelerator, plan.mixed_precision)
        yield engine
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = excepthook
