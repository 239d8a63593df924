"""Long sequences: Ulysses sequence parallelism (parallel.sp) and tiled MLP + loss (train.tiled_mlp).

The ``sp`` consecutive ranks of a group read the same samples (one data-parallel rank's); each
keeps one slice of every sequence. DeepSpeed's ``UlyssesSPAttentionHF`` wraps the model's attention
kernel: an all-to-all turns sequence slices of all heads into whole sequences of ``heads / sp``
heads, attention runs, a second all-to-all turns them back. Everything else in a decoder works
token by token, so it runs on the slice as it is.

The loss: each rank sums the cross-entropy of its slice's labels (shifted before slicing, so the
token after a slice's end is still predicted) and divides by the labelled tokens of the whole
micro-batch, times ``sp``. DDP and ZeRO average gradients over every rank, sp ranks included, so
the sp copies of each partial gradient add up to the group's gradient of the micro-batch mean, and
the logged loss (summed over ranks ÷ world) is the mean over the step's tokens: DP's numbers.
Evaluation runs on the slices too (each rank's logits are a slice's): the ranks of a group sum
their slices' losses, tokens and correct predictions into the evaluation's totals.

Tiling (ALST): with ``train.tiled_mlp`` each MLP and the logits + loss run over tiles of the
sequence, each tile under non-reentrant activation checkpointing, so only one tile's intermediate
activations (and logits) exist at a time, in the forward and in the backward. DeepSpeed's
``TiledMLP`` and ``TiledFusedLogitsLoss`` do the same by running backward passes of their own, inside
the backward and inside the forward: then a weight's gradient is accumulated once per tile, which
DDP's reducer refuses ("marked ready twice") and which needs ZeRO's ``ds_grad_is_ready`` handshake.
Checkpointed tiles stay inside autograd's one backward, so they compose with DDP and ZeRO 1-3 alike.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

from dplaunch.data.example_tokens import IGNORE_INDEX
from dplaunch.train.chunked_loss import (
    ChunkedTokenLoss,
    chunked_head,
    cross_entropy_sum,
    shifted,
    token_loss_chunk,
)
from dplaunch.train.engines import AccelerateEngine, token_sums


class SequenceShards:
    """This rank's place in its sequence-parallel group: cuts micro-batches into its slice."""

    def __init__(self, size: int, rank: int, pad_id: int):
        self.size = size
        self.rank = rank
        self.pad_id = pad_id

    def slice(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """(this rank's slice of the micro-batch, the micro-batch's labelled tokens).

        Labels are shifted before slicing (the next token of each position, -100 past the end),
        position ids made explicit (Ulysses gathers them to mask whole sequences), and the rows
        padded to a multiple of sp: padding comes after a row's tokens, which never attend to it."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        width = input_ids.shape[1]
        positions = self.positions(batch)
        shift = shifted(labels)
        tokens = int((shift != IGNORE_INDEX).sum())
        pad = -width % self.size
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=self.pad_id)
            shift = torch.nn.functional.pad(shift, (0, pad), value=IGNORE_INDEX)
        part = (width + pad) // self.size
        cut = slice(self.rank * part, (self.rank + 1) * part)
        local = {
            "input_ids": input_ids[:, cut].contiguous(),
            "position_ids": positions[:, cut].contiguous(),
            "shift_labels": shift[:, cut].contiguous(),
        }
        return local, tokens

    def positions(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The position ids of the whole rows, padded to a multiple of sp: the batch's own
        (packed rows), else 0, 1, 2, … Packed rows pad with one-token segments (position 0), as
        data.py does; the others go on counting."""
        input_ids = batch["input_ids"]
        rows, width = input_ids.shape
        positions = batch.get("position_ids")
        pad = -width % self.size
        if positions is None:
            return torch.arange(width + pad, device=input_ids.device).expand(rows, width + pad)
        return torch.nn.functional.pad(positions, (0, pad), value=0)


def sequence_parallel_groups(world_groups: list[list[int]], rank: int) -> Any:
    """The torch process group of this rank's sp ranks (every rank creates every group, in order)."""
    import torch.distributed as dist

    mine = None
    for ranks in world_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _deepspeed_comm() -> None:
    # Ulysses runs its collectives through deepspeed.comm: under DDP nothing has set it up yet,
    # and it adopts the process group Accelerate already made
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)


def packed_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """The mask of packed rows over their whole length (rows, 1, L, L), from their position ids:
    causal inside each example, nothing across examples, as transformers builds it without
    sequence parallelism (masking_utils.find_packed_sequence_indices); None when every row holds
    one sequence (the mask-free causal kernel)."""
    from transformers.masking_utils import find_packed_sequence_indices

    segments = find_packed_sequence_indices(positions)
    if segments is None:
        return None
    length = segments.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


