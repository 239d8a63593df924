"""The generic training loop: one loop for every layout, driving a StepEngine.

Runs in every rank under `accelerate launch`. Reads the run directory's run.yaml and plan.json,
so the ranks do exactly what the launcher planned and printed, and resume.json, the checkpoint the
launcher chose to continue from (dplaunch/run_directory/). Checkpoints (periodic, on
SIGUSR1/SIGTERM, at train.stop_after_steps) go through dplaunch/train/checkpoint.py.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dplaunch.config.schema import RunConfig
from dplaunch.planning.forecast import compare_with_forecast, mfu
from dplaunch.planning.plan import Plan
from dplaunch.run_directory.environment import restarts_so_far
from dplaunch.run_directory.files import (
    read_checkpoint_meta,
    read_deepspeed_file,
    read_plan_file,
    read_resume,
    read_run_file,
)
from dplaunch.run_directory.layout import (
    ADAPTER_DIR,
    ADAPTER_LAST_DIR,
    DEEPSPEED_FILE,
    EXPORT_DIR,
    EXPORT_LAST_DIR,
    step_dir,
)
from dplaunch.stop_signals import EXIT_CHECKPOINTED, StopSignals
from dplaunch.tasks import task_of
from dplaunch.train.checkpoint import Checkpointer, SaveHooks
from dplaunch.train.checkpoint_faults import hold_start_up
from dplaunch.train.collective_spy import spy_from_environment, watched
from dplaunch.train.collective_timeout import group_timeouts_s, use_collective_timeout
from dplaunch.train.control import ControlChannel
from dplaunch.train.data import (
    Batcher,
    Sharding,
    attach_chat_template,
    batch_tokens,
    load_splits,
    sft_renderer,
    tokenize,
    tokenized_cache_file,
)
from dplaunch.train.early_stopping import BestTracker, export_best
from dplaunch.train.engines import AccelerateEngine, StepEngine, build_optimizer
from dplaunch.train.metrics import (
    MetricsWriter,
    RankPrinter,
    library_progress,
    memory_fields,
    memory_now_gb,
    progress_width,
)
from dplaunch.train.mixture import RunData, load_run_data, training_batcher
from dplaunch.train.modeling import load_model, load_tokenizer
from dplaunch.train.nonfinite import EXIT_NONFINITE, NonFiniteGuard
from dplaunch.train.nonfinite_faults import nonfinite_fault_from_environment
from dplaunch.train.objective import Objective
from dplaunch.train.phase_clock import StepTimes
from dplaunch.train.preference import disable_dropout
from dplaunch.train.quick_start import freeze_imports, resume_collector
from dplaunch.train.sequence_parallel import LongSequenceEngine, prepare_long_sequences
from dplaunch.train.trackers import open_trackers

if TYPE_CHECKING:
    from dplaunch.train.streaming import StreamBatcher

# the stop reason of train.stop_after_steps (exit 0); signals give their name (exit 75)
STOP_AFTER_STEPS = "train.stop_after_steps"


@dataclass
class RankPlace:
    """Where this process sits in the mesh."""

    rank: int
    world_size: int
    stage: int
    data_parallel_rank: int
    tensor_parallel_rank: int
    is_main: bool
    sequence_parallel_rank: int = 0

    @property
    def counts_tokens(self) -> bool:
        # one rank per data-parallel shard counts its tokens, so TP/PP/SP copies are not double-counted
        return self.counts_eval(sliced=False)

    def counts_eval(self, *, sliced: bool) -> bool:
        """Whether this rank's evaluation sums count: as counts_tokens, but every rank of an sp
        group counts when each evaluated its own slice of the sequences (``sliced``)."""
        return (
            self.tensor_parallel_rank == 0
            and self.stage == 0
            and (sliced or self.sequence_parallel_rank == 0)
        )


def read_run(run_dir: Path) -> tuple[RunConfig, Plan]:
    """The resolved run file and the plan the launcher wrote."""
    config = RunConfig.model_validate(read_run_file(run_dir))
    plan = Plan.from_dict(read_plan_file(run_dir))
    return config, plan


def make_accelerator(plan: Plan, config: RunConfig, run_dir: Path) -> Any:
    """An Accelerator that matches the plan: gloo on CPU, DeepSpeed from the rendered JSON."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
    )

    # before any process group exists: the world's and every group an engine builds later
    timeout = use_collective_timeout(plan.timeout_minutes)
    handlers: list[Any] = []
    if plan.world_size > 1 or plan.uses_deepspeed:
        # a single non-DeepSpeed process has no process group: naming a backend would make Accelerate expect one
        handlers.append(InitProcessGroupKwargs(backend=plan.process_group_backend, timeout=timeout))
    kwargs: dict[str, Any] = {"step_scheduler_with_optimizer": False}
    if config.train.compile:
        # Accelerate compiles the wrapped model (DDP) or calls the DeepSpeed engine's compile()
        kwargs["dynamo_backend"] = "inductor"
    if plan.engine == "deepspeed":
        # not cpu=True: that makes Accelerate drop the DeepSpeed plugin; gloo comes from the handler
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=str(run_dir / DEEPSPEED_FILE))
    else:
        kwargs["cpu"] = plan.target == "cpu"
        # gradients as views into DDP's all-reduce buckets: one gradient-sized buffer instead of two,
        # and no copy into the buckets after each backward
        handlers.append(
            DistributedDataParallelKwargs(bucket_cap_mb=100, gradient_as_bucket_view=True)
        )
        kwargs["mixed_precision"] = plan.mixed_precision if plan.engine == "ddp" else "no"
        kwargs["gradient_accumulation_steps"] = plan.gradient_accumulation_steps
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def start_rank(
    config: RunConfig, plan: Plan, run_dir: Path
) -> tuple[Any, RankPlace, Callable[[str], None]]:
    """This rank's Accelerator (process group up), its place in the mesh, and rank 0's printer."""
    accelerator = make_accelerator(plan, config, run_dir)
    stage, dp_rank, tp_rank = plan.mesh.coordinates(accelerator.process_index)
    place = RankPlace(
        accelerator.process_index,
        accelerator.num_processes,
        stage,
        dp_rank,
        tp_rank,
        accelerator.is_main_process,
        plan.mesh.sequence_parallel_rank(accelerator.process_index),
    )
    if place.world_size != plan.world_size:
        raise RuntimeError(f"launched {place.world_size} ranks but the plan has {plan.world_size}")
    expected_type = "DEEPSPEED" if plan.engine == "deepspeed" else None
    if expected_type and accelerator.distributed_type.value != expected_type:
        raise RuntimeError(
            f"planned {expected_type} but Accelerate set up {accelerator.distributed_type.value}"
        )
    say = RankPrinter(place.is_main, width=progress_width())
    _quiet_libraries(place.is_main)  # the last of the libraries every rank imports first
    freeze_imports()
    say(
        f"[dplaunch] {plan.world_size} rank(s), {accelerator.distributed_type.value}, device {accelerator.device}"
    )
    return accelerator, place, say


