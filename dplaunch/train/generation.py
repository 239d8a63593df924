"""Sampling completions in the ranks (model.task: grpo), each one seeded by itself.

A completion's random draws come from its own generator, seeded by (train.seed, the prompt's
global index in the run, the completion's index among the prompt's), never by the rank: the same
run on another layout or rank count draws the same completions. One prompt's completions are
sampled together, as one batch of equal rows (no padding, natural positions), so a row's logits
do not depend on which other prompts a rank holds either.

Sampling follows transformers' order: the logits divided by the temperature, then top-k, then
top-p (the smallest set of tokens whose probability reaches top_p, at least one); the token is
the inverse of the cumulative distribution, over the vocabulary's order, at the row's uniform
draw. A row stops at an EOS token (kept as its last token); the batch goes on until every row
stopped or max_completion_length tokens.

Where forwards are collective (ZeRO-3 gathers each layer's weights from every rank, FSDP2 too),
the ranks generate in step, as transformers' synced_gpus: each decode step asks whether any rank
still has a row going, and a rank with fewer prompts runs dummy batches (Sampler.idle).

The interface (Sampler) is small so that another backend (vLLM on GPUs) can take its place.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch


def completion_seed(seed: int, prompt_index: int, generation: int) -> int:
    """The seed of one completion's draws: (seed, prompt's global index, completion's index)."""
    text = f"{seed}:{prompt_index}:{generation}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class Sampling:
    """train.grpo's sampling settings, and the tokens that end a completion."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    eos_ids: tuple[int, ...]


class Sampler(Protocol):
    """What the rollout asks of a generation backend (and its tokenizer, which decodes)."""

    tokenizer: Any

    def generate(self, prompt_ids: list[int], seeds: list[int]) -> list[list[int]]:
        """One completion (token ids, ending with an EOS token unless cut) per seed."""

    def idle(self, prompt_ids: list[int], rows: int) -> None:
        """A batch whose completions nobody needs: a rank with fewer prompts than another runs
        it where the ranks generate in step."""


def filtered_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[rows, vocab] logits ÷ temperature, with the tokens top-k and top-p leave out at −inf."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.size(-1):
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        # a token goes when the tokens likelier than it already reach top_p (the first stays)
        drop = (mass - ordered.softmax(-1)) >= sampling.top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token at its uniform draw in [0, 1): the inverse cumulative distribution."""
    cumulative = logits.softmax(-1).double().cumsum(-1)
    targets = uniforms.double().unsqueeze(-1) * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, targets).squeeze(-1)
    return chosen.clamp(max=logits.size(-1) - 1)


def cache_keyword(model: Any) -> str:
    """The KV cache's name in the forward's arguments and output: `cache` from transformers
    5.2x, `past_key_values` before (the GPU image's 5.17)."""
    from transformers import PreTrainedModel

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else "past_key_values"
    )


class EngineSampler:
    """Completions from the training engine's own model, with its KV cache (transformers'
    forward), in eval mode and without gradients; SYNCED: the ranks decode in step."""

    def __init__(
        self,
        model: Any,
        device: Any,
        sampling: Sampling,
        tokenizer: Any,
        *,
        synced: bool,
        autocast: Any = contextlib.nullcontext,
    ):
        self.model, self.device, self.sampling = model, device, sampling
        # decodes the completions for the reward functions
        self.tokenizer = tokenizer
        self.synced, self.autocast = synced, autocast
        self.cache_keyword = cache_keyword(model)

    def generate(self, prompt_ids: list[int], seeds: list[int]) -> list[list[int]]:
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        return self._decode(prompt_ids, len(seeds), generators)

    def idle(self, prompt_ids: list[int], rows: int) -> None:
        self._decode(prompt_ids, rows, None)

    @torch.no_grad()
    def _decode(self, prompt_ids: list[int], rows: int, generators: list | None) -> list[list[int]]:
        sampling, model = self.sampling, self.model
        was_training = model.training
        model.eval()
        eos = torch.tensor(sampling.eos_ids or (-1,), device=self.device)
        tokens = torch.tensor([prompt_ids] * rows, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        # nobody needs an idle batch's tokens: it stops as soon as the other ranks do
        finished |= generators is None
        out: list[torch.Tensor] = []
        past = None
        try:
            for _ in range(sampling.max_new_tokens):
                if self._all_finished(finished):
                    break
                with self.autocast():
                    output = model(input_ids=tokens, **{self.cache_keyword: past}, use_cache=True)
                past = getattr(output, self.cache_keyword)
                logits = filtered_logits(output.logits[:, -1], sampling)
                if generators is None:
                    chosen = logits.argmax(-1)
                else:
                    uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
                    chosen = draw(logits, uniforms.to(logits.device))
                out.append(torch.where(finished, -1, chosen))
                finished |= torch.isin(chosen, eos)
                tokens = chosen.unsqueeze(-1)
        finally:
            model.train(was_training)
        if generators is None or not out:
            return [[] for _ in range(rows)]
        table = torch.stack(out, 1).cpu().tolist()
        return [[token for token in row if token >= 0] for row in table]

    def _all_finished(self, finished: torch.Tensor) -> bool:
        if not self.synced:
            return bool(finished.all())
        import torch.distributed as dist

        going = (~finished).sum().float().reshape(1)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(going)
        return float(going) == 0.0