class UlyssesAttention:
    """The attention kernel that replaces the model's in transformers' table: DeepSpeed's Ulysses
    all-to-all over the sp group in training and in the engine's sliced evaluation; the model's
    own kernel elsewhere (rank 0 alone answering train.sample_prompts, whole sequences)."""

    def __init__(self, core: Any, kernel_name: str, config: Any, group: Any):
        self.core = core
        # sdpa masks the whole gathered rows with ``mask``; flash kernels go varlen from the
        # gathered position ids themselves
        self.masks = kernel_name == "sdpa"
        self.config = config
        self.group = group
        self.sliced = False  # set by LongSequenceEngine.eval_batch around its forward
        # the gathered rows' mask of the forward under way (packed rows), for every layer
        self.mask: torch.Tensor | None = None
        # that mask as SDPA's additive bias, by dtype: given a boolean mask SDPA makes the bias
        # itself in every layer and keeps each for the backward (rows × L² × 2 bytes a layer)
        self._biases: dict[torch.dtype, torch.Tensor] = {}
        # UlyssesSPAttentionHF reshapes by a fixed row count: one per count met (training's
        # micro-batch, evaluation's and its shorter last batch)
        self._by_rows: dict[int, Any] = {}

    def prepare(self, shards: SequenceShards, batch: dict[str, torch.Tensor]) -> None:
        """Before a forward of BATCH (whole rows): the mask of the gathered rows, built once for
        all layers (each layer building its own kept one L × L mask per layer for the backward),
        none for rows of one sequence each (the mask-free causal kernel). Kept until release():
        the layers activation checkpointing recomputes in the backward mask as their forward did."""
        self.release()
        if self.masks and "position_ids" in batch:
            self.mask = packed_mask(shards.positions(batch))

    def release(self) -> None:
        """After the backward (or an evaluation's forward): the mask is no longer needed."""
        self.mask = None
        self._biases.clear()

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if not (module.training or self.sliced):
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        # RoPE's fp32 cos/sin promote q and k under autocast (DDP + bf16): the all-to-alls would
        # move them in fp32, which the kernel casts to v's 16 bits anyway
        query, key = query.to(value.dtype), key.to(value.dtype)
        # the model's mask covers a slice only: the gathered rows' own (or none) instead
        return self._ulysses(query.shape[0])(module, query, key, value, None, *args, **kwargs)

    def _inner(self, module, query, key, value, attention_mask, *args, **kwargs):
        # the kernel Ulysses calls on the gathered rows of heads / sp heads
        if self.masks:
            attention_mask = None if self.mask is None else self._bias(query.dtype)
        return self.core(module, query, key, value, attention_mask, *args, **kwargs)

    def _bias(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._biases:
            assert self.mask is not None
            blocked = torch.finfo(dtype).min
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._biases[dtype] = bias.masked_fill_(~self.mask, blocked)
        return self._biases[dtype]

    def _ulysses(self, rows: int) -> Any:
        if rows not in self._by_rows:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            config = self.config
            self._by_rows[rows] = UlyssesSPAttentionHF(
                attn=self._inner,
                batch_size=rows,
                attn_head_count=config.num_attention_heads,
                attn_head_size=getattr(
                    config, "head_dim", config.hidden_size // config.num_attention_heads
                ),
                kv_head_count=config.num_key_value_heads,
                num_hidden_layers=config.num_hidden_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
        return self._by_rows[rows]


def install_ulysses(model: Any, group: Any) -> UlyssesAttention:
    """Route the model's attention through DeepSpeed's Ulysses all-to-all over ``group``.

    As DeepSpeed's register_with_transformers, without its global mpu (which needs ZeRO's
    engine): the kernel the model uses is replaced in transformers' table by the wrapper."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _deepspeed_comm()
    kernel_name = model.config._attn_implementation
    attention = UlyssesAttention(
        ALL_ATTENTION_FUNCTIONS[kernel_name], kernel_name, model.config.get_text_config(), group
    )
    ALL_ATTENTION_FUNCTIONS[kernel_name] = attention
    return attention


def tiles_for(tokens: int, hidden_size: int) -> int:
    """How many tiles a sequence slice runs in: tiles of about ``hidden_size`` tokens, as
    DeepSpeed's TiledMLP example chooses (a tile's logits are then about the lm_head's size)."""
    return max(1, math.ceil(tokens / hidden_size))


def tile_mlps(model: Any, tiles: int) -> None:
    """Run every decoder layer's MLP over ``tiles`` tiles of the sequence (train.tiled_mlp)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        whole = type(mlp).forward

        def forward(self: Any, hidden: torch.Tensor, _whole: Any = whole) -> torch.Tensor:
            if not self.training:
                return _whole(self, hidden)
            return torch.cat(chunked_head(lambda part: _whole(self, part), hidden, tiles), dim=1)

        mlp.forward = types.MethodType(forward, mlp)


class LongSequenceEngine(AccelerateEngine):
    """DDP and ZeRO 0-3 with each micro-batch's sequence split over an sp group (Ulysses) and/or
    the logits + loss computed in tiles: same step, same optimizer, another loss."""

    def __init__(
        self,
        *args: Any,
        shards: SequenceShards,
        tiled_mlp: bool,
        tiles: int,
        loss_chunk: int,
        longest: int,
        attention: UlyssesAttention | None,
    ):
        super().__init__(*args)
        self.shards = shards
        self.attention = attention
        unwrapped = self.accelerator.unwrap_model(self.model)
        # a sequence slice's tokens at most (LONGEST): every rank cuts its loss into as many chunks
        self.chunked = ChunkedTokenLoss(unwrapped, loss_chunk, longest) if loss_chunk else None
        self.tiled_mlp, self.tiles = tiled_mlp, tiles

    @property
    def evaluates_slices(self) -> bool:
        """Each rank of an sp group evaluates its slice of the group's sequences: its sums count."""
        return self.attention is not None

    def layout_lines(self) -> list[str]:
        lines = super().layout_lines()
        if self.shards.size > 1:
            lines.append(
                f"sequence parallel: Ulysses over {self.shards.size} ranks, this rank holds "
                f"slice {self.shards.rank} of each sequence, in training and evaluation"
            )
        if self.tiled_mlp:
            lines.append(f"tiled MLP: {self.tiles} tiles per sequence slice")
        if self.chunked is not None:
            lines.append(self.chunked.line())
        return lines

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        try:
            return super().train_step(micro_batches)
        finally:
            if self.attention is not None:  # the last micro-batch's mask, past its backward
                self.attention.release()

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        local, tokens = self.shards.slice(batch)
        shift_labels = local.pop("shift_labels")
        if self.attention is not None:
            self.attention.prepare(self.shards, batch)
        if self.chunked is None:
            logits = self.model(**local, **self.forward_options).logits
            loss_sum = cross_entropy_sum(logits, shift_labels)
        else:
            loss_sum = self.chunked.sum(self.model, local, shift_labels, **self.forward_options)
        # the sp copies of every gradient add up over the group (see the module's docstring)
        return loss_sum * (self.shards.size / max(tokens, 1))

    @torch.no_grad()
    def eval_batch(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of each row: its summed loss, labelled tokens and correct
        predictions (the loop adds the slices of the group up with the other ranks' sums)."""
        if self.attention is None:
            return super().eval_batch(batch)
        self.model.eval()
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        local, _ = self.shards.slice(batch)
        labels = local.pop("shift_labels")
        self.attention.sliced = True
        self.attention.prepare(self.shards, batch)
        try:
            logits = self.model(**local, **self.forward_options).logits
        finally:
            self.attention.sliced = False
            self.attention.release()
        return token_sums(logits, labels)


def prepare_long_sequences(
    model: Any, plan: Any, config: Any, rank: int, pad_id: int
) -> dict[str, Any]:
    """Before Accelerate wraps the model: Ulysses attention and tiled MLPs as the run asks; the
    keyword arguments of LongSequenceEngine (empty when neither is asked)."""
    chunk = token_loss_chunk(plan, config.model.task)
    sp = plan.sequence_parallel_size
    if sp <= 1 and not config.train.tiled_mlp and not chunk:
        return {}
    attention = None
    if sp > 1:
        group = sequence_parallel_groups(plan.mesh.sequence_parallel_groups(), rank)
        attention = install_ulysses(model, group)
    shards = SequenceShards(sp, plan.mesh.sequence_parallel_rank(rank), pad_id)
    tiles = tiles_for(config.data.max_length // sp, model.config.get_text_config().hidden_size)
    if config.train.tiled_mlp:
        tile_mlps(model, tiles)
    return {
        "shards": shards,
        "tiled_mlp": config.train.tiled_mlp,
        "tiles": tiles,
        "loss_chunk": chunk,
        "longest": config.data.max_length // sp,
        "attention": attention,
    }