@dataclass
class RankRun:
    """What a rank's steps use, built once by train(): the run, this rank, its engine and data,
    and where its results go."""

    config: RunConfig
    plan: Plan
    accelerator: Any
    place: RankPlace
    say: Callable[[str], None]
    engine: StepEngine
    batcher: Batcher | StreamBatcher
    # each evaluation set by its metrics' prefix (eval, eval_<name>); empty: no evaluation
    eval_batchers: dict[str, Batcher]
    total_steps: int
    metrics: MetricsWriter
    checkpointer: Checkpointer
    control: ControlChannel
    signals: StopSignals
    # train.on_nonfinite: judges each step's loss and gradient norm on every rank together
    guard: NonFiniteGuard
    run_dir: Path
    tokenizer: Any
    # the run continues from a checkpoint (resume.json)
    resumed: bool
    # train.sample_prompts: answered at each evaluation (None: no prompts)
    sampler: Any = None
    # the task's own loss (dpo's preference objective, grpo's), whose metrics join each log line
    objective: Objective | None = None
    # model.task grpo: a step's prompts → its micro-batches of completions, sampled and scored
    rollout: Callable[[int, list], list] | None = None
    # train.early_stopping / train.keep_best: the best evaluation so far (None: neither)
    best: BestTracker | None = None


def train(run_dir: Path) -> int:
    """Train as planned; return the process exit status."""
    # first of all: a SIGUSR1 during start-up is kept for the first step boundary; a SIGTERM
    # ends the rank at once (nothing trained yet to checkpoint)
    signals = StopSignals(starting=True)
    signals.install()
    run, start_step = start_run(run_dir, signals)
    resume_collector()  # paused by the rank's entry point while it imported and built
    if run.config.train.eval_every and run.eval_batchers and not run.resumed:
        _evaluate(run, 0)
    # from here a stop signal checkpoints at the next step boundary
    run.signals.started()
    step, stop_reason = _run_steps(run, start_step)
    if stop_reason is not None:
        return _stop_early(run, step, stop_reason)
    _export(run, step)
    run.metrics.close()
    run.accelerator.end_training()
    return 0


def start_run(run_dir: Path, signals: StopSignals) -> tuple[RankRun, int]:
    """This rank set up for the run the launcher planned: its data, model, engine, checkpoints
    and metrics; and the step it starts after (the resumed checkpoint's, else 0)."""
    config, plan = read_run(run_dir)
    resume = read_resume(run_dir)
    accelerator, place, say = start_rank(config, plan, run_dir)
    control = ControlChannel(plan.timeout_minutes)
    hold_start_up()  # TEST ONLY: nothing in a real run
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, config.model.task)
    run_data = _load_data(accelerator, tokenizer, config, say)
    train_set = run_data.train
    batcher, eval_batchers, total_steps = _batchers(run_data, tokenizer, config, plan, place)
    if train_set is None:  # data.streaming: the workers start reading now, beside the model
        batcher = _stream_batcher(accelerator, tokenizer, config, plan, place, resume)
    batchers = (batcher, *eval_batchers.values())
    model, parameters = _build_model(config, plan, tokenizer, say, batchers)
    guard = _nonfinite_guard(config, plan, accelerator, model)
    long_sequences = prepare_long_sequences(model, plan, config, place.rank, tokenizer.pad_token_id)
    engine = build_engine(
        plan, config, accelerator, model, total_steps, run_dir, long_sequences=long_sequences
    )
    engine.guard = guard
    for line in engine.layout_lines():
        say(f"[dplaunch] {line}")
    objective, reference = _objective_starter(config.model.task)(
        config, plan, accelerator, engine, run_dir, tokenizer, batchers, say
    )
    best = BestTracker.of(config)
    checkpointer = Checkpointer(
        run_dir,
        engine,
        control,
        rank=place.rank,
        keep_last=config.train.keep_last,
        meta={**plan.header(), "engine": plan.engine, "total_steps": total_steps},
        say=say,
        hooks=SaveHooks(
            _model_files_writer(model, tokenizer),
            batcher.save_position,
            meta=best.meta if best is not None else None,
            kept=best.kept if best is not None else None,
        ),
    )
    start_step = _resume(checkpointer, resume, batcher, say)
    if best is not None and resume is not None:  # the record goes on where the checkpoint was
        best.restore(read_checkpoint_meta(Path(resume["checkpoint"])))
    run = RankRun(
        config=config,
        plan=plan,
        accelerator=accelerator,
        place=place,
        say=say,
        engine=engine,
        batcher=batcher,
        eval_batchers=eval_batchers,
        total_steps=total_steps,
        metrics=_open_metrics(run_dir, config, place),
        checkpointer=checkpointer,
        control=control,
        signals=signals,
        guard=guard,
        run_dir=run_dir,
        tokenizer=tokenizer,
        resumed=resume is not None,
        sampler=_prompt_sampler(config, tokenizer),
        objective=objective,
        rollout=objective.rollout if objective is not None else None,
        best=best,
    )
    _write_header(run, run_data, parameters, start_step, reference)
    _say_start(say, plan, batcher, train_set, total_steps, parameters)
    return run, start_step


