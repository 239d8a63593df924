"""The run file: a pydantic model of the YAML a user writes, documented field by field.

Unknown keys are errors everywhere (``extra="forbid"``): a typo must never be silently ignored.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dplaunch.config.flags import (
    AttentionImplementation,
    FsdpMode,
    LoraQuantize,
    MixedPrecision,
    Offload,
    TaskName,
)
from dplaunch.run_directory.layout import (
    ADAPTER_DIR,
    ADAPTER_LAST_DIR,
    EXPORT_DIR,
    EXPORT_LAST_DIR,
    METRICS_FILE,
    TENSORBOARD_DIR,
)
from dplaunch.tasks import EXAMPLE_MAX_LENGTH, TASKS, key_owner, task_of

PreferenceLoss = Literal["sigmoid", "ipo", "orpo", "simpo"]
# the losses that compare the policy with a reference model (the others need none)
REFERENCE_LOSSES = ("sigmoid", "ipo")
# the train.preference keys each loss reads besides beta (train/preference.py's PairTerms)
LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "sigmoid": ("label_smoothing",),
    "ipo": (),
    "orpo": (),
    "simpo": ("label_smoothing", "simpo_gamma"),
}
SftFormat = Literal["conversational", "prompt-completion", "text", "prompt-only"]


def evaluation_prefixes(data: Any) -> list[str]:
    """The prefix of each evaluation set's metrics: `eval` for one set, `eval_<name>` for each of
    data.eval_datasets; [] without evaluation."""
    if data.eval_datasets:
        return [f"eval_{name}" for name in data.eval_datasets]
    held = (data.eval_split, data.eval_dataset, data.eval_fraction)
    return ["eval"] if any(item is not None for item in held) else []


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


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="Rank of each adapter (the `r` of LoRA).")
    alpha: float | None = Field(
        None,
        gt=0,
        description="Scaling numerator: the update is scaled by alpha / r; unset: 2 × r.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (peft's lora_dropout)."
    )
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Which linear layers get adapters: `all-linear` (every linear layer but the output head) or a list of module names, e.g. `[q_proj, v_proj]`.",
    )
    modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained in full and saved with the adapter (e.g. `[score]`, `[embed_tokens]`).",
    )
    quantize: LoraQuantize | None = Field(
        None,
        description="QLoRA: hold the frozen base weights in 4-bit (nf4, bf16 compute) or 8-bit through bitsandbytes (the `[qlora]` extra).",
    )
    use_dora: bool = Field(
        False,
        description="DoRA: each adapted weight split into a magnitude (trained) and a direction the adapter updates (peft's use_dora); more compute a step.",
    )
    use_rslora: bool = Field(
        False,
        description="rsLoRA: scale the update by alpha / √r instead of alpha / r (peft's use_rslora), which keeps high ranks learning.",
    )
    init: Literal["default", "gaussian", "pissa", "olora"] = Field(
        "default",
        description="The adapters' initialisation (peft's init_lora_weights): `default` (A Kaiming-uniform, B zero), `gaussian`, or `pissa`/`olora`, which start from the weight's principal singular vectors (PiSSA) or its QR factors (OLoRA) and take them out of the base; their adapter export is converted to a plain LoRA of rank 2r on the original base (peft's conversion).",
    )
    export: Literal["merged", "adapter-only"] = Field(
        "merged",
        description="What the end of training writes: `merged` the PEFT folder (`RUN/adapter`) and the model merged with it (`RUN/model`), for which rank 0 builds the whole base again in host RAM, in the dtype it trained in (`bf16`/`fp16` under mixed precision; QLoRA: the checkpoint's own dtype); `adapter-only` the PEFT folder alone, without building a pretrained base (PeftModel.from_pretrained on the base loads it; `merge_and_unload()` merges it later).",
    )

    @property
    def moves_base(self) -> bool:
        """Whether the adapters' start is taken out of the base weights (PiSSA, OLoRA): training
        runs on a residual base, which the exports build again."""
        return self.init in ("pissa", "olora")


class ModelConfig(Section):
    name_or_path: str | None = Field(
        None,
        description="Hub id or local Hugging Face folder of a pretrained model (set this or `model.config`).",
    )
    config: dict[str, Any] | None = Field(
        None,
        description="A dict of Hugging Face config fields with `model_type`: a randomly initialised model instead of a pretrained one.",
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer hub id or folder; unset: `model.name_or_path`. `byte-level` is a built-in 259-token tokenizer (no files).",
    )
    task: TaskName = Field(
        "causal-lm",
        description="What the run trains (dplaunch/tasks/): "
        + "; ".join(f"`{task.name}`: {task.summary}" for task in TASKS.values())
        + " (see Fine-tuning chat models, Preference tuning).",
    )
    num_labels: int = Field(
        2,
        ge=2,
        description="Classes for sequence classification, 2 or more; follows `data.label_names` when that is set (1, HF's regression, would train nothing under the loop's cross-entropy).",
    )
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with a hub model: off unless you say so."
    )
    gradient_checkpointing: bool | str = Field(
        False,
        description="Activation (gradient) checkpointing of the model's blocks: `true` (every block), `every-K` (blocks 0, K, 2K…: selective, torchtitan's), or `false`. A checkpointed block keeps only its input and recomputes its forward in the backward: less activation memory, more compute (the plan counts both).",
    )
    attn_implementation: AttentionImplementation | None = Field(
        None,
        description="Attention kernel: `eager` keeps every head's s×s score matrix for the backward, the others never build it; unset: what transformers picks (`sdpa` where the model supports it, else `eager`). `flash_attention_*` runs on CUDA GPUs in bf16/fp16 only; `flex_attention` trains on GPUs only and not with sequence parallelism.",
    )

    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (peft) instead of every weight; the base model stays frozen. See Fine-tuning chat models.",
    )

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

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _every_k(cls, value: Any) -> Any:
        if isinstance(value, bool) or value is None:
            return bool(value)
        text = str(value).strip().lower()
        if text in ("true", "on", "yes"):
            return True
        if text in ("false", "off", "no"):
            return False
        match = re.fullmatch(r"every-(\d+)", text)
        if match is None or int(match.group(1)) < 1:
            raise FieldProblem(
                "",
                f"{value!r} is neither true, false nor every-K",
                "write true (every block), false, or every-K (every K-th block, K ≥ 1)",
            )
        k = int(match.group(1))
        return True if k == 1 else f"every-{k}"

    @property
    def checkpoint_every(self) -> int:
        """Every which block is checkpointed: 0 none, 1 all, K every K-th (blocks 0, K, 2K…)."""
        value = self.gradient_checkpointing
        if isinstance(value, str):
            return int(value.split("-")[1])
        return 1 if value else 0


# what data.dataset takes, for its refusals (config/load.py's too)
DATASET_FIX = (
    "give a hub dataset id or local file(s) (.json/.jsonl/.csv/.txt/.parquet/.arrow, a glob, .gz "
    "compressed or not), a list of them, or a folder written by save_to_disk"
)
# the keys a source of data.mixture or data.eval_datasets may set for itself (unset: data's)
SOURCE_KEYS = ("dataset_config", "split", "format", "text_column", "label_column", "chat_template")
# a name of data.eval_datasets: its metrics are logged as eval_<name>_loss, … (HF Trainer's names)
EVAL_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


class DataSource(Section):
    dataset: str | list[str] = Field(
        description="Hub id, local file(s) or a `save_to_disk` folder, as `data.dataset` takes them."
    )
    dataset_config: str | None = Field(
        None, description="Its hub configuration (subset); unset: `data.dataset_config`."
    )
    split: str | None = Field(None, description="Its split; unset: `data.split`.")
    format: SftFormat | None = Field(
        None, description="sft: its examples' format; unset: `data.format` (or from its columns)."
    )
    text_column: str | None = Field(None, description="Its text column; unset: `data.text_column`.")
    label_column: str | None = Field(
        None, description="Its label column (sequence classification); unset: `data.label_column`."
    )
    chat_template: str | None = Field(
        None,
        description="sft and dpo: its chat template (text or file); unset: `data.chat_template`. The exported tokenizer keeps `data.chat_template`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        # `name: data/eval.jsonl` (or a list of files) for a source that sets nothing else
        return {"dataset": value} if isinstance(value, str | list) else value


class MixtureSource(DataSource):
    weight: float = Field(
        gt=0,
        description="Its share of the trained samples: weight ÷ the weights' sum (rows of the global batch; a block when packed).",
    )


class DataConfig(Section):
    dataset: str | list[str] | None = Field(
        None,
        description="Hub id, local file(s) (`.json/.jsonl/.csv/.txt/.parquet`, a list for several), or a folder written by `save_to_disk` (a `Dataset`, or a `DatasetDict` whose split `data.split` picks). Set this or `data.mixture`.",
    )
    mixture: list[MixtureSource] | None = Field(
        None,
        description="Several datasets mixed by weight instead of `data.dataset`: a list of sources, each `{dataset, weight}` and its own keys. Row j of step t comes from a seeded weighted interleave (see Training › Mixtures); a source that runs out repeats (its epochs counted on their own).",
    )
    dataset_config: str | None = Field(
        None,
        description="A hub dataset's configuration (subset), as `load_dataset(dataset, dataset_config)`: `sst2` of `glue`, `wikitext-2-raw-v1` of `wikitext`.",
    )
    split: str = Field("train", description="Training split.")
    eval_split: str | None = Field(
        None,
        description="Evaluation on a named split of the same hub dataset or saved `DatasetDict` (one of `eval_split`, `eval_dataset`, `eval_fraction`).",
    )
    eval_dataset: str | list[str] | None = Field(
        None, description="Evaluation on separate local file(s), or a saved `Dataset` folder."
    )
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Evaluation on this fraction of the training split, held out (of each source's, with `data.mixture`).",
    )
    eval_datasets: dict[str, DataSource] | None = Field(
        None,
        description="Several evaluation sets by name, each a source as in `data.mixture` (without weight), or its path alone: logged as `eval_<name>_loss` and the task's other metrics (HF Trainer's names).",
    )
    text_column: str = Field("text", description="Column holding the text.")
    text_pair_column: str | None = Field(
        None, description="Second text column, for sentence-pair classification."
    )
    label_column: str = Field(
        "label", description="Column holding the label (sequence classification)."
    )
    label_names: list[str] | None = Field(
        None,
        description="Sequence classification: the classes' names in class order, e.g. `[negative, positive]`. Labels may then be names or class numbers; `model.num_labels` follows, and the exported model's `id2label` names them. Unset for a cached hub dataset: its `ClassLabel` names.",
    )
    max_length: int = Field(
        128,
        ge=8,
        description=f"Tokens per sample (the block size when packing; each response with its prompt for dpo); unset: {EXAMPLE_MAX_LENGTH} for sft and dpo (as TRL: chat examples are long; the plan says how many the limit cuts), 128 otherwise.",
    )
    packing: bool | None = Field(
        None,
        description="causal-lm: concatenate texts into full `max_length` blocks (unset: on). sft: pack whole examples into blocks of at most `max_length` tokens, each example attending only to itself (position ids restart per example; unset: off).",
    )
    format: SftFormat | None = Field(
        None,
        description="sft: the examples' format; unset: from the columns (`messages` → conversational, `prompt` and `completion` → prompt-completion, `data.text_column` → text).",
    )
    chat_template: str | None = Field(
        None,
        description="sft and dpo: a Jinja chat template (the text, or a file holding it, relative to the run file) used instead of the tokenizer's.",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="sft and dpo: tool definitions (JSON schemas, as `apply_chat_template(tools=…)` takes them) the chat template renders with every conversation; a record's own `tools` column (a list, or its JSON text) wins.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        {},
        description="sft and dpo: extra variables for the chat template, as `apply_chat_template(**kwargs)`, e.g. `{enable_thinking: false}`; a record's own `chat_template_kwargs` column adds to them.",
    )
    loss_on: Literal["answers", "all"] = Field(
        "answers",
        description="sft: the tokens the loss is on: the answers (assistant turns with their end-of-turn token, completions) or every token.",
    )
    truncation: Literal["truncate", "drop"] = Field(
        "truncate",
        description="sft and dpo: an example longer than `max_length` is cut to it, or left out; one with no answer token left after the cut is always left out (both counted before launch; dpo leaves out the whole pair).",
    )
    num_workers: int = Field(
        0,
        ge=0,
        description="Processes that tokenise the data when it is not cached yet, or with `data.streaming` the data loader's worker processes of each rank (0: the rank itself); the tokens are the same for any count.",
    )
    shuffle: bool = Field(
        True,
        description="Shuffle the training samples, seeded by `train.seed`: a new permutation each epoch (streaming: each window of `data.shuffle_buffer` records, and the files' order each pass). `false`: the files' order, the same every epoch.",
    )
    streaming: bool = Field(
        False,
        description="Read the training data while training instead of tokenising and caching it whole first: the first step comes in seconds and memory stays flat on data of any size. Local JSON lines, Parquet, Arrow or text files (a glob; `.gz`/`.bz2`/`.xz` or not), or a hub dataset in `datasets`' streaming mode. Needs `train.max_steps` (or `data.count_stream`); evaluation reads `data.eval_dataset` or `data.eval_split` whole. See Training › Streaming.",
    )
    shuffle_buffer: int = Field(
        10_000,
        ge=1,
        description="Streaming with `data.shuffle`: records shuffled together (rounded up to whole rounds of a file group's lanes: a multiple of the global batch for one file); a worker holds their raw text.",
    )
    count_stream: bool = Field(
        False,
        description="Streaming: count the records before launch (one pass over the files, no tokenising) so that `train.epochs` sets the run's length; packed data's steps per pass are then estimated from the first records' tokens.",
    )

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
        chosen = [self.eval_split, self.eval_dataset, self.eval_fraction, self.eval_datasets]
        if sum(item is not None for item in chosen) > 1:
            raise ValueError(
                "set only one of data.eval_split, data.eval_dataset, data.eval_fraction and "
                "data.eval_datasets"
            )
        return self

    @model_validator(mode="after")
    def _one_training_source(self) -> DataConfig:
        check_sources(self)
        return self


def check_sources(data: DataConfig) -> None:
    """data.dataset or data.mixture (one of them), and the evaluation keys a mixture takes; raise
    FieldProblem (keys relative to the data section)."""
    if data.dataset is None and data.mixture is None:
        written = "dataset" in data.model_fields_set  # `dataset:` with no value
        raise FieldProblem(
            "dataset",
            "is empty" if written else "is unset, and so is data.mixture: nothing to train on",
            f"{DATASET_FIX}; or data.mixture (several datasets by weight)",
        )
    if data.dataset is not None and data.mixture is not None:
        raise FieldProblem(
            "mixture",
            "is set beside data.dataset: a run trains on one of them",
            "keep data.dataset for one dataset, or move it into data.mixture with a weight",
        )
    if data.mixture is not None:
        if not data.mixture:
            raise FieldProblem("mixture", "is an empty list", "list {dataset, weight} sources")
        if data.eval_split is not None:
            raise FieldProblem(
                "eval_split",
                "names a split of data.dataset, and a mixture has several datasets",
                "use data.eval_fraction (each source's share held out), data.eval_dataset or "
                "data.eval_datasets",
            )
        if data.count_stream:
            raise FieldProblem(
                "count_stream",
                "counts one stream's records, and a mixture's length is its steps",
                "set train.max_steps, and remove data.count_stream",
            )
    for name in data.eval_datasets or {}:
        if not re.match(EVAL_NAME, name):
            raise FieldProblem(
                f"eval_datasets.{name}",
                "is not a name its metrics can carry (eval_<name>_loss)",
                "use letters, digits, _ and - (e.g. chat, reviews_2)",
            )
    if data.eval_datasets == {}:
        raise FieldProblem("eval_datasets", "is empty", "name one set or more, or remove it")


class PreferenceConfig(Section):
    loss: PreferenceLoss = Field(
        "sigmoid",
        description="`sigmoid` (DPO), `ipo` (IPO: the log-ratio margin per response token, squared to 1/(2·beta)), or the reference-free `orpo` (the chosen response's NLL + beta × the odds-ratio term) and `simpo` (length-normalised log-probabilities, margin `simpo_gamma`).",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="DPO's β: how far the policy may move from the reference (IPO's τ, ORPO's λ, SimPO's β).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="`sigmoid` and `simpo`: the probability that a pair's preference is flipped (conservative DPO); 0: none.",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="`simpo`: the target reward margin γ (divided by beta in the loss)."
    )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a reference model."""
        return self.loss in REFERENCE_LOSSES


