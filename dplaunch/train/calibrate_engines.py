"""Short real steps of every engine family, for the forecast's overhead terms.

Run by `dplaunch calibrate`'s ranks (train/calibrate_ranks.py) after the rates: each family
dplaunch trains with — DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2, and Ulysses (sp over every rank, on
DDP) — builds the engine a training run builds (train/loop.py: the plan, the Accelerator and
DeepSpeed config it renders, FSDP2's sharding, Ulysses' attention, the non-finite guard) around
small Llamas of its own, and times a few optimizer steps of two micro-batches and of one as the
loop times a step (its phase clock, the guard's verdict included). The shapes (SHAPES) differ in
hidden size at the same layers and in layers at the same hidden size, so that a cost per byte is
told apart from one per tensor; the micro-batch counts part what is paid per micro-batch from
what is paid per step. None is a benchmark's shape: planning/overhead_fit.py fits the
coefficients of planning/forecast.py's Overheads to these steps, and the model extrapolates.

Each (family, shape) is its own engine, built for two micro-batches a step, timed, then set to one
(Accelerate's accumulation count, DeepSpeed's batch size: both at a step boundary) and timed
again, then dropped; ZeRO-3 comes last (its zero.Init hook stays registered in transformers once
set), and Ulysses' attention is put back after its steps. A point that would not fit the budget
is left out (its family's first is run whatever the clock says), as the other sections do.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# (hidden, layers) of the step shapes: on CPU ranks within the hidden sizes and tokens the dense
# rates are measured at (calibrate_ranks.CPU_DENSE), so that what is left of a step is the
# engine's, not an extrapolated rate's; on GPUs small, so that the host's work is what shows
SHAPES = {"cpu": ((128, 2), (256, 2), (128, 6)), "gpu": ((128, 2), (1024, 2), (128, 8))}
QUICK_SHAPES = {"cpu": ((128, 2),), "gpu": ((128, 2),)}
# the sequence and micro batch of every step: 256 tokens a micro-batch
SEQ_LEN = 128
MICRO_BATCH = 2
# the families, in the order they run (ZeRO-3 last), and the parallel section of each
FAMILIES = {
    "ddp": {},
    "fsdp": {"fsdp": "full"},
    "ulysses": {"sp": None},  # sp = the world
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
}
QUICK_FAMILIES = ("ddp", "fsdp", "zero2", "zero3")
# optimizer steps timed after the warm-up, per point; warm-up steps (DDP rebuilds its buckets,
# DeepSpeed and FSDP2 allocate their buffers at the first)
TIMED_STEPS = 3
WARMUP_STEPS = 2
QUICK_TIMED_STEPS = 2
QUICK_WARMUP_STEPS = 1


# the micro-batches of a point's steps, in the order they are timed (two first: the switch to
# one then comes at a step boundary of both counts)
MICRO_BATCHES = (2, 1)


@dataclass(frozen=True)
class Point:
    """One family at one shape (its engine is built for the first of MICRO_BATCHES)."""

    family: str
    hidden: int
    layers: int
    micro_batches: int = MICRO_BATCHES[0]


def preload_engines() -> None:
    """Import what the engines' steps use before the budget's clock starts (seconds of imports
    on a loaded machine, which a training rank pays before its first step too)."""
    import accelerate  # noqa: F401
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401

    import dplaunch.train.loop  # noqa: F401
    import dplaunch.train.sequence_parallel  # noqa: F401


def model_config(hidden: int, layers: int) -> dict[str, Any]:
    """A Llama of HIDDEN × LAYERS on the byte-level vocabulary (4 heads: sp 2 and 4 split them)."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 8 * 8,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 259,
        "max_position_embeddings": 4 * SEQ_LEN,
        "tie_word_embeddings": False,
    }


