"""Pipeline parallelism: cut an HF causal LM into DeepSpeed pipeline stages and drive it.

The generic loop (dplaunch/train/loop.py) talks to `PipelineTrainEngine` exactly like it talks to an
Accelerate-wrapped model: one call per optimizer step, eval, checkpoint, export. Inside, DeepSpeed's
`PipelineEngine` runs its 1F1B schedule, which only exists as `train_batch(data_iter)`.

How a model is cut (all families):

    token embedding → [gpt2: + position embedding, dropout] → decoder block × N → final norm → lm_head

Between layers travel `(hidden_states, attention_mask)`: the 2-D padding mask is an int64 tensor, so
the pipeline engine neither sends it a gradient nor expects one. Every decoder layer rebuilds the 4-D
mask (causal, or sliding-window where the HF model would use one) and, for rotary families, the
(cos, sin) pair from `position_ids = arange(seq)` — exactly what the HF model's own forward does
when it is given no position_ids, so the pipeline computes the same function as the HF model on any
padding, left or right.

The layers wrap the loaded model's own submodules (no copies): a pipeline run starts from the same
weights as a data-parallel run with the same seed, and the HF model object on each rank always holds
the current weights of that rank's stage. Pass the model on the CPU: DeepSpeed moves only this rank's
stage to the accelerator.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from dplaunch.planning.rules import PIPELINE_FAMILIES
from dplaunch.run_directory.layout import PIPELINE_TAG
from dplaunch.tasks import task_of
from dplaunch.train.collective_timeout import collective_timeout
from dplaunch.train.engines import EngineBase, RunFileHyperparameters, loss_sums

# the families the layers below can cut; the planner refuses others before launch
SUPPORTED_MODEL_TYPES = PIPELINE_FAMILIES

# key of the token embedding that the lm_head shares when the embeddings are tied
TIED_EMBEDDING_KEY = "token_embedding"


# ---------------------------------------------------------------------------------------------
# pipeline layers: each takes and returns a tensor or a tuple of tensors


class TokenEmbeddingPipe(nn.Module):
    """`(input_ids, attention_mask)` → `(embeddings, attention_mask)`; also the tied lm_head's owner."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = inputs
        return self.embedding(input_ids), attention_mask


def tied_lm_head_forward(module: TokenEmbeddingPipe, hidden_states: torch.Tensor) -> torch.Tensor:
    """The lm_head of a tied model: logits from the shared token-embedding matrix."""
    return F.linear(hidden_states, module.embedding.weight)


class GPT2PositionEmbeddingPipe(nn.Module):
    """GPT-2's learned position embedding and embedding dropout, applied after the token embedding."""

    def __init__(self, position_embedding: nn.Embedding, dropout: nn.Module):
        super().__init__()
        self.position_embedding = position_embedding
        self.dropout = dropout

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs_embeds, attention_mask = inputs
        position_ids = _position_ids(inputs_embeds)
        hidden_states = inputs_embeds + self.position_embedding(position_ids)
        return self.dropout(hidden_states), attention_mask


class DecoderLayerPipe(nn.Module):
    """One HF decoder block; rebuilds the attention mask and rotary embeddings it needs."""

    def __init__(
        self,
        block: nn.Module,
        config: Any,
        mask_builder: Callable,
        rotary: nn.Module | None,
        layer_index: int,
    ):
        super().__init__()
        self.block = block
        self.layer_index = layer_index
        # plain attributes, not submodules: the config is shared, and the rotary module (buffers
        # only, no parameters) must stay fp32 and out of every stage's state dict
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "mask_builder", mask_builder)
        object.__setattr__(self, "rotary", rotary)

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, attention_mask = inputs
        position_ids = _position_ids(hidden_states)
        mask = self.mask_builder(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        extra = {}
        if self.rotary is not None:
            if self.rotary.inv_freq.device != hidden_states.device:
                self.rotary.to(hidden_states.device)
            extra["position_embeddings"] = self.rotary(hidden_states, position_ids)
        output = self.block(hidden_states, attention_mask=mask, position_ids=position_ids, **extra)
        if isinstance(output, tuple):  # older transformers return (hidden_states, ...)
            output = output[0]
        return output, attention_mask


class FinalNormPipe(nn.Module):
    """The final norm; drops the attention mask, which nothing after it needs."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden_states, _ = inputs
        return self.norm(hidden_states)


class LMHeadPipe(nn.Module):
    """An untied lm_head."""

    def __init__(self, lm_head: nn.Linear):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)


class CausalLMLoss:
    """The HF model's own causal-LM loss: shift by one, mean over labels != -100."""

    def __init__(self, loss_function: Callable, vocab_size: int):
        self.loss_function = loss_function
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: Any) -> torch.Tensor:
        if isinstance(labels, tuple):  # (labels, loss_scale): rows of unequal length (data.py)
            labels, scale = labels
            return (
                self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size) * scale
            )
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