def _write_header(
    run: RankRun, run_data: RunData, parameters: int, start_step: int, reference: Any
) -> None:
    """metrics.jsonl's header: the plan, the data, the model and what this launch starts from."""
    plan, train_set = run.plan, run_data.train
    run.metrics.write(
        "header",
        **plan.header(),
        total_steps=run.total_steps,
        train_samples=len(train_set) if train_set is not None else None,
        eval_samples=sum(len(part) for part in run_data.evaluation.values()),
        steps_per_epoch=run.batcher.steps_per_epoch,
        parameters=parameters,
        task=run.config.model.task,
        resumed_from_step=start_step if run.resumed else None,
        # the model and engine built, no step taken: what each step's peak adds activations to
        memory_at_start_gb=memory_now_gb(run.accelerator.device),
        # the engine built: every process group this rank is in, and the timeout each holds
        process_group_timeouts_s=group_timeouts_s(),
        **({"reference": reference} if reference is not None else {}),
    )


def _objective_starter(task: str) -> Callable[..., tuple[Any, Any]]:
    """The task's rank-side start of its objective (Task.objective: "module:function"), or one
    that starts none where the loss is the model's own."""
    path = task_of(task).objective
    if path is None:
        return lambda *_: (None, None)
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _nonfinite_guard(config: RunConfig, plan: Plan, accelerator: Any, model: Any) -> NonFiniteGuard:
    """train.on_nonfinite's guard, and the test fault (if any) in MODEL: train/nonfinite_faults.py."""
    guard = NonFiniteGuard(
        config.train.on_nonfinite, config.train.max_skipped_steps, accelerator, plan.mixed_precision
    )
    fault = nonfinite_fault_from_environment()  # TEST ONLY: None in every real run
    if fault is not None:
        fault.install(model, accelerator.process_index, lambda: guard.step)
    return guard


def _build_model(
    config: RunConfig,
    plan: Plan,
    tokenizer: Any,
    say: Callable[[str], None],
    batchers: tuple[Any, ...],
) -> tuple[Any, int]:
    """The model (before any engine shards it) and its parameter count; the batchers learn
    whether it runs flash-attention."""
    # under ZeRO-3 built partitioned from construction (transformers' zero.Init), random weights too
    model = load_model(
        config.model,
        tokenizer,
        config.train.seed,
        config.data.label_names,
        on_gpu=plan.target == "gpu",
        say=say,
    )
    if task_of(config.model.task).preference:
        disable_dropout(model)  # as TRL: the log-probability ratios must not be noise
    partition = _partition_line(model)
    if partition is not None:
        say(f"[dplaunch] {partition}")
    if config.model.lora is not None:
        from dplaunch.train.lora import trained_line

        say(f"[dplaunch] {trained_line(model)}")
    # flash-attention keeps packed examples apart only in one flattened row (data.py)
    flatten = "flash" in str(getattr(model.config, "_attn_implementation", ""))
    for batcher in batchers:
        if batcher is not None:
            batcher.flatten_packed = flatten
    # counted before the engine shards anything (ZeRO-3 partitions keep the full size in ds_numel)
    return model, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def _open_metrics(run_dir: Path, config: RunConfig, place: RankPlace) -> MetricsWriter:
    """Rank 0's metrics.jsonl, TensorBoard and trackers (train.report_to); nothing elsewhere."""
    trackers = None
    if place.is_main:
        trackers = open_trackers(config.train.report_to, run_dir, config.model_dump(mode="json"))
    return MetricsWriter(
        run_dir,
        enabled=place.is_main,
        tensorboard="tensorboard" in config.train.report_to,
        trackers=trackers,
    )


def _say_start(
    say: Callable[[str], None],
    plan: Plan,
    batcher: Any,
    train_set: Any | None,
    total_steps: int,
    parameters: int,
) -> None:
    """The start-up lines: the batch, the steps and the data; plan.json's forecast when made."""
    data_line = (
        f"{batcher.steps_per_epoch} per epoch, {len(train_set)} training samples"
        if train_set is not None
        else batcher.layout.describe()
    )
    say(
        f"[dplaunch] {plan.batch_line()}; {total_steps} steps, {data_line}, "
        f"{parameters / 1e6:.1f}M parameters"
    )
    if plan.forecast is not None:
        step_s = plan.forecast["step_time_s"]
        say(
            f"[dplaunch] forecast {step_s:.3g} s/step, MFU {plan.forecast['mfu']:.1%}, "
            f"{step_s * total_steps / 3600:.3g} h for {total_steps} steps "
            f"({plan.forecast['profile']})"
        )


