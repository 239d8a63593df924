"""Which parallel layouts dplaunch runs: the one place plan, candidates, estimate and the pipeline ask.

Like torchtitan's ``ParallelDims``: a ``ParallelDims`` states a layout (world = dp × tp × pp ranks on
nodes of ``gpus_per_node``, a ZeRO stage, an offload), ``check`` raises the first rule it breaks as
one UserError naming the field and the fix, and ``allowed`` is the same rules as a predicate for
the plan table. Pure Python: no torch, no transformers.

The rules, and why:

- world = dp × tp × pp with an integer dp (ranks tile the mesh);
- a tensor-parallel group stays inside one node: its all-reduces run every layer. TP groups are
  consecutive ranks (planning/mesh.py), so tp must *divide* the GPUs of a node — tp 4 on nodes of
  6 would put ranks 4-7 on two nodes;
- AutoTP shards attention heads: tp divides the attention heads and the KV heads (so tp ≤ KV heads);
- pp ≤ the model's layers, not a divisor: the pipeline engine partitions by parameters (and the
  estimate's ``layers_per_stage`` splits unevenly the same way), so 6 layers run on 4 stages;
- ZeRO-2/3 partition gradients the pipeline still needs (pp with ZeRO ≤ 1); ZeRO-3 with AutoTP is
  experimental upstream (tp with ZeRO ≤ 2); AutoTP does not compose with the pipeline engine;
- optimizer offload needs ZeRO, parameter offload ('all') needs ZeRO-3;
- LoRA (model.lora) trains on DDP and ZeRO-1/2/3 only: tried with deepspeed 0.19.8 and peft
  0.21.2, AutoTP shards peft's adapter layers as model layers (the backward then fails: "loss
  must be a scalar tensor") and the pipeline engine cuts the HF model, which peft has wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dplaunch.config.schema import CAUSAL_TASKS
from dplaunch.errors import UserError

if TYPE_CHECKING:
    from dplaunch.planning.model_facts import ModelFacts

# families whose decoder DeepSpeed AutoTP knows how to split (its presets), by HF model_type
AUTOTP_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "bloom",
    "chatglm",
    "mixtral",
    "deepseek_v2",
    "phi3",
    "gpt2",
    "gptj",
    "opt",
    "falcon",
)
# families dplaunch can cut into pipeline stages (dplaunch/train/pipeline.py)
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
# the pipeline engine's last stage computes a causal-LM loss
PIPELINE_TASKS = CAUSAL_TASKS


def check_mesh(world_size: int, tp: int, pp: int) -> int:
    """The data-parallel degree of tp × pp over ``world_size`` ranks; UserError when they do not tile it."""
    if tp < 1 or pp < 1:
        raise UserError("parallel.tp/pp", "degrees must be at least 1", "use 1 to turn one off")
    if world_size % (tp * pp) != 0:
        raise UserError(
            "parallel",
            f"tp {tp} × pp {pp} = {tp * pp} does not divide {world_size} GPUs",
            f"choose tp × pp among the divisors of {world_size}, or change --gpus",
        )
    return world_size // (tp * pp)


def check_offload(zero_stage: int, offload: str) -> None:
    """Offloading the optimizer needs ZeRO; offloading parameters needs ZeRO-3."""
    if offload == "optimizer" and zero_stage == 0:
        raise UserError("parallel.offload", "optimizer offload needs ZeRO", "add --zero 1, 2 or 3")
    if offload == "all" and zero_stage != 3:
        raise UserError(
            "parallel.offload",
            "offloading parameters ('all') needs ZeRO-3",
            "use --zero 3 or --offload optimizer",
        )


def check_zero_with_model_parallel(zero_stage: int, tp: int, pp: int) -> None:
    """pp with ZeRO ≤ 1, tp with ZeRO ≤ 2, and never tp with pp."""
    if pp > 1 and zero_stage >= 2:
        raise UserError(
            "parallel.zero_stage",
            f"ZeRO-{zero_stage} cannot be combined with pipeline parallelism (DeepSpeed partitions "
            "gradients across micro-batches that the pipeline still needs)",
            "use --zero 0 or 1 with pp > 1",
        )
    if tp > 1 and zero_stage == 3:
        raise UserError(
            "parallel.zero_stage",
            "ZeRO-3 with tensor parallelism is experimental upstream and not supported by dplaunch",
            "use --zero 0, 1 or 2 with tp > 1, or ZeRO-3 alone",
        )
    if tp > 1 and pp > 1:
        raise UserError(
            "parallel",
            f"tp {tp} × pp {pp}: DeepSpeed's AutoTP does not compose with its pipeline engine",
            "use tp with dp (and ZeRO ≤ 2), or pp with dp (and ZeRO ≤ 1)",
        )


def check_tensor_parallel_in_node(tp: int, gpus_per_node: int) -> None:
    """A tensor-parallel group of consecutive ranks stays inside one node: tp divides its GPUs."""
    if tp <= 1:
        return
    if tp > gpus_per_node:
        raise UserError(
            "parallel.tp",
            f"tp {tp} is larger than the {gpus_per_node} GPUs of a node",
            "keep tensor parallelism inside a node (its all-reduces run every layer)",
        )
    if gpus_per_node % tp:
        raise UserError(
            "parallel.tp",
            f"tp {tp} does not divide the {gpus_per_node} GPUs of a node, so a tensor-parallel "
            "group would span two nodes",
            f"choose tp among the divisors of {gpus_per_node}",
        )


def check_tensor_parallel_model(tp: int, model: ModelFacts) -> None:
    """AutoTP knows the family and tp divides the attention heads and the KV heads."""
    if tp <= 1:
        return
    if model.model_type not in AUTOTP_FAMILIES:
        raise UserError(
            "parallel.tp",
            f"DeepSpeed AutoTP cannot split model type {model.model_type!r}",
            f"use tp 1, or a family AutoTP supports: {', '.join(AUTOTP_FAMILIES)}",
        )
    for name, count in (("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)):
        if count % tp:
            raise UserError(
                "parallel.tp",
                f"tp {tp} does not divide the model's {count} {name}",
                f"choose tp among the divisors of {count}",
            )


def check_pipeline_depth(pp: int, num_layers: int) -> None:
    """At most one stage per layer; the layers need not split evenly (the partitioner balances)."""
    if pp > num_layers:
        raise UserError(
            "parallel.pp",
            f"pp {pp} is more stages than the model's {num_layers} layers",
            f"use pp ≤ {num_layers}",
        )


def check_pipeline_model(pp: int, model: ModelFacts, task: str) -> None:
    """The pipeline engine can cut the family, the model has a layer per stage, the task is causal."""
    if pp <= 1:
        return
    if model.model_type not in PIPELINE_FAMILIES:
        raise UserError(
            "parallel.pp",
            f"pipeline parallelism (pp>1) is not supported for {model.model_type!r}",
            f"supported: {', '.join(PIPELINE_FAMILIES)}",
        )
    check_pipeline_depth(pp, model.num_layers)
    if task not in PIPELINE_TASKS:
        raise UserError(
            "parallel.pp",
            f"pipeline parallelism (pp {pp}) trains causal LMs only, and model.task is {task!r}",
            "use --pp 1 (data parallelism, ZeRO or --tp for a large model), or model.task causal-lm",
        )


def check_lora_layout(tp: int, pp: int) -> None:
    """LoRA adapters train with data parallelism (DDP, ZeRO-1/2/3), not with AutoTP or the pipeline."""
    if tp > 1:
        raise UserError(
            "model.lora",
            f"LoRA with tensor parallelism (tp {tp}): DeepSpeed AutoTP splits peft's adapter "
            "layers like the model's own and its backward fails",
            "use --tp 1; ZeRO-3 (--zero 3) spreads a model too large for one GPU",
        )
    if pp > 1:
        raise UserError(
            "model.lora",
            f"LoRA with pipeline parallelism (pp {pp}): the pipeline engine cuts the model into "
            "stages and cannot cut one peft has wrapped",
            "use --pp 1; ZeRO-3 (--zero 3) spreads a model too large for one GPU",
        )


@dataclass(frozen=True)
class ParallelDims:
    """One layout: ``world_size`` ranks on nodes of ``gpus_per_node``, tp × pp, ZeRO and offload."""

    world_size: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload: str = "none"

    @property
    def dp(self) -> int:
        """The data-parallel degree (valid once ``check`` passed)."""
        return self.world_size // (self.tp * self.pp)

    def check(self, model: ModelFacts | None = None, task: str = "causal-lm") -> None:
        """Raise the first rule this layout breaks (for ``model`` and ``task`` when given)."""
        check_mesh(self.world_size, self.tp, self.pp)
        check_offload(self.zero_stage, self.offload)
        check_zero_with_model_parallel(self.zero_stage, self.tp, self.pp)
        check_tensor_parallel_in_node(self.tp, self.gpus_per_node)
        if model is not None:
            check_tensor_parallel_model(self.tp, model)
            check_pipeline_model(self.pp, model, task)

    def allowed(self, model: ModelFacts | None = None, task: str = "causal-lm") -> bool:
        """Whether ``check`` passes: the predicate the plan table enumerates layouts with."""
        try:
            self.check(model, task)
        except UserError:
            return False
        return True