def _position_ids(hidden_states: torch.Tensor) -> torch.Tensor:
    # what HF models use when called without position_ids or cache
    return torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# cutting a model into layers


def _check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"pipeline parallelism (pp>1) is not supported for {model_type}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _mask_builders(model: nn.Module) -> list[Callable]:
    """For each decoder layer, the HF mask function its model's forward would use."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = model.config
    num_layers = config.num_hidden_layers
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return [create_sliding_window_causal_mask] * num_layers
    if config.model_type == "qwen2":
        return [
            create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            for kind in config.layer_types[:num_layers]
        ]
    return [create_causal_mask] * num_layers


def pipeline_layers(model: nn.Module) -> list[nn.Module | LayerSpec]:
    """The model as a sequence of pipeline layers (modules or specs) wrapping its own submodules."""
    config = model.config
    model_type = config.model_type
    _check_supported(model_type)
    input_embedding = model.get_input_embeddings()
    output_embedding = model.get_output_embeddings()
    tied = output_embedding.weight is input_embedding.weight
    if output_embedding.bias is not None:
        raise ValueError(
            f"pipeline parallelism: an lm_head with a bias is not supported ({model_type})"
        )

    if model_type == "gpt2":
        body = model.transformer
        blocks, final_norm, rotary = body.h, body.ln_f, None
    else:
        body = model.model
        blocks, final_norm, rotary = body.layers, body.norm, body.rotary_emb
    blocks = list(blocks)[: config.num_hidden_layers]

    layers: list[nn.Module | LayerSpec] = []
    if tied:
        # one parameter in each stage that holds it; DeepSpeed sums the two stages' gradients
        layers.append(
            TiedLayerSpec(
                TIED_EMBEDDING_KEY,
                TokenEmbeddingPipe,
                input_embedding,
                tied_weight_attr=["embedding.weight"],
            )
        )
    else:
        layers.append(TokenEmbeddingPipe(input_embedding))
    if model_type == "gpt2":
        layers.append(GPT2PositionEmbeddingPipe(body.wpe, body.drop))
    for index, (block, mask_builder) in enumerate(zip(blocks, _mask_builders(model), strict=True)):
        layers.append(DecoderLayerPipe(block, config, mask_builder, rotary, index))
    layers.append(FinalNormPipe(final_norm))
    if tied:
        layers.append(
            TiedLayerSpec(
                TIED_EMBEDDING_KEY,
                TokenEmbeddingPipe,
                input_embedding,
                forward_fn=tied_lm_head_forward,
                tied_weight_attr=["embedding.weight"],
            )
        )
    else:
        layers.append(LMHeadPipe(output_embedding))
    return layers


def _layer_parameters(layer: nn.Module | LayerSpec) -> list[nn.Parameter]:
    """The parameters a layer (module or spec) holds, without building anything."""
    if isinstance(layer, nn.Module):
        return list(layer.parameters())
    return [p for arg in layer.module_args if isinstance(arg, nn.Module) for p in arg.parameters()]


def build_pipeline_module(
    model: nn.Module, num_stages: int, *, activation_checkpoint_interval: int = 0
) -> PipelineModule:
    """Cut a loaded HF causal LM into a DeepSpeed PipelineModule of `num_stages` stages."""
    layers = pipeline_layers(model)
    pipe = PipelineModule(
        layers=layers,
        num_stages=num_stages,
        loss_fn=CausalLMLoss(model.loss_function, model.config.vocab_size),
        partition_method="parameters",
        activation_checkpoint_interval=activation_checkpoint_interval,
        # reentrant checkpointing would cut the embedding off from its gradient (its input,
        # the token ids, cannot require grad), so only decoder blocks are checkpointed
        checkpointable_layers=[DecoderLayerPipe.__name__],
        # micro-batches of a step, and eval batches, may differ in sequence length
        dynamic_shape=True,
    )
    # the whole sequence (the module itself keeps only this stage's layers), for export
    pipe.hf_layers = layers
    return pipe


def hf_parameter_owners(pipe: PipelineModule, model: nn.Module) -> list[tuple[str, int]]:
    """Every HF parameter name of `model`, in layer order, with the pipeline stage that owns it."""
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[str, int] = {}
    for index, layer in enumerate(pipe.hf_layers):
        for parameter in _layer_parameters(layer):
            # a tied weight belongs to its first stage; DeepSpeed keeps the copies equal
            owners.setdefault(names[id(parameter)], pipe.stage_owner(index))
    missing = set(names.values()) - set(owners)
    if missing:
        raise RuntimeError(f"pipeline layers do not cover parameters {sorted(missing)}")
    return list(owners.items())


# ---------------------------------------------------------------------------------------------
# the engine the loop drives


def _micro_batch_iterator(micro_batches: list[dict[str, torch.Tensor]]) -> Iterator[tuple]:
    # first stage reads the inputs tuple, last stage the labels
    for batch in micro_batches:
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(batch["input_ids"])
        labels = batch["labels"]
        if "loss_scale" in batch:
            labels = (labels, batch["loss_scale"])
        yield (batch["input_ids"], attention_mask.long()), labels


def _layer_name(layer: nn.Module | LayerSpec) -> str:
    if isinstance(layer, TiedLayerSpec):
        return "lm_head (tied)" if layer.forward_fn is not None else "embedding (tied)"
    if isinstance(layer, DecoderLayerPipe):
        return f"block {layer.layer_index}"
    return {
        TokenEmbeddingPipe: "embedding",
        GPT2PositionEmbeddingPipe: "position embedding",
        FinalNormPipe: "final norm",
        LMHeadPipe: "lm_head",
    }[type(layer)]


class PipelineTrainEngine(EngineBase):
    """A DeepSpeed PipelineEngine behind the loop's step/eval/checkpoint/export interface."""

    def __init__(self, engine: deepspeed.PipelineEngine, model: nn.Module):
        self.engine = engine
        self.model = model
        self.pipe: PipelineModule = engine.module

    # -- topology, for the loop's data sharding and logging --------------------------------------

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel replicas (shard the data by this, not by rank)."""
        return self.engine.grid.data_parallel_id

    @property
    def data_parallel_size(self) -> int:
        return self.engine.grid.data_parallel_size

    @property
    def stage_id(self) -> int:
        return self.engine.stage_id

    @property
    def num_stages(self) -> int:
        return self.engine.num_stages

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps()

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    # -- training ----------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over the gradient-accumulation micro-batches; mean loss, on every rank."""
        expected = self.engine.gradient_accumulation_steps()
        if len(micro_batches) != expected:
            raise ValueError(
                f"pipeline train_step got {len(micro_batches)} micro-batches; "
                f"gradient_accumulation_steps is {expected}"
            )
        loss = self.engine.train_batch(data_iter=_micro_batch_iterator(micro_batches))
        if self.guard is not None:
            # DeepSpeed has stepped (or skipped an overflow): the guard judges after the update
            self.guard.judge(loss, None, (), self.engine)
        return loss.detach().reshape(())

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over the micro-batches and data-parallel replicas, on every rank."""
        was_training = self.pipe.training
        loss = self.engine.eval_batch(
            data_iter=_micro_batch_iterator(micro_batches),
            num_micro_batches=len(micro_batches),
        )
        self.pipe.train(was_training)
        return loss.detach().reshape(())

    @torch.no_grad()
    def eval_batch(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row (summed loss, counted tokens, correct tokens) of one batch, on every stage.

        The loop's StepEngine interface (dplaunch/train/engines.py): the last stage computes them
        from the logits and broadcasts them along its pipeline, so stage 0 can report them.
        """
        rows = batch["input_ids"].shape[0]
        _, logits = self.engine.eval_batch(
            data_iter=_micro_batch_iterator([batch]),
            return_logits=True,
            # the mean loss is computed and dropped: with compute_loss=False DeepSpeed adds the
            # logits to the loss total left over from training and fails on the shape
            compute_loss=True,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=1,
        )
        if self.engine.is_last_stage():
            labels = batch["labels"].to(logits.device)
            stats = torch.stack(loss_sums(logits, labels, "causal-lm")).float()
        else:
            stats = torch.zeros(3, rows, device=self.engine.device)
        grid = self.engine.grid
        dist.broadcast(
            stats,
            src=grid.stage_to_global(stage_id=self.num_stages - 1, data=grid.data_parallel_id),
            group=grid.get_pipe_parallel_group(),
        )
        return stats[0], stats[1], stats[2]

    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def layout_lines(self) -> list[str]:
        """Which layers each pipeline stage holds, for the run log."""
        names = [_layer_name(layer) for layer in self.pipe.hf_layers]
        parts = [int(p) for p in self.pipe.parts]
        return [
            f"pipeline stage {stage}: layers {parts[stage]}-{parts[stage + 1] - 1} "
            f"({', '.join(names[parts[stage] : parts[stage + 1]])})"
            for stage in range(self.num_stages)
        ]

    def train(self) -> None:
        self.pipe.train()

    def eval(self) -> None:
        self.pipe.eval()

    # -- checkpoints and export -------------------------------------------------------------------

    def save_checkpoint(self, directory: str | os.PathLike, tag: str, client_state: dict) -> None:
        """DeepSpeed checkpoint (layers, optimizer, scheduler); every rank calls it."""
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: str | os.PathLike, tag: str) -> dict:
        """Restore a DeepSpeed checkpoint; returns the client_state saved with it."""
        load_path, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {directory}")
        return client_state or {}

    def save(self, directory: str) -> None:
        """The loop's checkpoint call: layers, optimizer and scheduler of every stage."""
        self.save_checkpoint(directory, PIPELINE_TAG, {})

    def load(self, directory: str) -> None:
        """The loop's resume call: restore what save() wrote, with the run file's lr and
        optimizer settings (see RunFileHyperparameters)."""
        groups = self.engine.optimizer.param_groups
        run_file = RunFileHyperparameters(groups, self.engine.lr_scheduler)
        self.load_checkpoint(directory, PIPELINE_TAG)
        run_file.restore(self.engine.optimizer.param_groups)

    def load_universal(self, directory: str, step: int) -> None:
        """Restore a checkpoint of any layout from its universal form (train/universal.py): each
        stage takes its own layers' parameters, by their HF names."""
        from pathlib import Path

        from dplaunch.train import universal_load
        from dplaunch.train.engines import RunFileHyperparameters
        from dplaunch.train.universal import UniversalReader

        reader = UniversalReader(Path(directory))
        run_file = RunFileHyperparameters(
            self.engine.optimizer.param_groups, self.engine.lr_scheduler
        )
        own = {id(parameter) for parameter in self.pipe.parameters()}
        named = [
            (name, parameter)
            for name, parameter in self.model.named_parameters()
            if id(parameter) in own and parameter.requires_grad
        ]
        universal_load.load_deepspeed(reader, self.engine, named, step, whole_model=False)
        universal_load.load_scheduler(reader, self.engine.lr_scheduler)
        run_file.restore(self.engine.optimizer.param_groups)
        reader.close()

    def export(self, directory: str, tokenizer: Any) -> None:
        """The loop's export call: one HF model + tokenizer in `directory`; every rank calls it."""
        self.export_hf(directory, self.model)
        if dist.get_rank() == 0 and tokenizer is not None:
            tokenizer.save_pretrained(directory)
        dist.barrier()

    def export_hf(self, out_dir: str | os.PathLike, hf_config_model: nn.Module) -> None:
        """Write one consolidated HF model to `out_dir`; every rank calls it, rank 0 writes.

        `hf_config_model` is the HF model this engine was built from (or one of the same
        architecture): rank 0 saves the gathered weights under its names, config and
        generation config.
        """
        grid = self.engine.grid
        rank = dist.get_rank()
        # the one dtype every stage's parameters have after DeepSpeed cast them
        if self.engine.bfloat16_enabled():
            dtype = torch.bfloat16
        elif self.engine.fp16_enabled():
            dtype = torch.float16
        else:
            dtype = torch.float32
        # data-parallel replicas hold identical weights: replica 0 of each stage sends to rank 0
        if grid.data_parallel_id == 0:
            local = dict(self.model.named_parameters())
            shapes = {n: p.shape for n, p in hf_config_model.named_parameters()}
            state: dict[str, torch.Tensor] = {}
            for name, stage in hf_parameter_owners(self.pipe, self.model):
                owner = grid.stage_to_global(stage_id=stage, data=0)
                if rank == owner == 0:
                    state[name] = local[name].detach().to(device="cpu", dtype=dtype).clone()
                elif rank == owner:
                    dist.send(local[name].detach().to(dtype).contiguous(), dst=0)
                elif rank == 0:
                    buffer = torch.empty(shapes[name], dtype=dtype, device=self.engine.device)
                    dist.recv(buffer, src=owner)
                    state[name] = buffer.cpu()
            if rank == 0:
                hf_config_model.save_pretrained(str(out_dir), state_dict=state)
        dist.barrier()