GrpoLoss = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
# TRL 1.16's newer GRPO losses, which dplaunch does not compute (yet): refused with this note
TRL_ONLY_GRPO_LOSSES = ("cispo", "sapo", "luspo", "vespo")


class GrpoConfig(Section):
    num_generations: int = Field(
        8,
        ge=2,
        description="Completions sampled per prompt (the group whose rewards set each one's advantage); must divide `train.global_batch_size`, which counts completions (as TRL).",
    )
    max_completion_length: int = Field(
        256, ge=1, description="Tokens a completion may have; it stops earlier at the EOS token."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the generation.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens of this mass."
    )
    top_k: int | None = Field(
        None, ge=1, description="Sample among the k likeliest tokens only; unset: all."
    )
    loss_type: GrpoLoss = Field(
        "dapo",
        description="`dapo` (a mean over every completion token of the step), `grpo` (each completion's token mean, then their mean), `dr_grpo` (token sum ÷ (completions × max_completion_length)) or `bnpo` (a token mean per micro-batch), as TRL 1.16 computes them.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="The KL penalty's weight against a reference model (the policy's starting weights); 0: no reference model is built.",
    )
    epsilon: float = Field(
        0.2, gt=0, description="Clipping of the probability ratio: 1 − ε below, 1 + ε above."
    )
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="The upper clipping bound's ε (DAPO's clip-higher); unset: `epsilon`.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages divided by the standard deviation of their group's rewards, of the whole batch's, or not at all (Dr. GRPO).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps on each batch of completions (μ): from the second on, the probability ratio is against the log-probabilities at generation.",
    )
    kl_bias_correction: bool = Field(
        True,
        description="With beta > 0: the KL term weighed by the probability ratio (TRL 1.16's `use_bias_correction_kl`, on by default).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Leave completions that reached `max_completion_length` without an EOS out of the loss.",
    )
    rewards: list[str | dict[str, Any]] = Field(
        description="The reward functions: built-ins `exact_match` (the final answer against a column, `{exact_match: COLUMN}`; default `answer`), `format` (`{format: REGEX}`), `length` (`{length: CHARS}`), or your own `module:function` (or `file.py:function` beside the run file) with TRL's signature `(prompts, completions, **columns) -> list[float | None]`.",
        min_length=1,
    )
    reward_weights: list[float] | None = Field(
        None,
        description="One weight per reward function (their weighted sum is the reward); unset: 1 each.",
    )
    generation_backend: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="Who generates: the training engine's own model on every rank (`transformers`); `vllm` is not supported yet.",
    )
    log_completions: int = Field(
        2,
        ge=0,
        description=f"Completions of each logged step written to {METRICS_FILE} with their rewards (rank 0's first).",
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _trl_only(cls, value: Any) -> Any:
        if value in TRL_ONLY_GRPO_LOSSES:
            raise FieldProblem(
                "",
                f"{value} is one of TRL 1.16's newer losses, which dplaunch does not compute",
                "use dapo, grpo, dr_grpo or bnpo",
            )
        return value

    @field_validator("generation_backend")
    @classmethod
    def _no_vllm(cls, value: str) -> str:
        if value == "vllm":
            raise FieldProblem(
                "",
                "vllm is not supported yet: completions are generated by the training engine's "
                "own model on every rank",
                "remove it (transformers is the default)",
            )
        return value

    @model_validator(mode="after")
    def _weights(self) -> GrpoConfig:
        weights = self.reward_weights
        if weights is not None and len(weights) != len(self.rewards):
            raise FieldProblem(
                "reward_weights",
                f"has {len(weights)} weight(s) for {len(self.rewards)} reward function(s)",
                "give one weight per entry of train.grpo.rewards, or remove it",
            )
        return self


class EarlyStoppingConfig(Section):
    metric: str = Field(
        "eval_loss",
        description="The logged evaluation metric watched: `eval_loss`, `eval_<name>_loss` with `data.eval_datasets`, or another the task logs (`eval_accuracy`, `eval_token_accuracy`, …).",
    )
    patience: int = Field(
        3, ge=1, description="Evaluations in a row without improvement that stop the run."
    )
    min_delta: float = Field(
        0.0,
        ge=0,
        description="An improvement is a change beyond the best so far by more than this.",
    )
    mode: Literal["min", "max"] | None = Field(
        None,
        description="`min` (lower is better) or `max`; unset: `min` for a loss or perplexity, `max` for the others (HF Trainer's rule).",
    )

    @property
    def lower_is_better(self) -> bool:
        """Whether a lower value of the metric is an improvement."""
        if self.mode is not None:
            return self.mode == "min"
        return "loss" in self.metric or "perplexity" in self.metric


class TrainConfig(Section):
    global_batch_size: int = Field(
        32,
        ge=1,
        description="Samples per optimizer step over all data-parallel ranks, kept when the GPU count changes.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per forward pass per rank; unset: the largest divisor of the per-rank batch up to 8.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps; wins over `epochs`. Unset with `epochs` unset: one epoch.",
    )
    epochs: float | None = Field(
        None, gt=0, description="Length of training in epochs (when `max_steps` is unset)."
    )
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay (not applied to biases and norms)."
    )
    scheduler: Scheduler = Field(
        "linear", description="Learning-rate schedule, as `transformers.get_scheduler`."
    )
    warmup_steps: int = Field(0, ge=0, description="Warm-up steps of the schedule.")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Gradient clipping norm; 0 disables clipping."
    )
    mixed_precision: MixedPrecision = Field(
        "no", description="`no`, `fp16` (GPU) or `bf16`: compute in 16 bits from fp32 weights."
    )
    seed: int = Field(42, description="Seed of the model initialisation and of the data order.")
    log_every: int = Field(
        10,
        ge=1,
        description=f"Optimizer steps between log lines (terminal, {METRICS_FILE}, TensorBoard).",
    )
    eval_every: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps between evaluations (plus one at step 0); unset: evaluate at the end only.",
    )
    checkpoint_every: int | None = Field(
        None,
        ge=1,
        description="Steps between checkpoints; unset: a checkpoint only on a signal or at `stop_after_steps`.",
    )
    keep_last: int = Field(
        2,
        ge=1,
        description="Complete checkpoints kept on disk; older ones are deleted only after a newer one is complete.",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None,
        description="Stop when an evaluation metric has not improved for `patience` evaluations in a row (the evaluation at step 0 is not counted); needs `train.eval_every` and an evaluation set.",
    )
    keep_best: bool = Field(
        False,
        description="Save a checkpoint at every evaluation, keep the best one (by `train.early_stopping.metric`; without it `eval_loss`, or the first of `data.eval_datasets`' losses) beside the `keep_last` newest, and export it as "
        f"RUN/{EXPORT_DIR} (RUN/{ADAPTER_DIR} under LoRA).",
    )
    export_last: bool = Field(
        False,
        description=f"With `train.keep_best`: also export the last step, as RUN/{EXPORT_LAST_DIR} "
        f"(RUN/{ADAPTER_LAST_DIR} under LoRA).",
    )
    stop_after_steps: int | None = Field(
        None,
        ge=1,
        description="Stop at this global step as if preempted (checkpoint, exit 0); the schedule still runs to `max_steps`.",
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        ["tensorboard"],
        description=f"Where rank 0 logs the run's config and {METRICS_FILE}'s scalars besides {METRICS_FILE}: TensorBoard (RUN/{TENSORBOARD_DIR}), wandb, MLflow, Trackio (`pip install 'dplaunch[trackers]'`); one name or a list; `[]` or `none`: {METRICS_FILE} only.",
    )
    on_nonfinite: Literal["stop", "skip", "off"] = Field(
        "stop",
        description="A NaN/Inf loss or gradient norm: `stop` the run (no checkpoint of the bad step; the last good one stays), `skip` that update on every rank, or `off` (no check, no per-step sync).",
    )
    max_skipped_steps: int = Field(
        5,
        ge=1,
        description="With `on_nonfinite: skip`: stop after this many skipped updates in a row.",
    )
    compile: bool = Field(
        False,
        description="`torch.compile` (inductor) the model; DDP and ZeRO only. Long runs: compiling costs time before the first step (see Performance).",
    )
    tiled_mlp: bool = Field(
        False,
        description="Long sequences: run each MLP over tiles of the sequence (ALST), and the head and loss in chunks as `loss_chunk` (chunks of about `hidden_size` tokens unless it names a size): same loss, less activation memory.",
    )
    loss_chunk: int | Literal["auto", "off"] = Field(
        "auto",
        description="The output head and the token loss computed N tokens at a time, so that no [tokens, vocabulary] logits tensor of the micro-batch exists (causal-lm's and sft's loss, dpo's and grpo's log-probabilities; DDP, ZeRO-1/2/3, FSDP2, LoRA, sp; not tp nor pp). `auto`: on (chunks of about `hidden_size` tokens) when the plan's logits are at least a quarter of the forward/backward's memory, as with a large vocabulary; `off`: the model's own full logits.",
    )
    preference: PreferenceConfig = Field(
        PreferenceConfig(),
        description="dpo: the preference loss and its settings (see Preference tuning).",
    )
    grpo: GrpoConfig | None = Field(
        None,
        description="grpo: generation, rewards and the loss (see Online RL).",
    )
    precompute_ref: bool = Field(
        False,
        description="dpo: the reference model's log-probabilities of every pair computed once before training (by the model before its first step) and kept beside the tokenised data cache, so no reference model is held while training.",
    )
    sample_prompts: str | None = Field(
        None,
        description='sft and dpo: a file of prompts (JSON lines `{"prompt": text or messages}`, or one text per line) that rank 0 answers greedily at each evaluation, logged to '
        + METRICS_FILE
        + " and TensorBoard.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_as_a_list(cls, value: Any) -> Any:
        # `report_to: wandb` as transformers' TrainingArguments take it; "none" as there too
        if isinstance(value, str):
            return [] if value == "none" else [value]
        return value

    @field_validator("on_nonfinite", "loss_chunk", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` (in a run file or --set) as false
        return "off" if value is False else value

    @field_validator("loss_chunk")
    @classmethod
    def _positive_chunk(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise FieldProblem(
                "",
                f"{value} tokens is no chunk",
                "give a number of tokens ≥ 1, auto, or off",
            )
        return value

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
    zero_stage: int = Field(
        0, ge=0, le=3, description="0 = plain DDP; 1/2/3 = DeepSpeed ZeRO stage."
    )
    offload: Offload = Field(
        "none",
        description="ZeRO offload to CPU memory: `optimizer` states (ZeRO ≥ 1), or optimizer states and parameters (`all`, ZeRO-3).",
    )
    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree (DeepSpeed AutoTP), inside a node."
    )
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree (DeepSpeed pipeline engine).")
    fsdp: FsdpMode | None = Field(
        None,
        description="PyTorch FSDP2 instead of DDP/ZeRO: `full` shards over every data-parallel rank, `hybrid` shards inside a node and replicates across nodes (HSDP).",
    )
    sp: int = Field(
        1,
        ge=1,
        description="Sequence-parallel degree (DeepSpeed Ulysses): this many ranks share each sequence.",
    )
    auto: bool = Field(
        False,
        description="Let dplaunch pick `zero_stage`, `offload`, `tp` and `pp` from memory; in YAML write `parallel: auto`.",
    )


class LaunchConfig(Section):
    gpus: int | None = Field(
        None,
        description="Total GPUs (ranks) over all nodes; unset: every visible GPU (1 CPU rank without GPUs). Without GPUs, N CPU ranks on gloo.",
    )
    nodes: int = Field(1, ge=1, description="Number of nodes.")
    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs per node; unset: `gpus / nodes`."
    )
    node_rank: int = Field(
        0, ge=0, description="This node's rank in a multi-node job without SLURM."
    )
    master_addr: str = Field("127.0.0.1", description="Head node address for the rendezvous.")
    master_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="Rendezvous port; unset: 29500 if free (a free one otherwise) on one node, derived from the job id in SLURM.",
    )
    cpu: bool = Field(
        False, description="Run the ranks on CPU with gloo even when GPUs are visible."
    )
    timeout_minutes: float = Field(
        30,
        gt=0,
        description="Collective timeout: a rank stuck this long fails the job instead of hanging it.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="Automatic restarts after a rank dies or a collective fails: every rank starts again from the newest complete checkpoint (`dplaunch train`), on every node, after a short backoff. A failure that repeats at the same step with the same error, and a user error (exit 2), are not retried. 0: a failure ends the job.",
    )
    hostfile: str | None = Field(
        None,
        description="DeepSpeed hostfile (`host slots=G` lines): start every node from one command over pdsh/ssh.",
    )
    preflight: bool = Field(
        False,
        description="Run `dplaunch doctor` on every node before training (about 20-60 s); a FAIL stops the launch.",
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        description="GiB per GPU that `parallel: auto` and `dplaunch plan` plan for; unset: what nvidia-smi reports.",
    )
    profile: str | None = Field(
        None,
        description="A hardware profile (`dplaunch calibrate --out FILE`) the step-time forecast divides by; unset: `dplaunch calibrate`'s profile of this hardware in the user's cache, else datasheet figures of a known GPU.",
    )

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

    name: str | None = Field(
        None,
        description="Run name: the default run directory is `runs/<name>-<timestamp>` "
        "(`runs/run-<timestamp>` without one).",
    )
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    launch: LaunchConfig = LaunchConfig()
    output_dir: str | None = Field(
        None,
        description="The run directory: resolved config, rendered files, metrics, checkpoints, "
        "exported model; unset: `runs/<name>-<timestamp>`, relative to the working directory.",
    )

    @model_validator(mode="after")
    def _classes(self) -> RunConfig:
        names = self.data.label_names
        if names is None:
            return self
        if not task_of(self.model.task).classifies:
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
    def _task_keys(self) -> RunConfig:
        # values other than the defaults (run.yaml, as the ranks read it, lists every key)
        task, data, train = task_of(self.model.task), self.data, self.train
        if task.max_length is not None and "max_length" not in data.model_fields_set:
            data.max_length = task.max_length
        given = {
            f"data.{key}": getattr(data, key) != DataConfig.model_fields[key].default
            for key in ("format", "loss_on", "chat_template", "truncation", "tools")
        }
        given["data.chat_template_kwargs"] = bool(data.chat_template_kwargs)
        given["train.sample_prompts"] = train.sample_prompts is not None
        given["train.preference"] = train.preference != PreferenceConfig()
        given["train.precompute_ref"] = train.precompute_ref
        given["train.grpo"] = train.grpo is not None
        for key, is_given in given.items():
            if not is_given or (task.keys and key.startswith(task.keys)):
                continue
            owner = key_owner(key)
            assert owner is not None, key
            if task.pairs:  # the pairs' format is found from their columns
                raise FieldProblem(
                    key,
                    f"is for {owner.purpose}: {task.name} finds the pairs' format from their "
                    "columns and trains on their responses",
                    "remove it",
                )
            raise FieldProblem(
                key,
                f"is for {owner.purpose}, but model.task is {task.name}",
                f"remove it, or set model.task: {owner.name}",
            )
        if task.preference:
            self._check_preference()
        if task.prompts:
            self._check_grpo()
        return self

    @model_validator(mode="after")
    def _best_and_early_stopping(self) -> RunConfig:
        train, prefixes = self.train, evaluation_prefixes(self.data)
        if train.export_last and not train.keep_best:
            raise FieldProblem(
                "train.export_last",
                f"exports the last step beside the best, but without train.keep_best RUN/"
                f"{EXPORT_DIR} is the last step already",
                "set train.keep_best: true, or remove train.export_last",
            )
        key = "train.early_stopping" if train.early_stopping is not None else "train.keep_best"
        if train.early_stopping is None and not train.keep_best:
            return self
        if not prefixes or train.eval_every is None:
            raise FieldProblem(
                key,
                "compares evaluations, and this run "
                + ("has no evaluation set" if not prefixes else "evaluates at the end only"),
                "set train.eval_every and an evaluation set (data.eval_fraction, "
                "data.eval_dataset, data.eval_split or data.eval_datasets)",
            )
        if train.early_stopping is not None:
            metrics = task_of(self.model.task).eval_metrics
            logged = [f"{p}_{m}" for p in prefixes for m in metrics]
            if train.early_stopping.metric not in logged:
                raise FieldProblem(
                    "train.early_stopping.metric",
                    f"{train.early_stopping.metric!r} is not logged by this run's evaluations",
                    f"use one of {', '.join(logged)}",
                )
        return self

    @model_validator(mode="after")
    def _stream_keys(self) -> RunConfig:
        data, train = self.data, self.train
        if not data.streaming:
            given = [
                f"data.{key}"
                for key in ("shuffle_buffer", "count_stream")
                if getattr(data, key) != DataConfig.model_fields[key].default
            ]
            if given:
                raise FieldProblem(
                    given[0],
                    "is for streaming, but data.streaming is false",
                    "remove it, or set data.streaming: true",
                )
            return self
        if data.eval_fraction is not None:
            raise FieldProblem(
                "data.eval_fraction",
                "holds out a fraction of the whole data, which a stream never holds",
                "give a bounded evaluation set (data.eval_dataset, or data.eval_split of a hub "
                "dataset), or set data.streaming: false",
            )
        if train.max_steps is None and not data.count_stream:
            raise FieldProblem(
                "train.max_steps",
                "is unset, and a stream's length is unknown"
                + (f" (train.epochs {train.epochs} cannot be counted)" if train.epochs else ""),
                "set train.max_steps, or data.count_stream: true to count the records before "
                "launch (then train.epochs sets the length)",
            )
        return self

    def _check_preference(self) -> None:
        if self.data.streaming:
            raise FieldProblem(
                "data.streaming",
                "dpo reads its pairs whole (tokenised and cached, the reference's values kept "
                "beside them): pairs are not streamed",
                "set data.streaming: false",
            )
        if self.data.packing:
            raise FieldProblem(
                "data.packing",
                "dpo trains each pair in rows of its own: pairs are not packed",
                "remove it",
            )
        preference = self.train.preference
        for key in ("label_smoothing", "simpo_gamma"):
            # a value the loss never reads: the run would not train as its file says
            unused = key not in LOSS_KEYS[preference.loss]
            if unused and getattr(preference, key) != PreferenceConfig.model_fields[key].default:
                users = " or ".join(loss for loss, keys in LOSS_KEYS.items() if key in keys)
                raise FieldProblem(
                    f"train.preference.{key}",
                    f"is not read by the {preference.loss} loss (only by {users})",
                    f"remove it, or use train.preference.loss {users}",
                )
        if self.train.precompute_ref and not preference.needs_reference:
            raise FieldProblem(
                "train.precompute_ref",
                f"the {preference.loss} loss has no reference model to precompute",
                f"remove it, or use train.preference.loss {' or '.join(REFERENCE_LOSSES)}",
            )

    def _check_grpo(self) -> None:
        data, train = self.data, self.train
        if train.grpo is None:
            raise FieldProblem(
                "train.grpo",
                "is unset: grpo needs its reward functions",
                "add train.grpo: {rewards: [exact_match]} (or your own module:function)",
            )
        if data.streaming:
            raise FieldProblem(
                "data.streaming",
                "grpo reads its prompts whole (tokenised and cached): prompts are not streamed",
                "set data.streaming: false",
            )
        if data.mixture is not None:
            raise FieldProblem(
                "data.mixture",
                "grpo draws its prompts from one dataset (mixtures are not supported with grpo)",
                "use data.dataset",
            )
        if data.packing:
            raise FieldProblem(
                "data.packing",
                "grpo generates each prompt's completions in rows of their own: nothing is packed",
                "remove it",
            )
        if data.format not in (None, "prompt-only"):
            raise FieldProblem(
                "data.format",
                f"is {data.format}, but grpo reads prompts only (a 'prompt' column, a text or a "
                "message list; its completions are generated)",
                "remove it, or write data.format: prompt-only",
            )
        size, group = train.global_batch_size, train.grpo.num_generations
        if size % group:
            below = size - size % group
            nearest = " or ".join(str(n) for n in (below, below + group) if n > 0)
            raise FieldProblem(
                "train.global_batch_size",
                f"is {size} completions, which num_generations {group} does not divide (each "
                "prompt's completions train in the same step)",
                f"use {nearest}, or another train.grpo.num_generations",
            )

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