def _prompt_sampler(config: RunConfig, tokenizer: Any) -> Any:
    """train.sample_prompts' sampler (None without prompts)."""
    if not config.train.sample_prompts:
        return None
    from dplaunch.train.samples import PromptSampler

    renderer = sft_renderer(tokenizer, config.data)
    return PromptSampler(config.train.sample_prompts, tokenizer, renderer)


def _export(run: RankRun, step: int) -> None:
    """The model as one HF model (a LoRA run: its adapter and the merged model): the trained
    one, or with train.keep_best the best evaluation's checkpoint (train.export_last: the
    trained one too, in model-last)."""
    best, train = run.best, run.config.train
    kept = best.kept() if best is not None and train.keep_best else None
    if kept is None or best is None or best.best_step == step:
        _export_trained(run, EXPORT_DIR, ADAPTER_DIR)
        if train.export_last:  # the last step is the best
            _export_trained(run, EXPORT_LAST_DIR, ADAPTER_LAST_DIR)
        return
    if train.export_last:
        _export_trained(run, EXPORT_LAST_DIR, ADAPTER_LAST_DIR)
    export_best(run, kept, run.run_dir / EXPORT_DIR, run.run_dir / ADAPTER_DIR)
    run.say(
        f"[dplaunch] exported the best checkpoint {kept} ({best.metric} {best.best:.4f} at step "
        f"{best.best_step}) to {run.run_dir / EXPORT_DIR}"
        + (f" and {run.run_dir / ADAPTER_DIR}" if run.config.model.lora is not None else "")
    )


def _export_trained(run: RankRun, model_name: str, adapter_name: str) -> None:
    """The trained weights as RUN/MODEL_NAME (a LoRA run: RUN/ADAPTER_NAME and the merged
    model)."""
    export_dir = run.run_dir / model_name
    if run.config.model.lora is not None:
        from dplaunch.train.lora_export import export_run

        export_run(
            run.engine, run.config, run.tokenizer, run.run_dir, names=(adapter_name, model_name)
        )
        adapter = run.run_dir / adapter_name
        if run.config.model.lora.export == "adapter-only":
            run.say(
                f"[dplaunch] exported the adapter to {adapter} (model.lora.export adapter-only)"
            )
        else:
            run.say(f"[dplaunch] exported the adapter to {adapter}, merged into {export_dir}")
    else:
        run.engine.export(str(export_dir), run.tokenizer)
        run.say(f"[dplaunch] exported the trained model to {export_dir}")


def _load_data(accelerator: Any, tokenizer: Any, config: RunConfig, say: Any) -> RunData:
    """The tokenised training set (None: data.streaming reads it while training, in
    _stream_batcher) and evaluation sets (sft's never packed: data.for_evaluation), a mixture's
    and data.eval_datasets' source by source (train/mixture.py)."""

    def load(data: Any) -> tuple[Any, Any]:
        # rank 0 first: loading may download and writes the datasets cache, which the others read
        with accelerator.main_process_first():
            return load_splits(data, config.train.seed)

    def tokenized(dataset: Any, data: Any, what: str) -> Any:
        sourced = config.model_copy(update={"data": data})
        return _tokenized(accelerator, dataset, tokenizer, sourced, what, say)

    return load_run_data(config.data, config.model.task, load, tokenized)


def _sharding(plan: Plan, place: RankPlace) -> Sharding:
    return Sharding(
        place.data_parallel_rank,
        plan.data_parallel_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
    )


def _batchers(
    run_data: RunData, tokenizer: Any, config: RunConfig, plan: Plan, place: RankPlace
) -> tuple[Batcher | None, dict[str, Batcher], int]:
    """This rank's training batcher and evaluation batchers (by their metrics' prefix), and the
    run's number of steps (a stream's training batcher is made by _stream_batcher: None here)."""
    sharding = _sharding(plan, place)
    batcher, train_set = None, run_data.train
    if train_set is not None:
        batcher = training_batcher(
            run_data,
            config.data,
            sharding,
            pad_id=tokenizer.pad_token_id,
            task=config.model.task,
            seed=config.train.seed,
            settings=config.train.grpo,
        )
        if batcher.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(train_set)} samples, fewer than one global batch of {plan.global_batch_size}"
            )
    # a stream's length is train.max_steps (the launch check refuses a stream without it)
    total_steps = config.train.max_steps or math.ceil(
        (config.train.epochs or 1) * batcher.steps_per_epoch
    )
    eval_batchers = {
        prefix: Batcher(
            eval_set,
            sharding,
            pad_id=tokenizer.pad_token_id,
            task=config.model.task,
            seed=config.train.seed,
        )
        for prefix, eval_set in run_data.evaluation.items()
        if len(eval_set) > 0
    }
    return batcher, eval_batchers, total_steps


def _stream_batcher(
    accelerator: Any,
    tokenizer: Any,
    config: RunConfig,
    plan: Plan,
    place: RankPlace,
    resume: dict[str, Any] | None,
) -> StreamBatcher:
    """data.streaming: this rank's lanes of the stream, from the resumed checkpoint's position."""
    from dplaunch.train.mixture_stream import stream_lanes
    from dplaunch.train.streaming import StreamBatcher

    def total_over_ranks(tokens: int) -> int:
        # one rank of each data-parallel group counts (its tp/pp/sp peers hold the same rows)
        mine = torch.tensor([tokens if place.counts_tokens else 0], device=accelerator.device)
        return int(accelerator.reduce(mine, reduction="sum").item())

    # each source of a mixture a stream, dealt by weight
    lanes = stream_lanes(
        config.data, config.model.task, tokenizer, plan.global_batch_size, config.train.seed
    )
    return StreamBatcher(
        lanes,
        config.data,
        tokenizer,
        _sharding(plan, place),
        total_over_ranks=total_over_ranks,
        writes_position=place.counts_tokens,
        resume_from=None if resume is None else (Path(resume["checkpoint"]), int(resume["step"])),
    )


