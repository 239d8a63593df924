"""train.loss_chunk in the plan: whether the output head and the loss run a chunk of tokens at a
time (train/chunked_loss.py), how many tokens a chunk holds, and the memory that leaves.

`auto` turns chunking on where it matters: when the logits of a micro-batch (tokens ×
vocabulary × LOSS_BYTES_PER_LOGIT, what HF's loss holds at its peak) take a GiB or more and at
least AUTO_SHARE of the forward/backward's activations and logits together — a large vocabulary
(Llama-3's 128 K, Gemma's 256 K) at long sequences; tiny test models stay unchunked. A chunk then holds about
``hidden_size`` tokens (a chunk's logits about the head's own size, as DeepSpeed's tiled loss
chooses). `off`: the model's own full logits; N: chunks of N tokens.

Where it runs: every task with a vocabulary head (causal-lm, sft: the loss, in
train/sequence_parallel.py's engine; dpo, grpo: the policy's per-token log-probabilities, in
their objectives, always in checkpointed chunks: their gradient is not known in the forward), on
DDP, ZeRO-1/2/3, FSDP2 and LoRA, with or without sp. Not with tp (a vocabulary-parallel head: each
rank holds a slice of the vocabulary, and the loss would need its logsumexp across the tp group)
nor pp (the pipeline's last stage computes its own loss): `auto` stays off there, a number is
refused with the reason (check_loss_chunk).

Memory, one chunk of C tokens: C × vocabulary × LOSS_BYTES_PER_LOGIT; where the fused form runs
(the model's own token loss, the head's weight whole on the rank: not ZeRO-3's partition) it also holds the
head's gradient in fp32 from the forward to the backward (4 × vocabulary × hidden bytes);
elsewhere each chunk's logits are recomputed in the backward (the head's forward FLOPs once
more: fuses() says which).
"""

from __future__ import annotations

from typing import Any

from dplaunch.errors import UserError
from dplaunch.tasks import task_of

# auto chunks when the logits are at least this share of the activations and logits together
AUTO_SHARE = 0.25
# the smallest chunk auto picks (a small hidden size would make many tiny products)
MIN_AUTO_CHUNK = 256
# logits auto leaves whole, whatever their share: below a GiB chunking saves nothing that counts
# on a GPU, and costs small models' tokens/s (tiny test models stay unchunked)
MIN_AUTO_BYTES = 2**30


# Workload.loss_chunk of train.tiled_mlp without a chunk size: always chunked, auto's size
TILED = -1


def chunk_setting(value: int | str, tiled_mlp: bool = False) -> int | None:
    """Workload.loss_chunk of train.loss_chunk: 0 off, None auto, else the tokens of a chunk;
    with train.tiled_mlp (whose loss is always chunked) TILED unless a number is given."""
    if isinstance(value, int):
        return value
    if tiled_mlp:
        return TILED
    return 0 if value == "off" else None


def why_not_chunked(task: str, *, tp: int, pp: int) -> str | None:
    """Why this task or layout cannot chunk its loss, or None."""
    if not task_of(task).causal:
        return f"model.task {task} has no vocabulary head"
    if tp > 1:
        return "a tensor-parallel head splits the vocabulary over ranks (AutoTP)"
    if pp > 1:
        return "the pipeline's last stage computes its own loss"
    return None


def check_loss_chunk(value: int | str, task: str, dims: Any, tiled_mlp: bool) -> None:
    """Refuse train.loss_chunk N (or train.tiled_mlp, whose loss is chunked) where it cannot run."""
    if value in ("auto", "off") and not tiled_mlp:
        return
    reason = why_not_chunked(task, tp=dims.tp, pp=dims.pp)
    if reason is not None:
        key = "train.tiled_mlp" if value in ("auto", "off") else "train.loss_chunk"
        raise UserError(key, f"cannot chunk the loss: {reason}", "remove it, or set it off")


def fuses(task: str, zero_stage: int, fsdp: bool) -> bool:
    """Whether the chunked loss computes its gradients in the forward (the fused form: the
    model's own token loss, the head whole on the rank: not a ZeRO-3 partition; FSDP2's root
    holds its head gathered from the forward to the end of the backward), rather than
    recomputing each chunk."""
    return task_of(task).sequence_parallel and (zero_stage != 3 or fsdp)


def resolve_chunk(
    setting: int | None, tokens: float, hidden: int, logits: float, activations: float
) -> int:
    """The tokens of a chunk (0: not chunked) for SETTING (Workload.loss_chunk), a micro-batch
    of TOKENS whose full LOGITS and ACTIVATIONS take those bytes."""
    if setting == 0 or tokens <= 0:
        return 0
    small = logits < MIN_AUTO_BYTES or logits < AUTO_SHARE * (logits + activations)
    if setting is None and small:
        return 0
    if setting is None or setting == TILED:
        setting = max(hidden, MIN_AUTO_CHUNK)
    return int(min(setting, tokens))
