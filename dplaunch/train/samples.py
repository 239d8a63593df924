"""train.sample_prompts: short greedy answers to a few prompts at each evaluation, logged by rank 0.

The file holds JSON lines {"prompt": TEXT or [messages…]}, or one text per line: a text is given
to the model as `tokenizer(text)` reads it (with a BOS token where the tokenizer adds one, as sft
trains a text prompt), a message list is rendered with the run's chat template and its generation
prompt (as `apply_chat_template(..., add_generation_prompt=True)`), so the model answers as the
next assistant turn. The launch check reads it (data/sft_checks.py); read_sample_prompts is shared.
"""

from __future__ import annotations

from typing import Any

import torch

from dplaunch.data.answer_spans import Renderer
from dplaunch.data.conversations import normalized_messages, read_sample_prompts
from dplaunch.train.data import leading_ids

# new tokens per answer: enough for a short reply, little next to an evaluation
MAX_NEW_TOKENS = 48


def sample_line(sample: dict) -> str:
    """A prompt and its answer on one line: a message list is shown as its last message (the
    question), not as the list (metrics.jsonl keeps the whole prompt)."""
    prompt = sample["prompt"]
    if not isinstance(prompt, str):
        messages = normalized_messages(prompt)  # ShareGPT's {from, value}, text parts
        prompt = str(messages[-1].get("content", "")) if messages else ""
    return f"{prompt!r} → {sample['answer']!r}"


class PromptSampler:
    """Greedy answers of the model to the run's sample prompts."""

    def __init__(self, path: str, tokenizer: Any, renderer: Renderer):
        self.tokenizer = tokenizer
        self.prompts = read_sample_prompts(path)
        self.texts = [
            prompt
            if isinstance(prompt, str)
            else renderer.render(normalized_messages(prompt), add_generation_prompt=True)
            for prompt in self.prompts
        ]
        self.leading = leading_ids(tokenizer)

    @torch.no_grad()
    def answers(self, model: Any, device: torch.device, synced: bool = False) -> list[dict]:
        """[{prompt, answer}] for each prompt; SYNCED: every rank generates (ZeRO-3, TP forwards
        are collective), kept in step by generate(synced_gpus=True)."""
        tokenizer = self.tokenizer
        was_training = model.training
        model.eval()
        out = []
        try:
            for prompt, text in zip(self.prompts, self.texts, strict=True):
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if isinstance(prompt, str):
                    ids = [*self.leading, *ids]
                ids = torch.tensor([ids], device=device)
                generated = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    synced_gpus=synced,
                )
                answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
                out.append({"prompt": prompt, "answer": answer})
        finally:
            model.train(was_training)
        return out