def _resume(
    checkpointer: Checkpointer,
    resume: dict[str, Any] | None,
    batcher: Batcher | StreamBatcher,
    say: Any,
) -> int:
    """Load the checkpoint resume.json names; the step training continues after (0: a fresh start)."""
    if resume is None:
        return 0
    started = time.perf_counter()
    start_step = checkpointer.load(resume)
    where = (
        "epoch {}, step {} of {}".format(
            *divmod(start_step, batcher.steps_per_epoch), batcher.steps_per_epoch
        )
        if batcher.steps_per_epoch
        else "the stream continues where its lanes stood"
    )
    say(
        f"[dplaunch] resumed from {resume['checkpoint']} in {time.perf_counter() - started:.2f} s: "
        f"step {start_step} ({where}); the next batch is step {start_step + 1}"
    )
    return start_step


def _stop_early(run: RankRun, step: int, stop_reason: str) -> int:
    """Stopped early (a signal or train.stop_after_steps): checkpoint, no export, the launcher requeues."""
    if run.guard.stop_reason is not None:
        return _stop_nonfinite(run, step, stop_reason)
    checkpointer = run.checkpointer
    if checkpointer.last_saved_step == step and checkpointer.holds_last_saved():
        # the periodic save of this step, or the checkpoint this launch resumed from (when
        # it is this run's: `--resume auto` looks only here)
        saved = checkpointer.last_saved_path
    else:
        saved = checkpointer.save(step, run.batcher.steps_per_epoch, stop_reason)
    status = 0 if stop_reason == STOP_AFTER_STEPS else EXIT_CHECKPOINTED
    run.metrics.write("stop", step=step, reason=stop_reason, checkpoint=str(saved))
    checkpointer.write_stop_record(step, stop_reason, saved, status)
    run.say(
        f"[dplaunch] stopped at step {step}/{run.total_steps} ({stop_reason}); checkpoint {saved}; "
        "continue with `dplaunch train ... --resume auto`"
    )
    run.metrics.close()
    run.accelerator.end_training()
    # the rank itself exits 0 (torchrun would report any other status as a crash);
    # `dplaunch train` turns the stop record into its exit status
    return 0


def _stop_nonfinite(run: RankRun, step: int, stop_reason: str) -> int:
    """The non-finite guard stopped the run: nothing of the bad step is saved, the newest
    checkpoint is the last good one; `dplaunch train` exits EXIT_NONFINITE on the stop record."""
    good = run.checkpointer.last_saved_path or "none"
    run.metrics.write("stop", step=step, reason=stop_reason, checkpoint=str(good))
    run.checkpointer.write_stop_record(step, stop_reason, good, EXIT_NONFINITE)
    run.say(f"[dplaunch] stopped: {stop_reason}; the last good checkpoint is {good}")
    run.metrics.close()
    run.accelerator.end_training()
    return 0


def _tokenized(
    accelerator: Any, dataset: Any, tokenizer: Any, config: RunConfig, what: str, say: Any
) -> Any:
    """DATASET tokenised: read from the tokenised cache, or built once per node and cached there."""
    task = config.model.task
    cache_file = tokenized_cache_file(dataset, tokenizer, config.data, task)
    started = time.perf_counter()
    if cache_file is None:
        # nothing shared to wait for: every rank tokenises in memory at the same time
        with library_progress(say):
            tokenized = tokenize(dataset, tokenizer, config.data, task)
        say(
            f"[dplaunch] {what} data: {len(tokenized)} samples tokenised in memory in "
            f"{time.perf_counter() - started:.2f} s (no cache for this dataset or tokenizer)"
        )
        return tokenized
    # a miss: each node's first rank tokenises and writes the file, the node's others then read it
    with accelerator.local_main_process_first():
        existed = cache_file.is_file()
        with library_progress(say):
            tokenized = tokenize(dataset, tokenizer, config.data, task, cache_file)
    done = "read from the tokenised cache" if existed else "tokenised and cached"
    say(
        f"[dplaunch] {what} data: {len(tokenized)} samples {done} in "
        f"{time.perf_counter() - started:.2f} s ({cache_file})"
    )
    return tokenized


def _partition_line(model: Any) -> str | None:
    """What rank 0 holds of a model built partitioned (ZeRO-3's zero.Init); None for a whole one."""
    parameters = list(model.parameters())
    if not parameters or not all(hasattr(p, "ds_tensor") for p in parameters):
        return None
    held = sum(p.ds_tensor.numel() for p in parameters)
    total = sum(p.ds_numel for p in parameters)
    return (
        f"model built partitioned (ZeRO-3 zero.Init): rank 0 holds {held:,} of {total:,} parameters"
    )


