"""The run-file keys a command-line flag sets, declared once.

Each row names the flag, the dotted run-file key it overrides, its --help line and the kind of value
it takes. From this table come the commands' options (dplaunch/cli.py), the flag → `--set` overrides
(launching/prepare.py `RunFlags`) and the flag column of docs/reference.md (config/reference.py);
the key's type, default and description are the schema's (config/schema.py). No pydantic or typer
here: `dplaunch --help` reads this table and must stay fast.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

# values of the keys whose flags take a choice (schema.py types its fields with them)
MixedPrecision = Literal["no", "fp16", "bf16"]
Offload = Literal["none", "optimizer", "all"]

# --help panels
PLAN_PANEL = "Plan"
BATCH_PANEL = "Batch"


@dataclass(frozen=True)
class RunFlag:
    """One flag: the run-file key it sets, its --help line, and what value it takes."""

    key: str
    help: str
    # int, str or bool (a switch), or the choices it accepts
    kind: type | tuple[str, ...] = int
    panel: str | None = PLAN_PANEL
    # a short alias, e.g. -o
    short: str | None = None
    # bounds the command line checks itself (min, max)
    bounds: tuple[int, int] | None = None


# parameter name → its flag (`--` + the name with dashes); the order of --help
RUN_FLAGS: dict[str, RunFlag] = {
    "gpus": RunFlag("launch.gpus", "Total GPUs (ranks). Without GPUs: that many CPU ranks."),
    "cpu": RunFlag("launch.cpu", "Run ranks on CPU (gloo) even when GPUs are visible.", bool),
    "nodes": RunFlag("launch.nodes", "Number of nodes."),
    "gpus_per_node": RunFlag("launch.gpus_per_node", "GPUs per node (default gpus/nodes)."),
    "node_rank": RunFlag("launch.node_rank", "This node's rank (multi-node without SLURM)."),
    "master_addr": RunFlag("launch.master_addr", "Head node address for the rendezvous.", str),
    "master_port": RunFlag("launch.master_port", "Rendezvous port."),
    "max_restarts": RunFlag(
        "launch.max_restarts",
        "Restart every rank from the newest checkpoint after a failure, up to N times (default 0).",
    ),
    "hostfile": RunFlag(
        "launch.hostfile", "DeepSpeed hostfile ('host slots=G'): launch all nodes from here.", str
    ),
    "zero": RunFlag("parallel.zero_stage", "DeepSpeed ZeRO stage (0 = plain DDP).", bounds=(0, 3)),
    "offload": RunFlag("parallel.offload", "ZeRO CPU offload.", typing.get_args(Offload)),
    "tp": RunFlag("parallel.tp", "Tensor-parallel degree (DeepSpeed AutoTP)."),
    "pp": RunFlag("parallel.pp", "Pipeline-parallel degree."),
    "sp": RunFlag(
        "parallel.sp", "Sequence-parallel degree (DeepSpeed Ulysses): ranks sharing each sequence."
    ),
    "global_batch": RunFlag(
        "train.global_batch_size", "Samples per optimizer step over all ranks.", panel=BATCH_PANEL
    ),
    "micro_batch": RunFlag(
        "train.micro_batch_size", "Samples per forward pass per rank.", panel=BATCH_PANEL
    ),
    "max_steps": RunFlag("train.max_steps", "Optimizer steps.", panel=BATCH_PANEL),
    "mixed_precision": RunFlag(
        "train.mixed_precision",
        "no, fp16 or bf16.",
        typing.get_args(MixedPrecision),
        panel=BATCH_PANEL,
    ),
    "lora": RunFlag(
        "model.lora.r",
        "Train LoRA adapters of rank R (peft) instead of every weight; the base stays frozen.",
        panel=None,
    ),
    # `--parallel auto` is the YAML `parallel: auto`, i.e. parallel.auto
    "parallel": RunFlag(
        "parallel",
        "'auto': run the plan `dplaunch plan` recommends (ZeRO/offload/tp/pp).",
        ("auto",),
    ),
    # after `parallel`: --parallel auto --fsdp full is auto among the FSDP plans (config/load.py)
    "fsdp": RunFlag(
        "parallel.fsdp",
        "PyTorch FSDP2 instead of DDP/ZeRO: full (shard over all ranks) or hybrid (HSDP).",
        ("full", "hybrid"),
    ),
    "output_dir": RunFlag("output_dir", "Run directory.", str, panel=None, short="-o"),
}


def flag_option(name: str) -> str:
    """The long option of a flag: `max_restarts` → `--max-restarts`."""
    return "--" + name.replace("_", "-")


def flag_keys() -> dict[str, str]:
    """Parameter name → the dotted run-file key its flag overrides."""
    return {name: flag.key for name, flag in RUN_FLAGS.items()}
