"""Shared test fixtures: the tiny models and data, and running dplaunch as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

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
    import subprocess

    from dplaunch.launching.ports import free_port

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
    from dplaunch.train.collective_spy import SPY_ENV

    return child_environment(**{SPY_ENV: str(collectives_folder(run_dir))}, **extra)


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
    from dplaunch.planning.rules import ParallelDims
    from dplaunch.run_directory.files import read_plan_file, read_run_file

    config = RunConfig.model_validate(read_run_file(run_dir))
    plan = Plan.from_dict(read_plan_file(run_dir))
    dims = ParallelDims(
        plan.world_size,
        plan.processes_per_node,
        plan.tensor_parallel_size,
        plan.pipeline_parallel_size,
        plan.zero_stage,
        plan.offload,
        fsdp=plan.fsdp,
        sp=plan.sequence_parallel_size,
    )
    workload = replace(run_workload(config), micro_batch=plan.micro_batch_size)
    forecast = step_collectives(
        model_facts(config.model),
        dims,
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