def build_engine(
    plan: Plan,
    config: RunConfig,
    accelerator: Any,
    model: Any,
    total_steps: int,
    run_dir: Path,
    *,
    long_sequences: dict[str, Any] | None = None,
) -> StepEngine:
    """The step engine for the planned layout (``long_sequences``: sequence_parallel.py's)."""
    from dplaunch.train.schedules import learning_rate_schedule

    def scheduler_for(optimizer: Any) -> Any:
        return learning_rate_schedule(
            config.train.scheduler,
            optimizer,
            warmup_steps=config.train.warmup_steps,
            total_steps=total_steps,
        )

    if plan.engine == "pipeline":
        from dplaunch.train.pipeline import create_pipeline_engine

        ds_config = read_deepspeed_file(run_dir)
        return create_pipeline_engine(
            model,
            num_stages=plan.pipeline_parallel_size,
            ds_config=ds_config,
            lr_scheduler_factory=scheduler_for,
            seed=config.train.seed,
            optimizer_factory=lambda module: build_optimizer(module, config.train, plan),
            task=config.model.task,
        )
    if plan.engine == "fsdp":
        from dplaunch.train.fsdp import FsdpEngine

        # sharded by hand (fully_shard), not through accelerator.prepare: see dplaunch/train/fsdp.py
        return FsdpEngine(accelerator, model, plan, config, scheduler_for)
    optimizer = build_optimizer(model, config.train, plan)
    model, optimizer = accelerator.prepare(model, optimizer)
    # on the optimizer Accelerate returns (its param_groups are those of the optimizer that really
    # steps, DeepSpeed's ZeRO optimizer's regrouped ones included), and stepped by the engine once
    # per optimizer step: Accelerate's scheduler wrapper would step it once per rank
    scheduler = scheduler_for(optimizer)
    accelerator.register_for_checkpointing(scheduler)
    engine_args = (
        accelerator,
        model,
        optimizer,
        scheduler,
        config.train.max_grad_norm,
        config.model.task,
    )
    if long_sequences:
        return LongSequenceEngine(*engine_args, **long_sequences)
    return AccelerateEngine(*engine_args)


@dataclass
class _Progress:
    """What the steps keep between them: the loss, tokens and seconds waiting for data since the
    last log line (on the device: no host sync per step), the time not spent training, every
    step's seconds for the forecast."""

    # loss, tokens, and seconds waiting for the data loader since the last log line
    interval: torch.Tensor
    start_step: int
    interval_steps: int = 0
    tokens_read: int = 0
    last_log: float = field(default_factory=time.perf_counter)
    # seconds of evaluation and checkpointing since the last log line: not training time
    paused: float = 0.0
    last_eval_step: int = -1
    stop_after: int | None = None
    # DPLAUNCH_COLLECTIVE_SPY: the collectives of one step, for the forecast's tests (None: off)
    spy: Any = None
    # every step's seconds (and its phases'), compared with plan.json's forecast at the end
    times: StepTimes = field(default_factory=StepTimes)


def _run_steps(run: RankRun, start_step: int) -> tuple[int, str | None]:
    """Train from start_step; return (the step reached, why it stopped early or None)."""
    train = run.config.train
    progress = _Progress(
        torch.zeros(3, device=run.accelerator.device),
        start_step,
        last_eval_step=start_step if train.eval_every else -1,
        # a resumed run that is already past stop_after_steps goes on
        stop_after=train.stop_after_steps if (train.stop_after_steps or 0) > start_step else None,
        spy=spy_from_environment(run.place.rank),
    )
    # train.early_stopping stops a run short of total_steps (at once: a resume of one it stopped)
    reached = start_step if run.best is not None and run.best.stopping else run.total_steps
    for step in _scheduled_steps(run, start_step):
        if reached == start_step:
            break
        stop_reason = _stop_requested(run, progress, step)
        if stop_reason is not None:
            return step, stop_reason
        step_lr, stopping = _train_step(run, progress, step)
        if stopping is not None:
            run.guard.stop_reason = stopping
            return step + 1, stopping
        _log_step(run, progress, step + 1, step_lr)
        if _evaluate_and_save(run, progress, step + 1):
            reached = step + 1
            break
    _finish_steps(run, progress, reached)
    return reached, None


def _scheduled_steps(run: RankRun, start_step: int) -> Iterator[int]:
    """The steps to train, 0-based: all from start_step, less the test seam's left-out step
    (train/nonfinite_faults.py: the reference run of tests/test_nonfinite.py), whose batch is
    read and dropped."""
    fault = nonfinite_fault_from_environment()  # TEST ONLY: None in every real run
    omitted = fault.omitted_step if fault is not None else None
    for step in range(start_step, run.total_steps):
        if step + 1 == omitted:
            run.batcher.micro_batches(step)
            continue
        yield step


def _stop_requested(run: RankRun, progress: _Progress, step: int) -> str | None:
    """Why the run stops before STEP + 1 (a signal on any rank, train.stop_after_steps), or None."""
    # all ranks decide together: a signal may have reached only some of them, or at other moments
    if run.control.any(run.signals.received is not None):
        return run.signals.received or "a signal to another rank"
    if step == progress.stop_after:
        return STOP_AFTER_STEPS
    return None


