"""The run file: a pydantic model of the YAML a user writes, documented field by field.

Unknown keys are errors everywhere (``extra="forbid"``): a typo must never be silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Task = Literal["causal-lm", "sequence-classification", "sft"]
# tasks that train a causal LM (sft: on formatted examples, the loss on their answers)
CAUSAL_TASKS = ("causal-lm", "sft")
SftFormat = Literal["conversational", "prompt-completion", "text"]
MixedPrecision = Literal["no", "fp16", "bf16"]
Offload = Literal["none", "optimizer", "all"]
Scheduler = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"
]


# model.tokenizer naming dplaunch's built-in 259-token tokenizer (no files)
BYTE_LEVEL = "byte-level"


class FieldProblem(ValueError):
    """A validator's verdict on one key, with its fix; config.load turns it into a UserError.

    ``key`` is relative to where pydantic reports the error (the section a model validator
    belongs to), e.g. "micro_batch_size" inside "train"; "" for the section itself.
    """

    def __init__(self, key: str, problem: str, fix: str):
        super().__init__(problem)
        self.key, self.problem, self.fix = key, problem, fix


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    # hub id or local directory of a pretrained model
    name_or_path: str | None = None
    # a dict of HF config fields (with "model_type"): build a randomly initialised model instead
    config: dict[str, Any] | None = None
    # tokenizer id/dir; defaults to name_or_path; "byte-level" is a built-in 259-token tokenizer
    tokenizer: str | None = None
    task: Task = "causal-lm"
    # number of classes for sequence-classification: labels are class numbers 0…num_labels-1
    # (1, HF's regression, would train nothing under the loop's cross-entropy)
    num_labels: int = Field(2, ge=2)
    # executes code shipped with a hub model: off unless the user says so
    trust_remote_code: bool = False
    # activation (gradient) checkpointing in the model's blocks
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.name_or_path is None and self.config is None:
            raise ValueError(
                "set model.name_or_path (hub id or local dir) or model.config (a dict)"
            )
        if self.name_or_path is not None and self.config is not None:
            raise ValueError("set only one of model.name_or_path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (e.g. llama, gpt2, bert)")
        return self


class DataConfig(Section):
    # hub id, or local file(s): .json/.jsonl/.csv/.txt/.parquet (a list for several files)
    dataset: str | list[str]
    # the configuration (subset) of a hub dataset, as load_dataset(dataset, dataset_config):
    # glue needs sst2, wikitext needs wikitext-2-raw-v1, …
    dataset_config: str | None = None
    split: str = "train"
    # a named split of the same (hub) dataset for evaluation ...
    eval_split: str | None = None
    # ... or separate local file(s) for evaluation ...
    eval_dataset: str | list[str] | None = None
    # ... or a fraction of the training split held out for evaluation
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    text_column: str = "text"
    # optional second text column for sentence-pair classification
    text_pair_column: str | None = None
    label_column: str = "label"
    # sequence-classification: the classes' names in class-number order. Labels may then be
    # names or numbers; model.num_labels follows, and the exported config gets id2label
    label_names: list[str] | None = None
    max_length: int = Field(128, ge=8)
    # concatenate texts into full max_length blocks (causal-lm only); default on for causal-lm.
    # sft: pack whole examples into blocks of at most max_length tokens, each example attending
    # only to itself (position ids restart per example); default off for sft
    packing: bool | None = None
    # sft: the examples' format; unset = from the columns (messages → conversational, prompt and
    # completion → prompt-completion, data.text_column → text)
    format: SftFormat | None = None
    # sft: a Jinja chat template (the text, or a file holding it) used instead of the tokenizer's
    chat_template: str | None = None
    # sft: the tokens the loss is on: the answers (assistant turns with their end-of-turn token,
    # completions) or every token
    loss_on: Literal["answers", "all"] = "answers"
    # sft: an example longer than max_length is cut to it, or left out; one with no answer token
    # left after the cut is always left out (counted before launch)
    truncation: Literal["truncate", "drop"] = "truncate"
    # processes that tokenise the data when it is not cached yet (0: the rank itself)
    num_workers: int = Field(0, ge=0)

    @field_validator("label_names")
    @classmethod
    def _distinct_names(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return names
        if len(names) < 2:
            raise FieldProblem(
                "", "names fewer than 2 classes", "list every class, 2 or more, in class order"
            )
        for number, name in enumerate(names):
            if not name.strip():
                raise FieldProblem("", f"class {number} has an empty name", "name every class")
            if name in names[:number]:
                raise FieldProblem(
                    "",
                    f"{name!r} is listed twice (classes {names.index(name)} and {number})",
                    "list each class once",
                )
        return names

    @model_validator(mode="after")
    def _eval_choice(self) -> DataConfig:
        chosen = [self.eval_split, self.eval_dataset, self.eval_fraction]
        if sum(item is not None for item in chosen) > 1:
            raise ValueError(
                "set only one of data.eval_split, data.eval_dataset and data.eval_fraction"
            )
        return self


class TrainConfig(Section):
    # samples per optimizer step over all data-parallel ranks (kept when the GPU count changes)
    global_batch_size: int = Field(32, ge=1)
    # samples per forward pass per rank; derived when unset
    micro_batch_size: int | None = Field(None, ge=1)
    # optimizer steps; wins over epochs when both are set
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    lr: float = Field(5e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    scheduler: Scheduler = "linear"
    warmup_steps: int = Field(0, ge=0)
    # 0 disables clipping
    max_grad_norm: float = Field(1.0, ge=0)
    mixed_precision: MixedPrecision = "no"
    seed: int = 42
    log_every: int = Field(10, ge=1)
    # optimizer steps between evaluations; unset = evaluate at the end only
    eval_every: int | None = Field(None, ge=1)
    # steps between checkpoints; unset = no periodic checkpoint
    checkpoint_every: int | None = Field(None, ge=1)
    # newest checkpoints kept on disk
    keep_last: int = Field(2, ge=1)
    # stop (checkpoint, exit 0) at this step as if preempted; the schedule keeps max_steps
    stop_after_steps: int | None = Field(None, ge=1)
    # torch.compile the model (measured effect in the README's Performance section)
    compile: bool = False
    # sft: a file of prompts (JSON lines {"prompt": text or messages}, or one text per line) that
    # rank 0 answers greedily at each evaluation, logged to metrics.jsonl and TensorBoard
    sample_prompts: str | None = None

    @model_validator(mode="after")
    def _micro_fits(self) -> TrainConfig:
        if self.micro_batch_size is not None and self.micro_batch_size > self.global_batch_size:
            raise FieldProblem(
                "micro_batch_size",
                f"train.micro_batch_size {self.micro_batch_size} is larger than "
                f"train.global_batch_size {self.global_batch_size} (samples per step over all ranks)",
                f"use a micro batch of at most {self.global_batch_size} (a divisor of it), "
                "or raise train.global_batch_size",
            )
        return self


class ParallelConfig(Section):
    # 0 = plain DDP; 1/2/3 = DeepSpeed ZeRO stage
    zero_stage: int = Field(0, ge=0, le=3)
    # ZeRO offload to CPU: optimizer states, or optimizer states and parameters ("all", ZeRO-3)
    offload: Offload = "none"
    # tensor-parallel degree (DeepSpeed AutoTP)
    tp: int = Field(1, ge=1)
    # pipeline-parallel degree (DeepSpeed pipeline engine)
    pp: int = Field(1, ge=1)
    # let `dplaunch plan` pick zero_stage/offload/tp/pp (YAML: `parallel: auto`)
    auto: bool = False


class LaunchConfig(Section):
    # total GPUs (ranks) over all nodes; unset = every visible GPU (1 CPU rank without GPUs)
    gpus: int | None = None
    nodes: int = Field(1, ge=1)
    # unset = gpus / nodes
    gpus_per_node: int | None = Field(None, ge=1)
    # this node's rank in a multi-node job
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    # unset = 29500 if free (a free port otherwise) on one node; derived from the job id in SLURM
    master_port: int | None = Field(None, ge=1024, le=65535)
    # run ranks on CPU with gloo even when GPUs are visible
    cpu: bool = False
    # collective timeout: a rank stuck this long fails the job instead of hanging it
    timeout_minutes: float = Field(30, gt=0)
    # DeepSpeed hostfile ("host slots=G" lines) for multi-node launch over pdsh/ssh
    hostfile: str | None = None
    # GiB per GPU that `parallel: auto` plans for; unset = what nvidia-smi reports
    gpu_memory_gb: float | None = Field(None, gt=0)

    @field_validator("gpus")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise FieldProblem(
                "",
                f"{value} ranks requested: it counts GPUs, or CPU ranks with launch.cpu",
                "give 1 or more (without a GPU, --gpus N runs N CPU ranks)",
            )
        return value


class RunConfig(Section):
    """One training run, as resolved from the YAML file, flags and --set overrides."""

    name: str | None = None
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    launch: LaunchConfig = LaunchConfig()
    # the run directory: resolved config, rendered files, metrics, checkpoints, exported model
    output_dir: str | None = None

    @model_validator(mode="after")
    def _classes(self) -> RunConfig:
        names = self.data.label_names
        if names is None:
            return self
        if self.model.task != "sequence-classification":
            raise FieldProblem(
                "data.label_names",
                f"names classes, but model.task is {self.model.task}",
                "remove it, or set model.task: sequence-classification",
            )
        if "num_labels" not in self.model.model_fields_set:
            self.model.num_labels = len(names)
        elif self.model.num_labels != len(names):
            raise FieldProblem(
                "model.num_labels",
                f"is {self.model.num_labels}, but data.label_names lists {len(names)} classes",
                "make them agree, or leave model.num_labels out (it follows data.label_names)",
            )
        return self

    @model_validator(mode="after")
    def _sft_keys(self) -> RunConfig:
        # values other than the defaults (run.yaml, as the ranks read it, lists every key)
        if self.model.task == "sft":
            return self
        data, train = self.data, self.train
        given = [
            f"data.{key}"
            for key in ("format", "chat_template", "loss_on", "truncation")
            if getattr(data, key) != DataConfig.model_fields[key].default
        ]
        if train.sample_prompts is not None:
            given.append("train.sample_prompts")
        if given:
            raise FieldProblem(
                given[0],
                f"is for supervised fine-tuning, but model.task is {self.model.task}",
                "remove it, or set model.task: sft",
            )
        return self

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel_auto(cls, value: Any) -> Any:
        if value == "auto":
            return {"auto": True}
        if isinstance(value, str):
            raise FieldProblem(
                "",
                f"{value!r} is not a layout: the only word allowed here is auto",
                "write parallel: auto (or --parallel auto), or a mapping such as "
                "parallel: {zero_stage: 2, tp: 1, pp: 1}",
            )
        return value


class ScriptRunConfig(Section):
    """The sections `dplaunch launch SCRIPT` uses: a user script brings its own model and data."""

    name: str | None = None
    model: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    launch: LaunchConfig = LaunchConfig()
    output_dir: str | None = None