def run_config(point: Point, world: int, per_node: int, gpu: bool, dtype: str) -> Any:
    """The run file of POINT on WORLD ranks: its model, its family's parallel section, the global
    batch of its micro-batches (fp32 on CPU ranks, DTYPE on GPUs), clipping as runs default to."""
    from dplaunch.config.load import build_run_config

    parallel = dict(FAMILIES[point.family])
    if "sp" in parallel:
        parallel["sp"] = world
    dp = 1 if "sp" in parallel else world
    data = {
        "name": f"calibrate-{point.family}",
        "model": {
            "config": model_config(point.hidden, point.layers),
            "tokenizer": "byte-level",
            "task": "causal-lm",
        },
        "data": {"dataset": "pkg:dplaunch/resources/data/reviews.jsonl", "max_length": SEQ_LEN},
        "train": {
            "global_batch_size": MICRO_BATCH * point.micro_batches * dp,
            "micro_batch_size": MICRO_BATCH,
            "max_steps": 100,
            "mixed_precision": dtype if gpu else "no",
            "warmup_steps": 0,
        },
        "parallel": parallel,
        "launch": {
            "gpus": world,
            "gpus_per_node": per_node,
            "nodes": max(1, world // per_node),
            "cpu": not gpu,
        },
    }
    return build_run_config(data)


@dataclass
class _Built:
    """One point's engine and what its steps take."""

    engine: Any
    guard: Any
    batches: list[dict[str, torch.Tensor]]
    config: Any
    plan: Any
    restore: Any = None


def _build(point: Point, ranks: Any, gpu: bool, dtype: str, run_dir: Path) -> _Built:
    """POINT's engine, built as train/loop.py builds a rank's (its files written to RUN_DIR)."""
    from accelerate.state import AcceleratorState

    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.plan import Machine, ModelChoices, make_plan
    from dplaunch.rendering.deepspeed_config import render_deepspeed_config
    from dplaunch.run_directory.layout import DEEPSPEED_FILE
    from dplaunch.train.data import collate_blocks
    from dplaunch.train.loop import build_engine, make_accelerator
    from dplaunch.train.modeling import load_model, load_tokenizer
    from dplaunch.train.nonfinite import NonFiniteGuard
    from dplaunch.train.sequence_parallel import prepare_long_sequences

    config = run_config(point, ranks.world, ranks.per_node, gpu, dtype)
    facts = ModelFacts.from_config_dict(config.model.config)
    plan = make_plan(
        config.launch,
        config.parallel,
        config.train,
        Machine(visible_gpus=ranks.per_node if gpu else 0, render_only=True),
        facts,
        ModelChoices.of(config.model),
    )
    if plan.uses_deepspeed:
        text = render_deepspeed_config(plan, max_grad_norm=config.train.max_grad_norm)
        (run_dir / DEEPSPEED_FILE).write_text(text)
    AcceleratorState._reset_state(reset_partial_state=True)  # a new Accelerator for each engine
    accelerator = make_accelerator(plan, config, run_dir)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, tokenizer, config.train.seed, on_gpu=gpu)
    restore = None
    if plan.sequence_parallel_size > 1:
        restore = _attention_functions()
    long_sequences = prepare_long_sequences(model, plan, config, ranks.rank, tokenizer.pad_token_id)
    engine = build_engine(
        plan, config, accelerator, model, 100, run_dir, long_sequences=long_sequences
    )
    guard = NonFiniteGuard(
        config.train.on_nonfinite, config.train.max_skipped_steps, accelerator, plan.mixed_precision
    )
    engine.guard = guard
    rows = np.random.default_rng(0).integers(0, 256, (MICRO_BATCH, SEQ_LEN))
    batches = [collate_blocks(rows) for _ in range(point.micro_batches)]
    return _Built(engine, guard, batches, config, plan, restore)


