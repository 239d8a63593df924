"""`dplaunch verify`: K steps of the configured plan against K steps of pure data parallelism.

Both are real `dplaunch train` runs (same run file, global batch, seed and data; only the parallel
section differs), written to OUT/plan and OUT/dp. Their per-step losses must agree within a
relative tolerance: the numbers a sharded/split layout computes are those of plain DDP.

``--shrink`` rehearses a GPU plan on CPU ranks: the same model type and mesh, with a model cut
down to a few narrow layers (heads and KV heads still divisible by tp, layers by pp), randomly
initialised from the shrunk config.

``--inject-fault`` (hidden) runs the plan with a known mistake, to prove that the check fails:

- ``no-grad-average``: the ranks skip the gradient all-reduce and each steps on its own
  gradient (a DDP communication hook that returns the local gradient; DDP plans only);
- ``summed-gradients``: gradients are all-reduced but not divided by the rank count (DDP plans
  only). Adam's update is invariant to a constant gradient scale, so this one PASSES with
  AdamW: the loss cannot see it, and the maths is unchanged up to Adam's epsilon;
- ``per-rank-batch``: the global batch counted per rank (× world size), the classic
  launcher mistake; any plan.

The gradient faults' ranks start through ``python -m dplaunch.train.gradient_faults
--inject-fault NAME RUN_DIR``, which installs the fault, then runs the ordinary rank entry
``dplaunch.train``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from dplaunch.commands.options import command
from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from dplaunch.run_directory.layout import (
    DEFAULT_RUNS_DIR,
    LAUNCH_SCRIPT,
    METRICS_FILE,
    RUN_FILE,
    VERIFY_PLAN_DIR,
    VERIFY_REFERENCE_DIR,
)
from dplaunch.train.gradient_faults import GRADIENT_FAULTS

# relative per-step loss gap allowed between the plan and DDP, by precision
TOLERANCES = {"no": 1e-3, "bf16": 2e-2, "fp16": 1e-2}
FAULTS = (*GRADIENT_FAULTS, "per-rank-batch")
# the shrunk model: head size and sequence length small enough for CPU ranks
SHRUNK_HEAD_DIM = 16
SHRUNK_MAX_LENGTH = 128
# keys of a config.json that would make a shrunk random model fail to build or load weights
DROPPED_KEYS = ("quantization_config", "torch_dtype", "dtype", "_name_or_path")
# train keys a --reference run may differ in: they do not change the per-step losses (log_every
# does: a logged loss is the mean since the previous line, so the reference must log every step)
IGNORED_TRAIN_KEYS = (
    "micro_batch_size",
    "eval_every",
    "checkpoint_every",
    "keep_last",
    "stop_after_steps",
    "compile",
)


@dataclass
class VerifyOptions:
    """`dplaunch verify`'s own options, each one typer option."""

    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps of each run.")] = 4
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            help="Largest relative loss gap (default 1e-3 fp32, 2e-2 bf16, 1e-2 fp16).",
        ),
    ] = None
    shrink: Annotated[
        bool,
        typer.Option(
            "--shrink",
            help="Same architecture and mesh with a few narrow layers (rehearse a GPU plan on CPU).",
        ),
    ] = False
    # an existing pure-DDP run to compare with instead of running one
    reference: Annotated[
        Path | None,
        typer.Option(
            "--reference",
            help="An existing pure-DDP run (same model, data and train keys) to compare with.",
        ),
    ] = None
    # the tests' seam: a fault the plan's run gets (verify's FAIL path)
    inject_fault: Annotated[str | None, typer.Option("--inject-fault", hidden=True)] = None


@command()
def verify_command(flags: RunFlags, options: VerifyOptions) -> int:
    """Run K steps of the plan and K steps of pure DDP (same batch, seed, data); PASS or FAIL on the losses."""
    return run_verify(flags, options)