def _train_step(run: RankRun, progress: _Progress, step: int) -> tuple[float, str | None]:
    """One optimizer step (the 0-based STEP's micro-batches of this rank): its learning rate, and
    why the run must stop (train.on_nonfinite), else None."""
    waited = began = time.perf_counter()
    micro_batches = run.batcher.micro_batches(step)
    progress.interval[2] += time.perf_counter() - waited
    sampled = time.perf_counter()
    if run.rollout is not None:  # grpo: the completions, sampled and scored (not data waiting)
        micro_batches = run.rollout(step, micro_batches)
    sampled = time.perf_counter() - sampled
    engine, guard = run.engine, run.guard
    step_lr = engine.current_lr()  # the step's own (the scheduler then moves to the next)
    guard.begin(step + 1)
    progress.times.begin(run.accelerator.device, synced=guard.enabled)
    clock = engine.clock
    if clock is not None and clock.cuda:  # a GPU waits for each phase of a few steps only
        clock.enabled = progress.times.phase_timed
    with watched(progress.spy, step + 1):
        loss = engine.train_step(micro_batches)
    if run.place.counts_tokens:
        progress.interval[1] += sum(batch_tokens(b) for b in micro_batches)
    stopping = guard.verdict()
    phases = dict(clock.seconds) if clock is not None else {}
    if run.rollout is not None and phases:  # the forecast's generate phase
        phases["generate"] = sampled
    progress.times.end(began, phases)
    if guard.event is None:
        progress.interval[0] += loss
        progress.interval_steps += 1
    elif stopping is None:  # a skipped update's loss is no training loss
        run.metrics.write("skipped", step=step + 1, reason=guard.event.describe())
        run.say(f"[dplaunch] {guard.event.describe()}: update skipped on every rank")
    return step_lr, stopping


def _log_step(run: RankRun, progress: _Progress, step: int, step_lr: float) -> None:
    """Every train.log_every steps (and at the last): the mean loss over all ranks, tokens/s,
    the share of time spent waiting for data, the step time and MFU."""
    if not progress.interval_steps or (
        step % run.config.train.log_every and step != run.total_steps
    ):
        return
    totals = run.accelerator.reduce(progress.interval.clone(), reduction="sum")
    now = time.perf_counter()
    progress.tokens_read += int(totals[1])
    spent = max(now - progress.last_log - progress.paused, 1e-9)
    world, steps, forecast = run.place.world_size, progress.interval_steps, run.plan.forecast
    record = {
        "step": step,
        "epoch": run.batcher.epoch_at(step),
        "loss": float(totals[0]) / world / steps,
        "lr": step_lr,
        "tokens_per_s": float(totals[1]) / spent,
        # tokens trained on so far in this launch, and the share of the time the ranks
        # waited for their data loader (a slow loader shows here, not as a slow model)
        "tokens": progress.tokens_read,
        "data_share": round(min(float(totals[2]) / world / spent, 1.0), 4),
        "step_time_s": round(spent / steps, 6),
        # the model's FLOPs per second over the ranks' peak (needs plan.json's forecast)
        **({"mfu": round(mfu(forecast, spent / steps), 5)} if forecast else {}),
        "elapsed_s": round(time.time() - run.metrics.start, 3),
        **memory_fields(run.accelerator.device),
    }
    if run.objective is not None:  # dpo: rewards and log-probabilities, as TRL names them
        record.update(run.objective.log_record(run.accelerator.reduce))
    run.metrics.write("train", **record)
    shown = run.objective.shown if run.objective is not None else ()
    if shown:  # grpo: a few of the step's completions with their rewards (rank 0's first)
        run.metrics.write("completions", step=step, completions=shown)
        run.metrics.text(
            "completions", "\n\n".join(json.dumps(s, default=str) for s in shown), step
        )
        run.objective.shown = []
    run.say.train_step(step, run.total_steps, record, progress.start_step)
    progress.interval.zero_()
    progress.interval_steps = 0
    progress.last_log, progress.paused = now, 0.0


def _evaluate_and_save(run: RankRun, progress: _Progress, step: int) -> bool:
    """Every train.eval_every steps an evaluation, every train.checkpoint_every a checkpoint
    (train.keep_best: one at every evaluation); whether train.early_stopping stops the run."""
    train = run.config.train
    evaluated = bool(run.eval_batchers and train.eval_every and step % train.eval_every == 0)
    if evaluated:
        began = time.perf_counter()
        _evaluate(run, step)
        progress.last_eval_step = step
        progress.paused += time.perf_counter() - began
    periodic = bool(train.checkpoint_every and step % train.checkpoint_every == 0)
    if periodic or (evaluated and train.keep_best):
        began = time.perf_counter()
        steps_per_epoch = run.batcher.steps_per_epoch
        reason = f"every {train.checkpoint_every} steps" if periodic else "train.keep_best"
        run.checkpointer.save(step, steps_per_epoch, reason)
        progress.paused += time.perf_counter() - began
    if evaluated and run.best is not None and run.best.stopping:
        run.say(f"[dplaunch] {run.best.stop_line()}")
        return True
    return False


def _finish_steps(run: RankRun, progress: _Progress, step: int) -> None:
    """After the last step (STEP): an evaluation unless one was just made (train.keep_best: and
    its checkpoint), and the summary record (with the measured step beside the forecast)."""
    if run.eval_batchers and progress.last_eval_step != step:
        _evaluate(run, step)
        if run.config.train.keep_best:
            run.checkpointer.save(step, run.batcher.steps_per_epoch, "train.keep_best")
    # restarts: how many automatic restarts (launch.max_restarts) this run needed to get here
    skipped = run.guard.skipped_total
    run.metrics.write(
        "summary",
        step=step,
        wall_s=round(time.time() - run.metrics.start, 3),
        restarts=restarts_so_far(),
        **({"skipped_steps": skipped} if skipped else {}),
        **(_best_fields(run.best) if run.best is not None else {}),
        **_against_forecast(run, progress.times),
    )