def _attention_functions() -> Any:
    """A way back to transformers' attention kernels once Ulysses has replaced one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS.items())

    def restore() -> None:
        for name, function in saved.items():
            ALL_ATTENTION_FUNCTIONS[name] = function

    return restore


def _time_steps(built: _Built, warmup: int, timed: int, device: Any) -> dict[str, Any]:
    """Median step and phase seconds of TIMED steps after WARMUP, as the loop's clock takes them
    (the guard's verdict included, the device waited for at both ends of a step)."""
    from dplaunch.train.phase_clock import PHASES

    engine, clock = built.engine, built.engine.clock
    steps, phases = [], []
    for step in range(warmup + timed):
        _sync(device)
        began = time.perf_counter()
        built.guard.begin(step + 1)
        engine.train_step([dict(b) for b in built.batches])
        built.guard.verdict()
        _sync(device)
        if step >= warmup:
            steps.append(time.perf_counter() - began)
            phases.append(dict(clock.seconds) if clock is not None else {})
    timed_phases = {
        phase: float(np.median([p.get(phase, 0.0) for p in phases])) for phase in PHASES
    }
    return {"step_s": float(np.median(steps)), "phases_s": timed_phases}


def _sync(device: Any) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _drop(built: _Built | None) -> None:
    if built is None:
        return
    if built.restore is not None:
        built.restore()
    engine = built.engine
    destroy = getattr(getattr(engine, "model", None), "destroy", None)
    if callable(destroy):  # DeepSpeed's engine releases its hooks and buffers
        destroy()
    del built
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def points(world: int, gpu: bool, quick: bool) -> list[Point]:
    """Every point, family by family (Ulysses only on two ranks or more; --quick: one shape of
    the four families the others stand in for, ZeRO-1 by ZeRO-2, Ulysses by its defaults)."""
    shapes = (QUICK_SHAPES if quick else SHAPES)["gpu" if gpu else "cpu"]
    chosen = []
    for family in QUICK_FAMILIES if quick else FAMILIES:
        if family == "ulysses" and world < 2:
            continue
        chosen += [Point(family, hidden, layers) for hidden, layers in shapes]
    return chosen


def engine_steps(ranks: Any, quick: bool, dtype: str = "bf16") -> dict[str, Any]:
    """Every point's layout, workload and median phases (the record's ``engine_steps``), and
    those left out. RANKS: calibrate_ranks.Ranks (its clock's "engines" section decides)."""
    gpu = ranks.device.type == "cuda"
    dtype = dtype if (not gpu or ranks.limits.bf16 or dtype != "bf16") else "fp16"
    chosen = points(ranks.world, gpu, quick)
    warmup, timed = (
        (QUICK_WARMUP_STEPS, QUICK_TIMED_STEPS) if quick else (WARMUP_STEPS, TIMED_STEPS)
    )
    ranks.start("engines", len(chosen))
    steps, left_out, failed = [], [], []
    last_seconds: float | None = None
    measured: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="dplaunch-calibrate-engines-") as folder:
        for point in chosen:
            label = f"{point.family} {point.hidden}×{point.layers}"
            if not _agree_to_run(ranks, last_seconds, point.family not in measured):
                left_out.append(label)
                continue
            began = time.perf_counter()
            built = None
            try:
                built = _build(point, ranks, gpu, dtype, Path(folder))
                timings = []
                for micro_batches in MICRO_BATCHES:
                    _set_micro_batches(built, micro_batches)
                    # the engine is warm after the first count's steps: one step to settle
                    settle = warmup if not timings else 1
                    timings.append((micro_batches, _time_steps(built, settle, timed, ranks.device)))
            except Exception as error:  # noqa: BLE001 — one family that cannot run here is a note
                failed.append(f"{label}: {type(error).__name__}: {str(error)[:200]}")
                _drop(built)
                continue
            steps += [_record(point, built, m, timing, ranks) for m, timing in timings]
            measured.add(point.family)
            _drop(built)
            last_seconds = ranks.slowest(time.perf_counter() - began)
    return {
        "steps": steps,
        "left_out": left_out,
        "failed": failed,
        "seq_len": SEQ_LEN,
        "micro_batch": MICRO_BATCH,
    }


def _agree_to_run(ranks: Any, predicted: float | None, essential: bool) -> bool:
    """Whether every rank runs the next point: rank 0's clock decides (its budget's target)."""
    target = ranks.clock.target(predicted, essential) if ranks.rank == 0 else 0.0
    decision = torch.tensor([target], dtype=torch.float64, device=ranks.device)
    dist.broadcast(decision, 0)
    return float(decision.item()) > 0


def _set_micro_batches(built: _Built, micro_batches: int) -> None:
    """The engine's steps from now on take MICRO_BATCHES micro-batches: Accelerate's
    accumulation count (its counter at the boundary) and DeepSpeed's batch size follow."""
    accelerator = getattr(built.engine, "accelerator", None)
    if accelerator is not None:
        accelerator.gradient_accumulation_steps = micro_batches
        accelerator.step = 0
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            engine = wrapped.engine
            engine.set_train_batch_size(
                engine.train_micro_batch_size_per_gpu() * micro_batches * engine.dp_world_size
            )
    built.batches = [built.batches[0]] * micro_batches


def _record(
    point: Point, built: _Built, micro_batches: int, timing: dict[str, Any], ranks: Any
) -> dict[str, Any]:
    """What the fit needs of one point's steps of MICRO_BATCHES: the model, the layout, the
    workload, the slowest rank's phases (every rank waits for the slowest in a collective)."""
    plan, config = built.plan, built.config
    dp = plan.world_size // plan.sequence_parallel_size
    phases = {phase: ranks.slowest(s) for phase, s in timing["phases_s"].items()}
    return {
        "family": point.family,
        "model_config": dict(config.model.config),
        "world_size": plan.world_size,
        "gpus_per_node": plan.processes_per_node,
        "zero_stage": plan.zero_stage,
        "fsdp": plan.fsdp,
        "sp": plan.sequence_parallel_size,
        "micro_batch": plan.micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "global_batch_size": plan.micro_batch_size * micro_batches * dp,
        "seq_len": SEQ_LEN,
        "mixed_precision": plan.mixed_precision,
        "max_grad_norm": config.train.max_grad_norm,
        "on_nonfinite": config.train.on_nonfinite,
        "joined": list(getattr(built.engine.clock, "joined", ()) or ()),
        "step_s": ranks.slowest(timing["step_s"]),
        "phases_s": phases,
    }