# -- the shrunk model (pure) ------------------------------------------------------------------


def _key(raw: dict[str, Any], keys: tuple[str, ...], family: str, gpt2_name: str) -> str:
    for key in keys:
        if key in raw:
            return key
    return gpt2_name if family == "gpt2" else keys[0]


def shrunk_model_config(raw: dict[str, Any], *, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """The same architecture, cut down: max(2, pp) layers of head size 16 that tp still splits.

    KV heads: the smallest multiple of tp that is ≥ min(KV heads, 2); attention heads: 1 or 2 per
    KV head (grouped-query attention stays grouped). Hidden size = heads × 16, MLP 2 × hidden.
    Vocabulary and positions are kept: the tokenizer and sequence length still fit.
    """
    from dplaunch.planning.model_facts import (
        _HEAD_KEYS,
        _HIDDEN_KEYS,
        _INTERMEDIATE_KEYS,
        _KV_HEAD_KEYS,
        _LAYER_KEYS,
        ModelFacts,
    )

    facts = ModelFacts.from_config_dict(raw)
    family = facts.model_type
    heads, kv_heads = facts.num_heads, facts.num_kv_heads
    # grouped-query attention stays grouped, with at most 2 heads per KV head (cheaper on CPU)
    group = min(heads // kv_heads, 2) if kv_heads and heads % kv_heads == 0 else 1
    small_kv = max(tp, min(kv_heads, 2))
    small_kv += (-small_kv) % tp
    small_heads = small_kv * group
    hidden = small_heads * SHRUNK_HEAD_DIM
    config = {k: v for k, v in raw.items() if k not in DROPPED_KEYS}
    config[_key(raw, _LAYER_KEYS, family, "n_layer")] = max(2, pp)
    config[_key(raw, _HEAD_KEYS, family, "n_head")] = small_heads
    config[_key(raw, _HIDDEN_KEYS, family, "n_embd")] = hidden
    if any(key in raw for key in _KV_HEAD_KEYS) or group > 1:
        config[_key(raw, _KV_HEAD_KEYS, family, "n_head_kv")] = small_kv
    if family != "gpt2" or any(key in raw for key in _INTERMEDIATE_KEYS):
        config[_key(raw, _INTERMEDIATE_KEYS, family, "n_inner")] = 2 * hidden
    if "head_dim" in raw:
        config["head_dim"] = SHRUNK_HEAD_DIM
    return config


def _shrink_assignments(flags: Any) -> tuple[list[str], str]:
    """--set assignments that swap the run's model for its shrunk twin, and a line saying so."""
    from dplaunch.config.load import load_run_config
    from dplaunch.planning.model_facts import ModelFacts, load_config_json

    config = load_run_config(
        flags.config, overrides=flags.overrides(), assignments=flags.assignments
    )
    model = config.model
    raw = model.config if model.config is not None else load_config_json(model.name_or_path or "")
    # sp splits the heads as tp does: the shrunk model keeps them divisible by either
    tp, pp = max(config.parallel.tp, config.parallel.sp), config.parallel.pp
    if config.parallel.auto:
        raise UserError(
            "--shrink",
            "parallel: auto picks the plan from the real model's size",
            "give the plan to rehearse (--zero/--tp/--pp)",
        )
    shrunk = shrunk_model_config(raw, tp=tp, pp=pp)
    assignments = ["model.name_or_path=null", "model.config=" + json.dumps(shrunk)]
    if model.name_or_path is not None and model.tokenizer is None:
        assignments.append(f"model.tokenizer={json.dumps(model.name_or_path)}")
    length = min(config.data.max_length, SHRUNK_MAX_LENGTH)
    assignments.append(f"data.max_length={length}")
    facts = ModelFacts.from_config_dict(shrunk)
    line = (
        f"--shrink: {facts.model_type} with {facts.num_layers} layers, hidden {facts.hidden_size}, "
        f"{facts.num_heads} heads / {facts.num_kv_heads} KV heads (real: "
        f"{ModelFacts.from_config_dict(raw).num_layers} layers, hidden "
        f"{ModelFacts.from_config_dict(raw).hidden_size}), random init, sequence length {length}"
    )
    return assignments, line


# -- comparing losses (pure) ------------------------------------------------------------------


def relative_gaps(plan: list[float], reference: list[float]) -> list[float]:
    """|plan − dp| / |dp| per step (inf where a loss is missing or not finite)."""
    gaps = []
    for index in range(max(len(plan), len(reference))):
        if index >= len(plan) or index >= len(reference):
            gaps.append(math.inf)
            continue
        a, b = plan[index], reference[index]
        if not (math.isfinite(a) and math.isfinite(b)):
            gaps.append(math.inf)
        else:
            gaps.append(abs(a - b) / max(abs(b), 1e-12))
    return gaps


def comparison_table(plan: list[float], reference: list[float], plan_label: str) -> str:
    """Per-step losses side by side with the relative gap."""
    gaps = relative_gaps(plan, reference)
    width = max(len(plan_label), 10)
    lines = [f"  {'step':>4}  {plan_label:>{width}}  {'dp':>10}  {'rel. gap':>9}"]
    for index, gap in enumerate(gaps):
        a = f"{plan[index]:.6f}" if index < len(plan) else "-"
        b = f"{reference[index]:.6f}" if index < len(reference) else "-"
        lines.append(f"  {index + 1:>4}  {a:>{width}}  {b:>10}  {gap:>9.2e}")
    return "\n".join(lines)


# -- running the two runs --------------------------------------------------------------------


def _step_losses(run_dir: Path) -> list[float]:
    from dplaunch.report import read_metrics

    if not (run_dir / METRICS_FILE).is_file():
        return []
    return [float(record.get("loss", math.nan)) for record in read_metrics(run_dir).train]


def _fault_entry(prepared: Any, fault: str) -> None:
    """Make the ranks start through the fault's entry (dplaunch/train/gradient_faults.py) instead
    of dplaunch.train."""
    from dplaunch.rendering.launch_command import render_launch_script

    argv = prepared.argv
    position = argv.index("dplaunch.train")
    prepared.argv = [
        *argv[:position],
        "dplaunch.train.gradient_faults",
        "--inject-fault",
        fault,
        *argv[position + 1 :],
    ]
    prepared.files[LAUNCH_SCRIPT] = render_launch_script(
        prepared.argv, prepared.env, Path.cwd(), port=prepared.plan.master_port
    )


def reference_mismatch(
    plan_config: dict[str, Any], reference_config: dict[str, Any], reference_header: dict[str, Any]
) -> str | None:
    """Why an existing run cannot be this plan's DDP reference (None: it can).

    It must be pure data parallel, and its model, data and training maths (every train key but
    those in IGNORED_TRAIN_KEYS, which do not change the per-step losses) must be the plan's.
    """
    layout = tuple(
        reference_header.get(key, 1)
        for key in (
            "zero_stage",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "sequence_parallel_size",
        )
    )
    if layout[0] != 0 or layout[1:] != (1, 1, 1):
        return "it is not a pure DDP run (ZeRO {}, tp {}, pp {}, sp {})".format(*layout)
    for section in ("model", "data"):
        if plan_config.get(section) != reference_config.get(section):
            return f"its {section} section differs from the plan's"
    plan_train, reference_train = plan_config.get("train", {}), reference_config.get("train", {})
    differing = sorted(
        key
        for key in set(plan_train) | set(reference_train)
        if key not in IGNORED_TRAIN_KEYS and plan_train.get(key) != reference_train.get(key)
    )
    if differing:
        shown = ", ".join(
            f"{key} {reference_train.get(key)!r} (plan: {plan_train.get(key)!r})"
            for key in differing
        )
        return f"its train section differs: {shown}"
    return None


def _check_reference(reference: Path, plan_run: Any) -> None:
    from dplaunch.report import read_metrics
    from dplaunch.run_directory.files import read_run_file

    if not (reference / RUN_FILE).is_file() or not (reference / METRICS_FILE).is_file():
        raise UserError(
            "--reference", f"{reference} is not a finished dplaunch run", "give a run directory"
        )
    problem = reference_mismatch(
        plan_run.config.model_dump(mode="json"),
        read_run_file(reference),
        read_metrics(reference).header,
    )
    if problem:
        raise UserError(
            "--reference",
            f"{reference} cannot be compared: {problem}",
            "drop --reference to run a matching DDP reference",
        )


@dataclass
class _Runs:
    """The two runs verify compares, planned before either starts."""

    plan_run: Any
    # (label, prepared run) of each run this command starts: the plan's, then DDP's (unless a
    # --reference run is given)
    started: list[tuple[str, Any]]
    reference_dir: Path
    # the reference's rank count when this command runs it (else read from its metrics)
    reference_ranks: int | None
    shrink_line: str | None


def run_verify(flags: RunFlags, options: VerifyOptions) -> int:
    """Run the plan and DDP for K steps each; print the losses; 0 = PASS, 1 = FAIL."""
    from dplaunch.commands.train import start
    from dplaunch.launching.preview import print_prepared
    from dplaunch.launching.rundir import check_run_dir

    _check_options(flags, options)
    runs = _prepare_runs(flags, options)
    for _, prepared in runs.started:
        check_run_dir(prepared.run_dir, resuming=False)
    if runs.shrink_line:
        typer.echo(runs.shrink_line)
    if options.inject_fault:
        typer.echo(f"verify: FAULT INJECTED into the plan run: {options.inject_fault}")
    codes = {}
    for label, prepared in runs.started:
        typer.echo(f"\n=== verify: {label} run, {options.steps} step(s) → {prepared.run_dir}")
        print_prepared(prepared, show_files=False)
        codes[label] = start(prepared)
    return _verdict(runs, options, codes)


def _check_options(flags: RunFlags, options: VerifyOptions) -> None:
    # verify's own options, before anything is planned
    if options.steps < 1:
        raise UserError("--steps", f"{options.steps}", "run at least 1 step")
    if options.tolerance is not None and not 0 < options.tolerance < math.inf:
        raise UserError(
            "--tolerance",
            f"{options.tolerance} is not a positive relative loss gap",
            "give e.g. --tolerance 1e-3 (or leave it out for the precision's default)",
        )
    if flags.max_steps is not None:
        raise UserError("--max-steps", "verify runs --steps steps of each run", "use --steps")
    if options.inject_fault is not None and options.inject_fault not in FAULTS:
        raise UserError(
            "--inject-fault", f"unknown fault {options.inject_fault!r}", ", ".join(FAULTS)
        )


def _prepare_runs(flags: RunFlags, options: VerifyOptions) -> _Runs:
    """Both runs planned (and every mistake reported) before either starts."""
    from dplaunch.launching.prepare import prepare_training_run

    base = Path(
        flags.output_dir or Path(DEFAULT_RUNS_DIR) / f"verify-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    # a loss at every step; the data, its eval split and the schedule stay as configured
    common = [
        *flags.assignments,
        "train.log_every=1",
        "train.checkpoint_every=null",
        "train.stop_after_steps=null",
    ]
    shrink_line = None
    if options.shrink:
        extra, shrink_line = _shrink_assignments(flags)
        common += extra
    plan_flags = replace(
        flags, max_steps=options.steps, output_dir=str(base / VERIFY_PLAN_DIR), assignments=common
    )
    plan_run = _plan_run(plan_flags, options)
    if options.reference is not None:
        return _Runs(plan_run, [("plan", plan_run)], options.reference, None, shrink_line)
    ddp = "parallel={zero_stage: 0, offload: none, tp: 1, pp: 1, fsdp: null, sp: 1}"
    reference_run = prepare_training_run(
        replace(
            plan_flags,
            zero=None,
            offload=None,
            tp=None,
            pp=None,
            fsdp=None,
            sp=None,
            output_dir=str(base / VERIFY_REFERENCE_DIR),
            assignments=[*common, ddp],
        )
    )
    started = [("plan", plan_run), ("dp", reference_run)]
    ranks = reference_run.plan.world_size
    return _Runs(plan_run, started, reference_run.run_dir, ranks, shrink_line)


def _plan_run(plan_flags: RunFlags, options: VerifyOptions) -> Any:
    """The plan's run, checked against a --reference run, with the fault injected when asked."""
    from dplaunch.launching.prepare import prepare_training_run

    plan_run = prepare_training_run(plan_flags)
    if options.reference is not None:
        _check_reference(options.reference, plan_run)
    if options.inject_fault == "per-rank-batch":
        if plan_run.plan.world_size < 2:
            raise UserError("--inject-fault", "per-rank-batch needs at least 2 ranks", "--gpus 2")
        wrong = plan_run.plan.global_batch_size * plan_run.plan.world_size
        plan_run = prepare_training_run(replace(plan_flags, global_batch=wrong))
    if options.inject_fault in GRADIENT_FAULTS:
        if plan_run.plan.engine != "ddp":
            raise UserError(
                "--inject-fault",
                f"{options.inject_fault} hooks DDP's all-reduce; this plan runs {plan_run.plan.engine}",
                "use it with a DDP plan (no --zero/--tp/--pp), or use per-rank-batch",
            )
        _fault_entry(plan_run, options.inject_fault)
    return plan_run


def _verdict(runs: _Runs, options: VerifyOptions, codes: dict[str, int]) -> int:
    """The comparison table and PASS (0) or FAIL (1)."""
    plan_run, reference_dir = runs.plan_run, runs.reference_dir
    plan_losses = _step_losses(plan_run.run_dir)
    reference_losses = _step_losses(reference_dir)
    reference_ranks = runs.reference_ranks
    if reference_ranks is None:
        from dplaunch.report import read_metrics

        reference_ranks = read_metrics(reference_dir).header.get("world_size", "?")
    typer.echo(
        f"\nverify: per-step training loss, {plan_run.plan.layout_name} vs DDP "
        f"({reference_ranks} ranks, {reference_dir})"
    )
    typer.echo(comparison_table(plan_losses, reference_losses, "plan"))
    typer.echo(f"overlay the curves: dplaunch report {plan_run.run_dir} --compare {reference_dir}")
    failed = [label for label, code in codes.items() if code != 0]
    if failed:
        statuses = ", ".join(str(codes[label]) for label in failed)
        typer.echo(
            f"verify: FAIL — the {' and '.join(failed)} run did not finish (exit status {statuses})"
        )
        return 1
    if len(plan_losses) != options.steps or len(reference_losses) != options.steps:
        typer.echo(
            f"verify: FAIL — expected {options.steps} logged steps, got "
            f"{len(plan_losses)} (plan) and {len(reference_losses)} (dp)"
        )
        return 1
    tolerance = options.tolerance
    precision = plan_run.plan.mixed_precision
    if tolerance is None:
        tolerance = TOLERANCES[precision]
    gaps = relative_gaps(plan_losses, reference_losses)
    worst = max(gaps)
    passed = worst <= tolerance
    typer.echo(
        f"verify: {'PASS' if passed else 'FAIL'} — largest relative gap {worst:.2e} "
        f"(step {gaps.index(worst) + 1}) {'≤' if passed else '>'} tolerance {tolerance:.0e} "
        f"({'fp32' if precision == 'no' else precision}) over {len(gaps)} steps"
    )
    return 0 if passed else 1
