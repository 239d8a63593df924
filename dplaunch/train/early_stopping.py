"""train.early_stopping and train.keep_best in the ranks: the best evaluation so far, when the run
stops for want of improvement, and which checkpoint holds the best weights.

Every rank keeps the same record (the evaluation's values are reduced over all ranks), so they
stop at the same step without a collective. The record goes into every checkpoint's
checkpoint.json ("best"), so a resume or a restart continues it: the same evaluations count, the
same checkpoint stays the best, and a run that had already stopped stops again at once. With
keep_best the best checkpoint is never rotated away by train.keep_last, and the end of the run
exports it (export_best).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dplaunch.config.schema import RunConfig, evaluation_prefixes

# checkpoint.json's key holding the record
META_KEY = "best"


@dataclass
class BestTracker:
    """The watched metric's best value, its step and checkpoint, and the evaluations since."""

    metric: str
    lower_is_better: bool
    min_delta: float
    # evaluations without improvement that stop the run (None: keep_best alone never stops it)
    patience: int | None
    best: float | None = None
    best_step: int | None = None
    best_checkpoint: str | None = None
    waited: int = 0
    # the step whose evaluation stopped the run (None: not stopped)
    stopped_at: int | None = None

    @classmethod
    def of(cls, config: RunConfig) -> BestTracker | None:
        """The run's tracker (None without early stopping or keep_best)."""
        train = config.train
        stopping = train.early_stopping
        if stopping is None and not train.keep_best:
            return None
        if stopping is not None:
            return cls(
                stopping.metric, stopping.lower_is_better, stopping.min_delta, stopping.patience
            )
        # keep_best alone: the loss of the (first) evaluation set
        return cls(f"{evaluation_prefixes(config.data)[0]}_loss", True, 0.0, None)

    def observe(self, step: int, record: dict[str, Any], checkpoint: Path | None) -> bool:
        """Take the evaluation RECORD of STEP (its checkpoint: CHECKPOINT, None without one);
        whether it is the best so far. The evaluation at step 0 (before training) counts not."""
        if step == 0:
            return False
        value = float(record[self.metric])
        gain = (
            (self.best - value if self.lower_is_better else value - self.best)
            if (self.best is not None)
            else None
        )
        if gain is None or gain > self.min_delta:
            self.best, self.best_step, self.waited = value, step, 0
            self.best_checkpoint = str(checkpoint) if checkpoint is not None else None
            return True
        self.waited += 1
        if self.patience is not None and self.waited >= self.patience:
            self.stopped_at = step
        return False

    @property
    def stopping(self) -> bool:
        """Whether the run stops: `patience` evaluations in a row did not improve."""
        return self.stopped_at is not None

    def stop_line(self) -> str:
        """Why and where the run stopped."""
        assert self.best is not None and self.best_step is not None
        better = "below" if self.lower_is_better else "above"
        return (
            f"early stopping at step {self.stopped_at}: {self.metric} has not gone "
            f"{better} its best {self.best:.4f} (step {self.best_step}) by more than "
            f"{self.min_delta:g} for {self.waited} evaluation(s) (train.early_stopping.patience "
            f"{self.patience})"
        )

    def kept(self) -> Path | None:
        """The best checkpoint, which checkpoint rotation keeps."""
        return Path(self.best_checkpoint) if self.best_checkpoint else None

    def meta(self) -> dict[str, Any]:
        """The record, for checkpoint.json."""
        return {META_KEY: asdict(self)}

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue the record a checkpoint's checkpoint.json holds (none: a fresh record). A
        changed metric or rule starts afresh from the checkpoint's step."""
        saved = meta.get(META_KEY)
        if not saved or saved.get("metric") != self.metric:
            return
        if saved.get("lower_is_better") != self.lower_is_better:
            return
        self.best, self.best_step = saved["best"], saved["best_step"]
        self.best_checkpoint, self.waited = saved["best_checkpoint"], int(saved["waited"])
        if self.patience is not None and self.waited >= self.patience:
            self.stopped_at = saved.get("stopped_at") or int(meta.get("step", 0))


def export_best(run: Any, best: Path, model_dir: Path, adapter_dir: Path) -> None:
    """train.keep_best: the BEST checkpoint's weights (not the live ones) as MODEL_DIR (a LoRA
    run: ADAPTER_DIR, and MODEL_DIR when merged). Rank 0 reads them from the checkpoint's files,
    whatever layout wrote it, as `dplaunch export` does; AutoTP shards only a live DeepSpeed
    engine joins, so there the ranks load the checkpoint's weights into theirs (its tp must be
    the run's). RUN: the loop's RankRun (engine, config, plan, tokenizer, place, accelerator)."""
    from dplaunch.planning.plan import Plan
    from dplaunch.run_directory.files import read_checkpoint_meta, read_plan_file

    plan, config = run.plan, run.config
    saved = Plan.from_dict(read_plan_file(best))
    if plan.tensor_parallel_size > 1 and plan.engine != "fsdp":
        from dplaunch.train.export_weights import load_module_weights

        if saved.tensor_parallel_size != plan.tensor_parallel_size:
            raise ValueError(
                f"the best checkpoint {best} holds tp {saved.tensor_parallel_size} shards and "
                f"this launch runs tp {plan.tensor_parallel_size}: export it with `dplaunch "
                f"export {best} --out DIR`"
            )
        load_module_weights(run.engine.model, best)
        run.engine.export(str(model_dir), run.tokenizer)
        return
    if run.place.is_main:
        _write_checkpoint_export(
            config, best, saved, read_checkpoint_meta(best), run.tokenizer, model_dir, adapter_dir
        )
    run.accelerator.wait_for_everyone()


def _write_checkpoint_export(
    config: RunConfig,
    best: Path,
    saved: Any,
    meta: dict[str, Any],
    tokenizer: Any,
    model_dir: Path,
    adapter_dir: Path,
) -> None:
    """Rank 0: BEST's weights, read from its files, written as the run's export."""
    from dplaunch.train.export_weights import (
        CONVERTED,
        consolidated_state_dict,
        write_checkpoint_model,
    )

    engine = CONVERTED if meta.get("format") is not None else saved.engine
    if config.model.lora is None:
        from dplaunch.train.modeling import checkpoint_model

        model = checkpoint_model(best, config.model)
        write_checkpoint_model(
            best, config.model_copy(update={"model": model}), engine, model_dir, tokenizer
        )
        return
    from dplaunch.train.lora_export import write_exports

    merged = config.model.lora.export == "merged"
    state = consolidated_state_dict(best, engine)
    write_exports(
        config,
        saved.mixed_precision,
        tokenizer,
        state,
        adapter_dir,
        model_dir if merged else None,
    )
