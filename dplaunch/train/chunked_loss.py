"""The output head and the loss a chunk of tokens at a time (train.loss_chunk): no [tokens,
vocabulary] tensor of the whole micro-batch exists, in the forward or in the backward.

Two forms, one per kind of loss:

- ``fused_cross_entropy`` (the model's own token loss: causal-lm, sft's answers): Liger's fused
  linear cross-entropy. For each chunk the forward computes the logits, their loss, and at once
  the gradients it would take in the backward: d loss / d logits = softmax − one-hot on the
  labelled rows, then the hidden states' gradient (that times the head's weight) and the head
  weight's (its transpose times the chunk's hidden states, added up over the chunks). The
  backward only scales the two by the incoming gradient. Nothing is recomputed, so tokens/s stays
  at the full logits' (the head's products run once forward and twice for the gradients, as an
  ordinary backward does); the memory is one fp32 buffer of a chunk's logits (their softmax and
  gradient in place) and the head's gradient (which the backward allocates anyway). It needs the
  head's weight whole on the rank: DDP, ZeRO-1/2, LoRA, FSDP2 (whose root holds its weights
  gathered from the forward to the end of the backward).
- ``chunked_head`` (ZeRO-3's partitioned head, and the losses that need each token's
  log-probability: dpo's responses, grpo's completions): each chunk's head and loss run under
  non-reentrant activation checkpointing (torch.utils.checkpoint), calling the head module so
  that ZeRO-3 gathers its weight; the backward recomputes one chunk's logits at a time. ZeRO-3
  gathers the head once a micro-batch, not once a chunk, from the second micro-batch on:
  DeepSpeed's coordinator keeps a parameter whose module its trace says comes again soon
  (stage3_max_reuse_distance), here every chunk and each recompute (tests/test_chunked_loss.py).

Both sum over tokens; the caller divides (ChunkedTokenLoss.mean, train/sequence_parallel.py: by
the micro-batch's labelled tokens, as the model's own loss does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from dplaunch.data.example_tokens import IGNORE_INDEX
from dplaunch.tasks import task_of


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Σ cross-entropy(hidden @ weightᵀ, targets) over the labelled tokens, chunk by chunk, the
    gradients computed in the forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if wants_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants_weight else None
        for start in range(0, hidden.size(0), chunk):
            part = hidden[start : start + chunk]
            labels = targets[start : start + chunk]
            labelled = labels != IGNORE_INDEX
            picked = labels.clamp(min=0)
            # the chunk's one [rows, vocab] tensor: its logits, then their softmax in place
            # (torch.logsumexp would hold two more of its size), then the gradient
            logits = (part @ weight.t()).float()
            chosen = logits.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
            peak = logits.amax(dim=-1, keepdim=True)
            sums = logits.sub_(peak).exp_().sum(dim=-1, keepdim=True)
            lse = (sums.log() + peak).squeeze(-1)
            total += ((lse - chosen) * labelled).sum()
            # softmax − one-hot
            grad = logits.div_(sums)
            grad[torch.arange(len(labels), device=grad.device), picked] -= 1.0
            grad.mul_(labelled.unsqueeze(-1))
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = (grad.to(weight.dtype) @ weight).to(
                    hidden.dtype
                )
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), part.float())
            # freed before the next chunk's logits are made, not after (two at once otherwise)
            del logits, grad
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else torch.empty(0),
            grad_weight if grad_weight is not None else torch.empty(0),
        )
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # scaled in place: the forward made them for this backward alone (a copy would hold the
        # head's gradient twice at once)
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden = grad_hidden.mul_(grad_output) if ctx.needs_input_grad[0] else None
        weight = (
            grad_weight.mul_(grad_output).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        )
        return hidden, weight, None, None


def fused_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Σ over the labelled TARGETS (IGNORE_INDEX elsewhere) of the cross-entropy of HIDDEN
    [tokens, h] through a head of WEIGHT [vocab, h] (no bias), CHUNK tokens at a time, the
    gradients computed in the forward."""
    flat = hidden.reshape(-1, hidden.size(-1))
    return _FusedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), max(int(chunk), 1))


