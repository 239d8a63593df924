"""The run-file keys a command-line flag sets, declared once: the `RunFlags` dataclass.

Each field of `RunFlags` is one flag: its type, and (in `flag(...)`) the dotted run-file key it
overrides, its --help line and panel. From this class come the options of the commands that share
them (commands/options.py spreads the fields into typer options), the flag → `--set` overrides
(`RunFlags.overrides`) and the flag column of docs/reference.md (config/reference.py); the key's
type, default and description are the schema's (config/schema.py), which takes its choices from
the literals below. No pydantic or typer here: `dplaunch --help` reads this module and must stay
fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dplaunch.errors import UserError
from dplaunch.tasks import TASK_NAMES

# the values of the keys whose flags take a choice: schema.py types its fields with them, and
# the commands offer them as the choices of their options
MixedPrecision = Literal["no", "fp16", "bf16"]
Offload = Literal["none", "optimizer", "all"]
FsdpMode = Literal["full", "hybrid"]
# model.task: the registered tasks (dplaunch/tasks/)
TaskName = Literal[TASK_NAMES]
# attention kernels transformers runs (from_pretrained/from_config attn_implementation)
AttentionImplementation = Literal[
    "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"
]
LoraQuantize = Literal["4bit", "8bit"]
# `dplaunch launch --framework` (launching/frameworks.py): auto is what the script imports
Framework = Literal["auto", "pytorch", "tensorflow", "horovod"]

# --help panels
PLAN_PANEL = "Plan"
BATCH_PANEL = "Batch"


@dataclass(frozen=True)
class RunFlag:
    """What a RunFlags field's flag sets: the run-file key, its --help line and panel."""

    key: str
    help: str
    panel: str | None = PLAN_PANEL
    # a short alias, e.g. -o
    short: str | None = None
    # bounds the command line checks itself (min, max)
    bounds: tuple[int, int] | None = None


def flag(
    key: str,
    help: str,
    *,
    panel: str | None = PLAN_PANEL,
    short: str | None = None,
    bounds: tuple[int, int] | None = None,
    default: Any = None,
) -> Any:
    """A RunFlags field that a flag sets (None: not given)."""
    return dataclasses.field(
        default=default, metadata={"flag": RunFlag(key, help, panel, short, bounds)}
    )


@dataclass
class RunFlags:
    """The flags `train`, `config`, `launch`, `verify`, `doctor` and `slurm` share (None: not given).

    The field order is the order of --help; `--` + a field's name with dashes is its flag.
    """

    # the run file (YAML); None: the embedded default run file
    config: Path | None = None
    gpus: int | None = flag("launch.gpus", "Total GPUs (ranks). Without GPUs: that many CPU ranks.")
    cpu: bool = flag(
        "launch.cpu", "Run ranks on CPU (gloo) even when GPUs are visible.", default=False
    )
    nodes: int | None = flag("launch.nodes", "Number of nodes.")
    gpus_per_node: int | None = flag("launch.gpus_per_node", "GPUs per node (default gpus/nodes).")
    node_rank: int | None = flag("launch.node_rank", "This node's rank (multi-node without SLURM).")
    master_addr: str | None = flag("launch.master_addr", "Head node address for the rendezvous.")
    master_port: int | None = flag("launch.master_port", "Rendezvous port.")
    max_restarts: int | None = flag(
        "launch.max_restarts",
        "Restart every rank from the newest checkpoint after a failure, up to N times (default 0).",
    )
    hostfile: str | None = flag(
        "launch.hostfile", "DeepSpeed hostfile ('host slots=G'): launch all nodes from here."
    )
    profile: str | None = flag(
        "launch.profile", "Hardware profile (dplaunch calibrate --out) the forecast uses."
    )
    zero: int | None = flag(
        "parallel.zero_stage", "DeepSpeed ZeRO stage (0 = plain DDP).", bounds=(0, 3)
    )
    offload: Offload | None = flag("parallel.offload", "ZeRO CPU offload.")
    tp: int | None = flag("parallel.tp", "Tensor-parallel degree (DeepSpeed AutoTP).")
    pp: int | None = flag("parallel.pp", "Pipeline-parallel degree.")
    sp: int | None = flag(
        "parallel.sp", "Sequence-parallel degree (DeepSpeed Ulysses): ranks sharing each sequence."
    )
    global_batch: int | None = flag(
        "train.global_batch_size", "Samples per optimizer step over all ranks.", panel=BATCH_PANEL
    )
    micro_batch: int | None = flag(
        "train.micro_batch_size", "Samples per forward pass per rank.", panel=BATCH_PANEL
    )
    max_steps: int | None = flag("train.max_steps", "Optimizer steps.", panel=BATCH_PANEL)
    mixed_precision: MixedPrecision | None = flag(
        "train.mixed_precision", "no, fp16 or bf16.", panel=BATCH_PANEL
    )
    lora: int | None = flag(
        "model.lora.r",
        "Train LoRA adapters of rank R (peft) instead of every weight; the base stays frozen.",
        panel=None,
    )
    # `--parallel auto` is the YAML `parallel: auto`, i.e. parallel.auto
    parallel: Literal["auto"] | None = flag(
        "parallel", "'auto': run the plan `dplaunch plan` recommends (ZeRO/offload/tp/pp)."
    )
    # after `parallel`: --parallel auto --fsdp full is auto among the FSDP plans (config/load.py)
    fsdp: FsdpMode | None = flag(
        "parallel.fsdp",
        "PyTorch FSDP2 instead of DDP/ZeRO: full (shard over all ranks) or hybrid (HSDP).",
    )
    output_dir: str | None = flag("output_dir", "Run directory.", panel=None, short="-o")
    # --set KEY=VALUE: any run-file key, in the order given
    assignments: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cpu and self.gpus is not None and self.gpus < 1:
            # the run file's own check would suggest --cpu, which was given
            raise UserError("--gpus", f"{self.gpus} CPU ranks requested", "give --gpus 1 or more")

    def overrides(self) -> dict[str, Any]:
        """Flags that were given, as dotted run-file keys."""
        given = {name: getattr(self, name) for name in RUN_FLAGS}
        chosen = [
            f"--{name}" for name in ("zero", "offload", "tp", "pp", "sp") if given[name] is not None
        ]
        if given["parallel"] == "auto" and chosen:
            raise UserError(
                "--parallel",
                f"auto picks the ZeRO stage, offload, tp and pp itself, but {' '.join(chosen)} was given",
                "drop one or the other",
            )
        # 0 is a value (--gpus 0 must be refused, not ignored); only None/False mean "not given"
        return {
            RUN_FLAGS[name].key: value
            for name, value in given.items()
            if value is not None and value is not False
        }


# field name → its flag, in the order of --help
RUN_FLAGS: dict[str, RunFlag] = {
    field.name: field.metadata["flag"]
    for field in dataclasses.fields(RunFlags)
    if "flag" in field.metadata
}


def flag_option(name: str) -> str:
    """The long option of a flag: `max_restarts` → `--max-restarts`."""
    return "--" + name.replace("_", "-")


def flag_keys() -> dict[str, str]:
    """Field name → the dotted run-file key its flag overrides."""
    return {name: flag.key for name, flag in RUN_FLAGS.items()}
