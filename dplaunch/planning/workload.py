"""What a plan is estimated for besides its layout: the workload of one GPU, and its LoRA.

The estimate (estimate.py) and the plan table (candidates.py) take (model facts, ParallelDims,
Workload): the model's shape, the layout of the ranks, and what each computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplaunch.tasks import task_of

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings the estimate needs (model.lora, or `dplaunch plan --lora R`)."""

    r: int = 16
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    modules_to_save: tuple[str, ...] = ()
    quantize: str | None = None
    # model.lora.export: "merged" rebuilds the whole base on rank 0 at the end, "adapter-only" not
    export: str = "merged"
    # a model.config base (random init) is built in fp32, adapter-only too: it exists nowhere else
    random_base: bool = False
    # model.lora.use_dora: a trained magnitude per output feature of each adapted layer besides
    dora: bool = False

    @classmethod
    def from_config(cls, lora: Any, *, random_base: bool = False) -> LoraSpec | None:
        """From the run file's ``model.lora`` section (None: full fine-tuning); ``random_base``:
        the run's model is model.config's."""
        if lora is None:
            return None
        targets = lora.target_modules
        return cls(
            r=lora.r,
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            modules_to_save=tuple(lora.modules_to_save or ()),
            quantize=lora.quantize,
            export=lora.export,
            random_base=random_base,
            dora=lora.use_dora,
        )

    @property
    def targets_label(self) -> str:
        """The targeted layers in words."""
        if isinstance(self.target_modules, str):
            return self.target_modules
        return ", ".join(self.target_modules)


@dataclass(frozen=True)
class Generation:
    """grpo's sampling in each step (train.grpo): the planner's KV cache and decode terms."""

    # completions sampled per prompt, together (the rows of one decode batch)
    rows: int
    # tokens of a completion at most (the forecast assumes every completion reaches it)
    completion_tokens: int
    # optimizer steps each batch of completions trains (num_iterations): a step samples 1/μ of one
    iterations: int = 1


@dataclass(frozen=True)
class Workload:
    """What one GPU computes per micro-batch: the inputs of the activation and traffic estimates."""

    micro_batch: int = 1
    seq_len: int = 2048
    mixed_precision: str = "bf16"
    activation_checkpointing: bool = False
    # with activation_checkpointing: every which block is checkpointed (1: all; K: blocks 0, K,
    # 2K…, model.gradient_checkpointing every-K)
    checkpoint_every: int = 1
    task: str = "causal-lm"
    num_labels: int | None = None
    # samples per optimizer step; None = unknown (one micro-batch per step for traffic)
    global_batch_size: int | None = None
    # the configured micro batch (None = derived per layout): decides which layouts can split the batch
    fixed_micro_batch: int | None = None
    # model.attn_implementation; None = what transformers picks (attention_implementation)
    attn_implementation: str | None = None
    # False: the run's data rules out the pipeline engine (data/sft_checks.py refuses packed SFT examples and
    # sample prompts with pp > 1), so no pp layout is recommended for it
    pipeline: bool = True
    # list sequence-parallel layouts (sp 2/4/8) too: `plan --seq-len`, `parallel: auto`
    sequence_parallel: bool = False
    # model.lora: only adapters are trained (None: every weight)
    lora: LoraSpec | None = None
    # train.on_nonfinite is not off (one small all-reduce a step); train.max_grad_norm > 0:
    # the forecast's collectives (planning/forecast.py)
    guard: bool = True
    clip: bool = True
    # rows of packed examples (sft with data.packing): SDPA keeps their L × L masks (estimate)
    packed: bool = False
    # dpo: where each micro-batch's reference log-probabilities come from, "copy" (a frozen
    # copy of the model held beside the policy) or "adapters" (LoRA's base: the policy with its
    # adapters disabled); None: no reference forward (another task, a reference-free loss, or
    # train.precompute_ref's values)
    reference: str | None = None
    # train.loss_chunk (planning/loss_chunk.py): 0 the full logits, None auto (on where the
    # logits are a large share of the memory), else the tokens of a chunk
    loss_chunk: int | None = 0
    # grpo: the completions sampled each step (seq_len is then a prompt's and its completion's
    # tokens); None: nothing is generated
    generation: Generation | None = None
    # the levers the run leaves to the tuner (planning/candidates.py LEVERS, by Workload field:
    # "micro_batch", "activation_checkpointing"), those it did not set; () = its own settings
    tunable: tuple[str, ...] = ()

    @property
    def rows_per_sample(self) -> int:
        """Rows one sample puts through the forward: dpo's pair is two (chosen, rejected)."""
        return task_of(self.task).rows_per_sample

    @property
    def holds_reference(self) -> bool:
        """Whether a reference model is held beside the policy (its memory counts)."""
        return self.reference == "copy"

    def checkpointed(self, layer: int) -> bool:
        """Whether decoder block LAYER (0-based, of the whole model) is checkpointed."""
        return self.activation_checkpointing and layer % self.checkpoint_every == 0

    def accumulation_steps(self, dp: int) -> int | None:
        """Micro-batches per optimizer step on dp data-parallel ranks (rounded up); None: unknown."""
        if self.global_batch_size is None:
            return None
        return max(1, -(-self.global_batch_size // (self.micro_batch * dp)))