def pieces_for(rows: int, longest: int, chunk: int) -> int:
    """How many chunks a micro-batch of ROWS rows of at most LONGEST tokens is cut into for
    chunks of about CHUNK tokens: from the plan's sizes, not from the batch's own length, so that
    every rank makes as many calls (ZeRO-3 gathers the head's weight in each: collective)."""
    return max(1, -(-rows * max(longest, 1) // max(chunk, 1)))


def chunked_head(
    function: Callable[..., torch.Tensor], hidden: torch.Tensor, pieces: int, *extra: torch.Tensor
) -> list[torch.Tensor]:
    """FUNCTION(a chunk of HIDDEN [rows, tokens, h], the same chunk of each EXTRA [rows, tokens…])
    over PIECES chunks along the sequence, each under checkpointing: its logits (or a tiled
    MLP's intermediate activations: train/sequence_parallel.py) exist only while it runs, and
    again one chunk at a time in the backward. Always PIECES calls, empty chunks too (pieces_for):
    ZeRO-3 gathers the parameters FUNCTION uses in each, on every rank alike."""
    parts = zip(
        torch.tensor_split(hidden, pieces, dim=1),
        *(torch.tensor_split(t, pieces, dim=1) for t in extra),
        strict=True,
    )
    return [checkpoint(function, *part, use_reentrant=False) for part in parts]


def base_model(model: Any) -> Any:
    """The transformers model under peft's adapters (the model itself without)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class FinalHidden:
    """Keeps the decoder's last hidden state (after the final norm) of the next forward the
    caller expects, so that the head is applied to it a chunk at a time; the model's own logits
    are then computed for no position (logits_to_keep). Registered after the engine wraps the
    model: ZeRO-3's own hook replaces the norm's output with one whose backward gathers the
    norm's weight first, and this hook keeps that one (the decoder returns it). Other forwards
    (an evaluation's, which computes the model's own logits) are left alone."""

    def __init__(self, model: Any):
        self.value: torch.Tensor | None = None
        self.wanted = False
        base_model(model).get_decoder().register_forward_hook(self._keep)

    def expect(self) -> None:
        """The next forward's hidden states are to be kept."""
        self.wanted = True

    def _keep(self, _module: Any, _inputs: Any, output: Any) -> None:
        if self.wanted:
            self.value = output[0] if isinstance(output, tuple) else output.last_hidden_state
            self.wanted = False

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        assert value is not None, "the forward did not reach the decoder's end"
        return value


def head_is_whole(head: Any) -> bool:
    """Whether the head's weight is whole on this rank, without a bias, so that the fused form
    can take its gradient in the forward: not a ZeRO-3 partition (ds_numel) nor a DTensor (FSDP2
    before its root's forward, tp); FSDP2's root keeps its weights gathered from the forward to
    the end of the backward, so after the forward its head is a plain tensor."""
    weight = head.weight
    return (
        getattr(head, "bias", None) is None
        and not hasattr(weight, "ds_numel")
        and type(weight.data) is torch.Tensor
    )


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """The next token's label at each position (IGNORE_INDEX past the end), as HF's causal loss
    shifts them."""
    shift = torch.full_like(labels, IGNORE_INDEX)
    shift[:, :-1] = labels[:, 1:]
    return shift


class _HeadChunks:
    """The decoder's final hidden states of a forward that computes no logits, and the head to
    run on them a chunk of CHUNK tokens at a time; LONGEST: a row's tokens at most (the plan's),
    from which every rank cuts as many chunks (pieces_for)."""

    def __init__(self, model: Any, chunk: int, longest: int):
        self.final = FinalHidden(model)
        self.head = base_model(model).get_output_embeddings()
        self.chunk, self.longest = chunk, longest

    def hidden(self, model: Any, inputs: dict[str, torch.Tensor], **options: Any) -> torch.Tensor:
        """The final hidden states [rows, tokens, h] of MODEL's forward on INPUTS."""
        no_logits = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        self.final.expect()
        model(**inputs, **options, logits_to_keep=no_logits)
        return self.final.take()

    def pieces(self, rows: int) -> int:
        """The chunks of a micro-batch of ROWS rows (the same on every rank)."""
        return pieces_for(rows, self.longest, self.chunk)


class ChunkedTokenLoss(_HeadChunks):
    """The model's own token loss (causal-lm, sft's answers) with the head a chunk at a time:
    fused (gradients in the forward) where the head is whole on the rank, else in checkpointed
    chunks of the head module (which ZeRO-3 gathers)."""

    @property
    def fuses(self) -> bool:
        return head_is_whole(self.head)

    def line(self) -> str:
        """What the start-up log says of it."""
        # said before the first forward: FSDP2's head is still a shard then (a DTensor), whole
        # from its root's forward on; ZeRO-3's stays a partition
        recomputed = hasattr(self.head.weight, "ds_numel") or self.head.bias is not None
        how = "each chunk recomputed" if recomputed else "gradients in the forward"
        return f"chunked loss: the head and the loss {self.chunk} tokens at a time ({how})"

    def sum(
        self, model: Any, inputs: dict[str, torch.Tensor], targets: torch.Tensor, **options: Any
    ) -> torch.Tensor:
        """Σ cross-entropy over the labelled TARGETS (the next tokens, IGNORE_INDEX elsewhere)
        of MODEL's forward on INPUTS."""
        hidden = self.hidden(model, inputs, **options)
        if self.fuses:
            return fused_cross_entropy(hidden, self.head.weight, targets, self.chunk)
        parts = chunked_head(
            lambda h, y: cross_entropy_sum(self.head(h), y),
            hidden,
            self.pieces(hidden.size(0)),
            targets,
        )
        return torch.stack(parts).sum()

    def mean(self, model: Any, batch: dict[str, torch.Tensor], **options: Any) -> torch.Tensor:
        """The micro-batch's loss as the model's own (its mean over the labelled next tokens)."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        targets = shifted(batch["labels"])
        tokens = (targets != IGNORE_INDEX).sum().clamp(min=1)
        return self.sum(model, inputs, targets, **options) / tokens


def token_loss_chunk(plan: Any, task: str) -> int:
    """The tokens of a chunk of the model's own token loss (causal-lm, sft) as planned, or 0:
    dpo's and grpo's objectives chunk their log-probabilities themselves (ChunkedHead)."""
    return plan.loss_chunk if task_of(task).sequence_parallel else 0


@contextlib.contextmanager
def _whole_head(model: Any, head: Any) -> Iterator[None]:
    """The head's weight whole while its chunks run: FSDP2 reshards a root after its forward
    where told to (a frozen reference, train/fsdp.py shard_model), leaving the head a shard; it
    is gathered (FSDPModule.unshard) and sharded again after. A head already whole (a training
    root, DDP, ZeRO-3's module hooks gather their own) is left alone."""
    if type(head.weight.data) is torch.Tensor or not hasattr(model, "unshard"):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


class ChunkedHead(_HeadChunks):
    """A token-level function of a causal LM's logits (the log-probability of each target, its
    entropy) computed a chunk of CHUNK tokens at a time: the model's forward keeps no logits, and
    each chunk's head and function run under checkpointing (chunked_head), in the backward too.
    dpo's responses and grpo's completions take their log-probabilities so."""

    def __call__(
        self,
        model: Any,
        batch: dict[str, torch.Tensor],
        targets: torch.Tensor,
        function: Callable[[torch.Tensor, torch.Tensor], Any],
    ) -> Any:
        """FUNCTION(logits [rows, t, vocab], targets [rows, t]) over the micro-batch's positions
        but the last (TARGETS: the next tokens, [rows, length − 1]), joined along the sequence:
        a tensor, or a tuple of them."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        hidden = self.hidden(model, inputs, use_cache=False)[:, :-1]
        with _whole_head(model, self.head):
            parts = chunked_head(
                lambda h, y: function(self.head(h), y),
                hidden,
                self.pieces(hidden.size(0)),
                targets,
            )
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column, dim=1) for column in zip(*parts, strict=True))
        return torch.cat(parts, dim=1)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of LOGITS [..., vocab] at LABELS (IGNORE_INDEX left out), in fp32."""
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