def _check_config(ds_config: dict, num_stages: int) -> None:
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage >= 2:
        raise ValueError(
            f"zero_optimization.stage {stage} cannot be combined with pipeline parallelism "
            "(DeepSpeed supports ZeRO stage 0 or 1 with pp>1)"
        )
    if int(ds_config.get("tensor_parallel", {}).get("autotp_size", 1)) > 1:
        # DeepSpeed 0.19: AutoTP swaps the engine's process grid for its own TP/DP mesh, so
        # pipeline stages are treated as data-parallel replicas (weights broadcast across stages)
        raise ValueError(
            "tensor_parallel.autotp_size > 1 cannot be combined with pipeline parallelism "
            "(DeepSpeed AutoTP does not work with its pipeline engine)"
        )
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")


def create_pipeline_engine(
    model: nn.Module,
    *,
    num_stages: int,
    ds_config: dict,
    lr_scheduler_factory: Callable[[torch.optim.Optimizer], Any],
    seed: int,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    task: str = "causal-lm",
) -> PipelineTrainEngine:
    """Cut `model` into `num_stages` stages and wrap it in a DeepSpeed PipelineEngine.

    `ds_config["train_batch_size"]` must be micro × grad-accum × data-parallel size, where the
    data-parallel size is world size / num_stages (pipeline stages do not multiply the batch).
    The optimizer is `optimizer_factory(stage_module)` (this stage's parameters only) when
    given, otherwise the one `ds_config["optimizer"]` describes.
    """
    from accelerate.utils import set_seed

    if not task_of(task).pipeline:
        raise ValueError(f"pipeline parallelism (pp>1) does not train task {task}")
    _check_supported(model.config.model_type)
    _check_config(ds_config, num_stages)
    # deepspeed.comm keeps its own handle on the process group even when torch's exists (the
    # caller's): init_distributed then only wraps it, and creates one only when there is none,
    # with DeepSpeed's own default timeout unless told launch.timeout_minutes' (the rank's)
    if dist.is_initialized():
        backend = dist.get_backend()
    else:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=collective_timeout())
    # same seed on every rank, as the data-parallel path does (dropout masks, nothing else)
    set_seed(seed)
    activation_checkpoint_interval = int(
        ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0)
    )
    pipe = build_pipeline_module(
        model, num_stages, activation_checkpoint_interval=activation_checkpoint_interval
    )
    # DeepSpeed's fp32 clipping without ZeRO (runtime.utils.clip_grad_norm_) counts a parameter
    # only on pipeline stage 0 unless it is flagged model-parallel, so it would clip by the first
    # stage's norm alone. Each stage's parameters are its own: flag them, except the second copy
    # of a tied weight (ds_pipe_replicated), which must count once. ZeRO-1 and bf16 count by
    # tensor-parallel rank and are unaffected by the flag.
    for parameter in pipe.parameters():
        if not getattr(parameter, "ds_pipe_replicated", False):
            parameter.model_parallel = True
    engine, _, _, _ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer_factory(pipe) if optimizer_factory is not None else None,
        model_parameters=[p for p in pipe.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=lr_scheduler_factory,
    )
    return PipelineTrainEngine(engine, model)


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PipelineTrainEngine",
    "build_pipeline_module",
    "create_pipeline_engine",
    "hf_parameter_owners",
    "pipeline_layers",
]