def _best_fields(best: BestTracker) -> dict[str, Any]:
    """The summary's fields of train.early_stopping / train.keep_best."""
    fields: dict[str, Any] = {"best_metric": best.metric, "best": best.best}
    fields["best_step"] = best.best_step
    if best.stopping:
        fields["early_stopped_at"] = best.stopped_at
    return fields


def _against_forecast(run: RankRun, times: StepTimes) -> dict[str, Any]:
    """The measured median step beside plan.json's forecast (planning/forecast.py), and the
    line that names the most wrong term when they are more than 25 % apart."""
    measured = times.median_step()
    if measured is None:
        return {}
    forecast = run.plan.forecast
    if forecast is None:
        return {"step_time_s": round(measured, 6)}
    joined = run.engine.clock.joined if run.engine.clock is not None else ()
    comparison = compare_with_forecast(forecast, measured, times.median_phases(), joined)
    comparison["mfu"] = round(mfu(forecast, measured), 5)
    line = comparison.get("forecast_note") or (
        f"measured {measured:.3g} s/step, forecast {forecast['step_time_s']:.3g} s/step "
        f"({comparison['forecast_ratio']:.2f}×)"
    )
    run.say(f"[dplaunch] {line}")
    return comparison


def _evaluate(run: RankRun, step: int) -> None:
    """The task's metrics on each evaluation set (eval_loss, …; eval_<name>_loss, … for
    data.eval_datasets), summed over the data-parallel shards; train.early_stopping and
    train.keep_best's record takes them."""
    record: dict[str, Any] = {"step": step}
    for prefix, batcher in run.eval_batchers.items():
        record.update(_eval_metrics(batcher.task, _eval_totals(run, batcher), prefix))
    run.metrics.write("eval", **record)
    run.say(
        "eval  "
        + "  ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
        )
    )
    if run.best is not None:  # train.keep_best saves this step's checkpoint next
        saved = run.checkpointer.directory / step_dir(step) if run.config.train.keep_best else None
        run.best.observe(step, record, saved)
    if run.sampler is not None:
        _log_samples(run, step)


def _eval_totals(run: RankRun, batcher: Batcher) -> torch.Tensor:
    """(loss sum, rows or tokens, correct) of one evaluation set over every rank."""
    engine, accelerator, place = run.engine, run.accelerator, run.place
    # grpo: the rewards of sampled completions
    totals = run.objective.eval_totals(batcher) if run.objective is not None else None
    if totals is not None:
        return accelerator.reduce(totals, reduction="sum")
    sums = torch.zeros(3, device=accelerator.device)
    for batch, real in batcher.eval_micro_batches(batcher.eval_rows(run.plan.micro_batch_size)):
        losses, counts, correct = engine.eval_batch(batch)
        # padded rows (weight 0) keep every rank's forward count equal without counting twice
        weight = torch.zeros_like(losses)
        weight[:real] = 1.0
        sums += torch.stack(
            [(losses * weight).sum(), (counts * weight).sum(), (correct * weight).sum()]
        )
    # TP/PP copies of a shard count once; so do SP copies, unless each evaluated its own slice
    if not place.counts_eval(sliced=engine.evaluates_slices):
        sums.zero_()
    return accelerator.reduce(sums, reduction="sum")


def _eval_metrics(task: str, totals: torch.Tensor, prefix: str) -> dict[str, float]:
    """The task's evaluation metrics (Task.eval_metrics names them), PREFIX_NAME:
    the mean loss, and the share correct (classes, preferred responses, next tokens)."""
    loss, share = float(totals[0] / totals[1]), float(totals[2] / totals[1])
    values = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "accuracy": share,
        "token_accuracy": share,
        "rewards/accuracies": share,
        # grpo's totals are (reward sum, completions, reward² sum)
        "reward": loss,
        "reward_std": math.sqrt(max(share - loss**2, 0.0)),
    }
    return {f"{prefix}_{name}": values[name] for name in task_of(task).eval_metrics}


def _log_samples(run: RankRun, step: int) -> None:
    """train.sample_prompts: rank 0 generates (every rank where forwards are collective: ZeRO-3,
    TP, FSDP) and logs the answers to metrics.jsonl, TensorBoard text and the log."""
    from dplaunch.train.samples import sample_line

    plan, accelerator = run.plan, run.accelerator
    synced = plan.forwards_are_collective
    if not (synced or run.place.is_main):
        return
    model = accelerator.unwrap_model(run.engine.model)
    samples = run.sampler.answers(model, accelerator.device, synced=synced)
    run.metrics.write("samples", step=step, samples=samples)
    run.metrics.text("samples", "\n\n".join(sample_line(sample) for sample in samples), step)
    for sample in samples:
        run.say(f"sample  {sample_line(sample)}")


def _model_files_writer(model: Any, tokenizer: Any) -> Any:
    """What rank 0 writes into each checkpoint besides the weights: the HF config files and the
    tokenizer, from which `dplaunch export` rebuilds the model (run_directory.layout.MODEL_FILES_DIR)."""

    def write(folder: Path) -> None:
        model.config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return write


def _quiet_libraries(is_main: bool) -> None:
    # progress bars and load reports from every rank drown the log; rank 0 keeps the warnings
    import datasets
    import transformers

    datasets.disable_progress_bars()
    # bitsandbytes' CPU backend (imported by transformers and peft when installed) logs on every
    # rank that it could not fetch an optional kernel from the Hub; it falls back to its own
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning() if is_main else transformers.utils.logging.set_verbosity_error()
    # DeepSpeed's ZeRO calls torch.distributed's collectives by their deprecated names: a
    # FutureWarning per call site (26 lines under ZeRO-3) that only DeepSpeed can act on
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
