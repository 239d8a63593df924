"""Which parallel layouts dplaunch runs: the one place plan, candidates, estimate and the pipeline ask.

Like torchtitan's ``ParallelDims``: a ``ParallelDims`` is a layout (world = dp × tp × pp × sp ranks
on nodes of ``gpus_per_node``, a ZeRO stage or FSDP, an offload) that is valid by construction:
building one raises the first rule it breaks as one UserError naming the field and the fix. Its
``check_*`` methods hold the rules that need more than the layout (the model and task, LoRA, the
attention kernel, the sequence length, a script launch); ``if_allowed`` is the same rules as the
plan table's filter; ``mesh`` gives the ranks' coordinates and groups (planning/mesh.py). The
estimate and the plan table take (model facts, ParallelDims, Workload). Pure Python: no torch,
no transformers.

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
- optimizer offload needs ZeRO, parameter offload ('all') needs ZeRO-3 (or FSDP);
- FSDP2 (parallel.fsdp) is its own engine: not with ZeRO (both would shard the same states), not
  with the pipeline engine (DeepSpeed's); its CPU offload moves parameters, gradients and
  optimizer states together ('all' only); `hybrid` shards inside a node, so the node's GPUs must
  hold more than one rank to shard over. FSDP × TP (`full` only: HSDP × TP is a 3-D mesh, not
  built) splits the layers as the model's Hugging Face ``base_model_tp_plan`` says (DTensor), not
  with AutoTP's presets: the family must have such a plan (gpt2 has none), and no fp16 (the
  loss scaler's overflow check would be agreed over the shard mesh only, so tp peers could
  disagree on skipping a step).
- sequence parallelism (sp, DeepSpeed's Ulysses) composes with dp and ZeRO 0-3 only (not with
  FSDP: its engine does not carry the sp groups yet): AutoTP splits the attention heads Ulysses
  splits, and the pipeline engine runs its own micro-batch schedule without the all-to-all; sp
  divides the attention heads and the KV heads, the family is one whose attention it wraps, the
  task a causal one (a classifier pools over the whole sequence), the attention kernel one that
  masks the gathered sequence itself (sdpa, given the mask by dplaunch, or a flash kernel, which
  reads the position ids): eager needs a 4-D mask Ulysses cannot split, and flex_attention would
  get no mask at all (full attention: every position would see the future).
- LoRA (model.lora) trains on DDP, ZeRO-1/2/3 and FSDP (peft wraps the model, then FSDP
  shards its blocks) only: tried with deepspeed 0.19.8 and peft
  0.21.2, AutoTP shards peft's adapter layers as model layers (the backward then fails: "loss
  must be a scalar tensor") and the pipeline engine cuts the HF model, which peft has wrapped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dplaunch.errors import UserError
from dplaunch.planning.mesh import Mesh
from dplaunch.tasks import task_of

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
# families whose attention DeepSpeed's Ulysses wraps and whose MLP train.tiled_mlp tiles
# (dplaunch/train/sequence_parallel.py); Ulysses and the tiled loss train causal LMs
SEQUENCE_PARALLEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# the attention kernels Ulysses runs with a mask of the whole gathered sequence (None: the key is
# unset, transformers picks sdpa for the families above)
SEQUENCE_PARALLEL_KERNELS = (None, "sdpa", "flash_attention_2", "flash_attention_3")
# families whose Hugging Face config class has a ``base_model_tp_plan`` of column- and row-wise
# splits only, what FSDP × TP applies (train/fsdp.py TP_STYLES; transformers 5.24, checked by
# tests/test_plan.py against the installed transformers): qwen3 adds a replicated norm style,
# phi3 gathering ones; gpt2, opt, falcon and bloom have no plan
FSDP_TP_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "phi")


def engine_name(zero_stage: int, tp: int, pp: int, fsdp: str | None) -> str:
    """The engine that trains a layout: pipeline (pp > 1), fsdp, deepspeed (ZeRO or AutoTP), ddp."""
    if pp > 1:
        return "pipeline"
    if fsdp is not None:
        return "fsdp"
    return "deepspeed" if zero_stage > 0 or tp > 1 else "ddp"


def check_mesh(world_size: int, tp: int, pp: int, sp: int = 1) -> int:
    """The data-parallel degree of tp × pp (× sp) over ``world_size`` ranks; UserError when they
    do not tile it."""
    if tp < 1 or pp < 1 or sp < 1:
        raise UserError("parallel.tp/pp/sp", "degrees must be at least 1", "use 1 to turn one off")
    if sp > 1 and world_size % sp != 0:
        raise UserError(
            "parallel.sp",
            f"sp {sp} does not divide {world_size} GPUs (world = dp × sp)",
            f"choose sp among the divisors of {world_size}, or change --gpus",
        )
    if world_size % (tp * pp * sp) != 0:
        raise UserError(
            "parallel",
            f"tp {tp} × pp {pp} = {tp * pp} does not divide {world_size} GPUs",
            f"choose tp × pp among the divisors of {world_size}, or change --gpus",
        )
    return world_size // (tp * pp * sp)


def check_sequence_parallel_layout(sp: int, tp: int, pp: int, fsdp: str | None = None) -> None:
    """Ulysses composes with data parallelism and ZeRO, not with AutoTP, the pipeline engine or
    FSDP."""
    if sp > 1 and fsdp is not None:
        raise UserError(
            "parallel.sp",
            f"sp {sp} with FSDP: the FSDP engine shards over every rank and does not carry "
            "sequence-parallel groups (not built)",
            "use sp with DDP or ZeRO 0-3 (ZeRO-3 shards like FSDP full), or FSDP with sp 1",
        )
    if sp > 1 and tp > 1:
        raise UserError(
            "parallel.sp",
            f"sp {sp} × tp {tp}: Ulysses and AutoTP both split the attention heads, and DeepSpeed "
            "does not compose the two",
            "use sp with dp and ZeRO 0-3 (tp 1), or tp without sp",
        )
    if sp > 1 and pp > 1:
        raise UserError(
            "parallel.sp",
            f"sp {sp} × pp {pp}: the pipeline engine runs its own micro-batch schedule, without "
            "Ulysses' all-to-all between its stages",
            "use sp with dp and ZeRO 0-3 (pp 1), or pp without sp",
        )


def check_sequence_parallel_model(sp: int, model: ModelFacts, task: str) -> None:
    """Ulysses wraps the family's attention, sp splits its heads evenly, the task is causal."""
    if sp <= 1:
        return
    if model.model_type not in SEQUENCE_PARALLEL_FAMILIES:
        raise UserError(
            "parallel.sp",
            f"sequence parallelism (sp {sp}) is not supported for model type {model.model_type!r}",
            f"use sp 1, or a supported family: {', '.join(SEQUENCE_PARALLEL_FAMILIES)}",
        )
    if not task_of(task).sequence_parallel:
        raise UserError(
            "parallel.sp",
            f"sequence parallelism (sp {sp}) trains causal LMs (causal-lm, sft), and model.task "
            f"is {task!r}",
            "use sp 1 for a classifier (it pools over the whole sequence)",
        )
    # Ulysses gives each rank whole heads. It could also copy KV heads to more ranks than there
    # are (sp a multiple of them); dplaunch keeps to even splits, as with tp
    for name, count in (("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)):
        if count % sp:
            raise UserError(
                "parallel.sp",
                f"sp {sp} does not divide the model's {count} {name} (Ulysses gives each rank "
                "of a group whole heads)",
                f"choose sp among the divisors of {count}",
            )


def sequence_parallel_kernel(attn_implementation: str | None) -> bool:
    """Whether Ulysses runs with this attention kernel (model.attn_implementation)."""
    return attn_implementation in SEQUENCE_PARALLEL_KERNELS


def check_sequence_parallel_kernel(sp: int, attn_implementation: str | None) -> None:
    """Ulysses gathers whole sequences: the kernel must mask them causally (and packed) itself."""
    if sp <= 1 or sequence_parallel_kernel(attn_implementation):
        return
    why = {
        "eager": "eager attention builds a full 4D mask, which Ulysses sequence parallelism "
        "cannot split (DeepSpeed refuses it)",
        "flex_attention": "flex_attention under Ulysses gets no mask for the gathered sequence "
        "(the model's covers a slice): it would attend to later tokens, training non-causally",
    }.get(
        str(attn_implementation),
        f"{attn_implementation} is not a kernel Ulysses sequence parallelism is built for",
    )
    raise UserError(
        "model.attn_implementation",
        why,
        "use sdpa (what transformers picks when the key is unset) or a flash kernel, or sp 1",
    )


def check_sequence_length_splits(sp: int, max_length: int) -> None:
    """Every rank of a sequence-parallel group holds an equal slice of the block."""
    if sp > 1 and max_length % sp:
        raise UserError(
            "data.max_length",
            f"{max_length} tokens do not split evenly over sp {sp} ranks",
            f"use a multiple of {sp}: {(max_length // sp) * sp or sp} or {(max_length // sp + 1) * sp}",
        )


def check_offload(zero_stage: int, offload: str, fsdp: str | None = None) -> None:
    """Offloading the optimizer needs ZeRO; offloading parameters needs ZeRO-3 (or FSDP)."""
    if fsdp is not None:
        return  # check_fsdp's rule
    if offload == "optimizer" and zero_stage == 0:
        raise UserError("parallel.offload", "optimizer offload needs ZeRO", "add --zero 1, 2 or 3")
    if offload == "all" and zero_stage != 3:
        raise UserError(
            "parallel.offload",
            "offloading parameters ('all') needs ZeRO-3",
            "use --zero 3 or --offload optimizer",
        )


def check_fsdp(fsdp: str | None, zero_stage: int, tp: int, pp: int, offload: str) -> None:
    """FSDP2 replaces ZeRO, does not run under the pipeline engine, takes tp only as `full`, and
    offloads 'all' only."""
    if fsdp is None:
        return
    if zero_stage > 0:
        raise UserError(
            "parallel.fsdp",
            f"FSDP and ZeRO-{zero_stage} both shard the model's states: choose one engine",
            "drop --zero (FSDP full is ZeRO-3's layout) or drop --fsdp",
        )
    if pp > 1:
        raise UserError(
            "parallel.fsdp",
            f"FSDP with pp {pp}: the pipeline engine is DeepSpeed's and shards no parameters",
            "use --pp 1 with --fsdp, or pp with ZeRO ≤ 1",
        )
    if tp > 1 and fsdp == "hybrid":
        raise UserError(
            "parallel.fsdp",
            f"HSDP with tp {tp} would need a 3-D mesh (replicate × shard × tp), not built",
            "use --fsdp full with --tp, or --fsdp hybrid with tp 1",
        )
    if offload == "optimizer":
        raise UserError(
            "parallel.offload",
            "FSDP offloads parameters, gradients and optimizer states together",
            "use --offload all or none with --fsdp",
        )


def check_fsdp_precision(fsdp: str | None, tp: int, mixed_precision: str) -> None:
    """No fp16 with FSDP × TP: the loss scaler's overflow flag is reduced over the first
    gradient's mesh only (DTensor), so tensor-parallel peers could disagree on skipping a step."""
    if fsdp is not None and tp > 1 and mixed_precision == "fp16":
        raise UserError(
            "train.mixed_precision",
            f"fp16 with FSDP × tp {tp}: the loss scaler's overflow check is not agreed across the "
            "tensor-parallel ranks, which could then disagree on skipping a step",
            "use bf16 (no loss scaling) with --fsdp full --tp, or fp16 with tp 1",
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


def check_tensor_parallel_model(tp: int, model: ModelFacts, fsdp: str | None = None) -> None:
    """The engine can split the family (AutoTP's presets, or under FSDP the model's own tp_plan)
    and tp divides the attention heads and the KV heads."""
    if tp <= 1:
        return
    if fsdp is not None and model.model_type not in FSDP_TP_FAMILIES:
        raise UserError(
            "parallel.tp",
            f"FSDP × TP splits a model as its Hugging Face base_model_tp_plan says, and model type "
            f"{model.model_type!r} has none of column- and row-wise splits only",
            f"use --tp 1 with --fsdp, tp with ZeRO ≤ 2 (AutoTP), or a family with such a plan: "
            f"{', '.join(FSDP_TP_FAMILIES)}",
        )
    if fsdp is None and model.model_type not in AUTOTP_FAMILIES:
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
    if not task_of(task).pipeline:
        raise UserError(
            "parallel.pp",
            f"pipeline parallelism (pp {pp}) trains causal LMs only, and model.task is {task!r}",
            "use --pp 1 (data parallelism, ZeRO or --tp for a large model), or model.task causal-lm",
        )


def check_lora_layout(tp: int, pp: int, sp: int = 1, fsdp: str | None = None) -> None:
    """LoRA adapters train with data parallelism (DDP, ZeRO-1/2/3, FSDP full or hybrid), not with
    AutoTP, the pipeline or sequence parallelism (the last: not built for adapters yet)."""
    if sp > 1:
        raise UserError(
            "model.lora",
            f"LoRA with sequence parallelism (sp {sp}): adapters under Ulysses are not built or "
            "tested yet",
            "use --sp 1 with --lora, or train every weight with sp",
        )
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


def check_attention_kernel(attn_implementation: str | None, target: str, precision: str) -> None:
    """model.attn_implementation runs where the plan runs: flash kernels on CUDA GPUs in 16 bits
    (fp32 queries fail at the first forward), flex_attention's backward on GPUs only."""
    kernel = attn_implementation or ""
    if target == "cpu" and kernel.startswith("flash_attention"):
        raise UserError(
            "model.attn_implementation",
            f"{kernel} runs on CUDA GPUs only, and this plan runs CPU ranks",
            "use sdpa (what transformers picks when the key is unset) or eager",
        )
    if target == "cpu" and kernel == "flex_attention":
        raise UserError(
            "model.attn_implementation",
            "flex_attention has no backward on CPU (torch 2.13), and this plan runs CPU ranks",
            "use sdpa (what transformers picks when the key is unset) or eager",
        )
    if kernel.startswith("flash_attention") and precision == "no":
        raise UserError(
            "train.mixed_precision",
            f"{kernel} computes in bf16 or fp16 only, and mixed precision 'no' gives it fp32 "
            "queries (every rank would fail at the first forward)",
            "set train.mixed_precision: bf16 (or fp16 on GPUs older than Ampere), or use sdpa",
        )


def check_checkpoint_every(every: int, num_layers: int) -> None:
    """model.gradient_checkpointing every-K: K at most the model's blocks (block 0, K, 2K… are
    checkpointed; beyond the last block it names none but the first)."""
    if every > num_layers:
        raise UserError(
            "model.gradient_checkpointing",
            f"every-{every} checkpoints every {every}th block, and the model has {num_layers}",
            f"use every-K with K ≤ {num_layers}, true (every block) or false",
        )


def check_preference_layout(task: str, tp: int, pp: int, sp: int) -> None:
    """dpo trains data-parallel only (DDP, ZeRO-1/2/3, FSDP2): its reference model is built and
    sharded as the policy is on those, and its pair loss needs whole sequences on one stage."""
    if task_of(task).model_parallel:
        return
    for axis, degree in (("tp", tp), ("pp", pp), ("sp", sp)):
        if degree > 1:
            raise UserError(
                f"parallel.{axis}",
                f"model.task {task} trains on data-parallel layouts only, and {axis} is {degree}",
                f"use --{axis} 1: DDP, ZeRO-1/2/3 (--zero) or FSDP2 (--fsdp) shard the policy and "
                "its reference model",
            )


@dataclass(frozen=True)
class ParallelDims:
    """One layout, valid by construction: ``world_size`` ranks on nodes of ``gpus_per_node``,
    tp × pp (or sp) × the data-parallel rest, a ZeRO stage or FSDP, and an offload.

    Building one runs the layout's rules (a UserError naming the field and the fix for the first
    it breaks); the rules that need more than the layout (the model, the task, the attention
    kernel, LoRA, a script launch) are its ``check_*`` methods. ``mesh`` gives the ranks'
    coordinates and groups (planning/mesh.py)."""

    world_size: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload: str = "none"
    # parallel.fsdp: None, "full" or "hybrid" (FSDP2 instead of DDP/ZeRO)
    fsdp: str | None = None
    sp: int = 1

    def __post_init__(self) -> None:
        check_mesh(self.world_size, self.tp, self.pp, self.sp)
        check_fsdp(self.fsdp, self.zero_stage, self.tp, self.pp, self.offload)
        check_offload(self.zero_stage, self.offload, self.fsdp)
        check_sequence_parallel_layout(self.sp, self.tp, self.pp, self.fsdp)
        check_zero_with_model_parallel(self.zero_stage, self.tp, self.pp)
        check_tensor_parallel_in_node(self.tp, self.gpus_per_node)

    @classmethod
    def if_allowed(
        cls, *args: Any, model: ModelFacts | None = None, task: str = "causal-lm", **kwargs: Any
    ) -> ParallelDims | None:
        """The layout of these degrees when every rule allows it (for ``model`` and ``task``
        when given), else None: what the plan table enumerates layouts with."""
        try:
            dims = cls(*args, **kwargs)
            dims.check(model, task)
        except UserError:
            return None
        return dims

    @property
    def dp(self) -> int:
        """The data-parallel degree: the ranks left once tp × pp × sp is taken."""
        return self.world_size // (self.tp * self.pp * self.sp)

    @property
    def fsdp_shard_size(self) -> int:
        """Ranks that split FSDP's parameters: every data-parallel rank (full), a node's (hybrid)."""
        if self.fsdp == "hybrid":
            return min(self.gpus_per_node, self.dp)
        return self.dp

    @property
    def engine(self) -> str:
        """The engine that trains this layout (engine_name)."""
        return engine_name(self.zero_stage, self.tp, self.pp, self.fsdp)

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The ranks' coordinates and groups: tp fastest, then sp, dp and pp."""
        return Mesh(self.dp, self.tp, self.pp, self.sp)

    def name(self, mixed_precision: str = "no") -> str:
        """The layout in a few words, as every command names it: "ZeRO-3 dp 2", "FSDP2 hybrid
        dp 4 × tp 2", "DDP dp 1 (bf16)"."""
        engine, stage = self.engine, self.zero_stage
        if engine == "fsdp":
            title = f"FSDP2 {self.fsdp}"
        elif engine == "pipeline":
            title = "pipeline" + (f" ZeRO-{stage}" if stage else "")
        elif self.tp > 1:
            title = "AutoTP" + (f" ZeRO-{stage}" if stage else "")
        else:
            title = f"ZeRO-{stage}" if stage else "DDP"
        degrees = [f"dp {self.dp}"] + [
            f"{axis} {n}"
            for axis, n in (("tp", self.tp), ("pp", self.pp), ("sp", self.sp))
            if n > 1
        ]
        extras = [f"offload {self.offload}"] if self.offload != "none" else []
        extras += [mixed_precision] if mixed_precision != "no" else []
        return f"{title} {' × '.join(degrees)}" + (f" ({', '.join(extras)})" if extras else "")

    def notes(self) -> list[str]:
        """What this layout does that its flags do not say: hybrid sharding with one node's
        ranks (or fewer) is full sharding, nothing is replicated."""
        if self.fsdp == "hybrid" and self.fsdp_shard_size == self.dp:
            return [
                "--fsdp hybrid on one node is full sharding: HSDP shards inside a node and "
                "replicates across nodes, and with one node there is nothing to replicate to"
            ]
        return []

    def check(self, model: ModelFacts | None = None, task: str = "causal-lm") -> None:
        """Raise the first rule ``model`` and ``task`` break with this layout."""
        check_preference_layout(task, self.tp, self.pp, self.sp)
        if model is not None:
            check_tensor_parallel_model(self.tp, model, self.fsdp)
            check_pipeline_model(self.pp, model, task)
            check_sequence_parallel_model(self.sp, model, task)

    def check_lora(self) -> None:
        """LoRA adapters train on this layout (check_lora_layout)."""
        check_lora_layout(self.tp, self.pp, self.sp, self.fsdp)

    @property
    def trains_lora(self) -> bool:
        """Whether LoRA adapters train on this layout: check_lora as a predicate."""
        try:
            self.check_lora()
        except UserError:
            return False
        return True

    def check_compile(self, compile: bool) -> None:
        """train.compile compiles DDP and ZeRO models: AutoTP and the pipeline engine rebuild the
        model's layers after it would compile them."""
        if compile and (self.tp > 1 or self.pp > 1):
            raise UserError(
                "train.compile",
                "torch.compile is applied to DDP and ZeRO models only; AutoTP and the pipeline "
                "engine rebuild the model's layers after it would compile them",
                "drop train.compile, or use tp 1 and pp 1",
            )

    def check_kernel(self, attn_implementation: str | None) -> None:
        """Ulysses runs with the attention kernel (check_sequence_parallel_kernel)."""
        check_sequence_parallel_kernel(self.sp, attn_implementation)

    def check_precision(self, attn_implementation: str | None, target: str, precision: str) -> None:
        """The ranks' precision suits FSDP × TP and the attention kernel on their device
        (check_fsdp_precision, check_attention_kernel)."""
        check_fsdp_precision(self.fsdp, self.tp, precision)
        check_attention_kernel(attn_implementation, target, precision)

    def check_sequence_length(self, max_length: int) -> None:
        """Each rank of a sequence-parallel group holds an equal slice of a block."""
        check_sequence_length_splits(self.sp, max_length)

    def check_script_launch(self) -> None:
        """A user's own script runs data parallelism, ZeRO, AutoTP or FSDP: the pipeline engine
        and Ulysses need dplaunch's own loop."""
        if self.pp > 1:
            raise UserError(
                "parallel.pp",
                "pipeline parallelism needs dplaunch's own loop",
                "use `dplaunch train` for pp > 1",
            )
        if self.sp > 1:
            raise UserError(
                "parallel.sp",
                "sequence parallelism needs dplaunch's own loop (it shards each batch's sequence)",
                "use `dplaunch train` for sp > 1",
            )
