"""What a training task is, as the planner, the data checks, the ranks and the commands ask it.

A task (`model.task`) is one object of this class, declared in its own module of this package
(causal_lm.py, classification.py, sft.py, dpo.py, grpo.py) and registered in __init__.py. Its facts are
torch- and pydantic-free, so that the command line reads them before any heavy import: which
model it builds, what its records hold, the layouts that train it, what its evaluation logs and
which run-file keys are its own. Code elsewhere asks these facts (`task_of(name).preference`),
never compares the name: tests/test_layout.py checks that no string comparison on a task's name
is left outside this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# data.max_length of tasks whose samples are chat examples, unless the run file sets it (as TRL:
# chat examples are long; the plan says how many the limit cuts)
EXAMPLE_MAX_LENGTH = 1024


@dataclass(frozen=True)
class Task:
    """One training objective: its model, data, layouts, metrics and run-file keys."""

    name: str
    # what the run trains, in a few words (the reference page, `dplaunch plan`)
    summary: str
    # what its own run-file keys are for, as a refusal of them under another task says it
    purpose: str = ""
    # the model it builds: a causal LM (a head over the vocabulary) or a classifier
    head: Literal["causal-lm", "classification"] = "causal-lm"
    # its records are rendered into examples (a chat template, the answers found in them)
    examples: bool = False
    # its records are chosen/rejected pairs (data/preference_checks.py reads them, the ranks
    # collate a micro-batch's chosen rows then its rejected rows)
    pairs: bool = False
    # its loss compares the policy with a reference model (train.preference, train/preference.py)
    preference: bool = False
    # its records are prompts only: the policy generates their completions while it trains and
    # reward functions score them (online RL: grpo, train/grpo.py)
    prompts: bool = False
    # the layouts beyond data parallelism that train it: the pipeline engine's last stage takes
    # a causal-LM loss of its own; Ulysses and the tiled loss need a token loss
    pipeline: bool = False
    sequence_parallel: bool = False
    # tp, pp and sp at all: False when only data-parallel layouts hold what it needs (dpo's
    # reference model is built and sharded as the policy is on those alone)
    model_parallel: bool = True
    # plain texts are packed into blocks unless data.packing says otherwise (causal-lm); a task
    # that packs only when data.packing is true says packs_when_asked (sft's examples)
    packs_by_default: bool = False
    packs_when_asked: bool = False
    # its samples hold their own labels (sft's answer masks) rather than the inputs shifted
    own_labels: bool = False
    # its evaluation sets are packed as its training samples are (False: one example a row, so
    # that the evaluation loss and the sample answers are per example)
    packs_evaluation: bool = True
    # the task its records train as when they are plain texts (sft: causal-lm packing)
    texts_train_as: str | None = None
    # what an evaluation logs after its set's prefix (`eval_`, `eval_<name>_`), the loss first
    eval_metrics: tuple[str, ...] = ("loss", "perplexity", "token_accuracy")
    # the run-file keys only this task reads (prefixes: "data." is every data key), for the
    # refusal of another task's keys (config/schema.py)
    keys: tuple[str, ...] = ()
    # data.max_length when the run file leaves it unset (None: the schema's default)
    max_length: int | None = None
    # the rank-side code of a task whose loss is not the model's own: "module:function" that
    # builds its objective in every rank (train/loop.py calls it with the run, the engine and
    # the batchers, before any checkpoint is loaded) and returns (objective, the metrics
    # header's words on it); None: the model's own loss
    objective: str | None = None

    @property
    def rows_per_sample(self) -> int:
        """Rows one sample puts through the forward: a pair's two (chosen, rejected), else one."""
        return 2 if self.pairs else 1

    @property
    def causal(self) -> bool:
        """Whether it trains a causal LM (AutoModelForCausalLM, a KV cache to switch off)."""
        return self.head == "causal-lm"

    @property
    def classifies(self) -> bool:
        """Whether it trains a sequence classifier (labels, num_labels, accuracy)."""
        return self.head == "classification"

    @property
    def head_module(self) -> str:
        """The output module of its model, which LoRA leaves whole (peft's names)."""
        return "score" if self.classifies else "lm_head"

    @property
    def peft_task_type(self) -> str:
        """peft's task_type of its adapters."""
        return "SEQ_CLS" if self.classifies else "CAUSAL_LM"

    def packs(self, packing: bool | None) -> bool:
        """Whether its training samples are packed into blocks under data.packing PACKING."""
        if self.packs_by_default:
            return packing is not False
        return self.packs_when_asked and bool(packing)
