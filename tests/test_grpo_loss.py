"""dplaunch's GRPO maths (train/grpo_loss.py) is TRL 1.16's GRPOTrainer's, token for token, in one
process on a tiny Qwen2 built from a config, with TRL's own trainer as the reference:

- the advantages: TRL's `_generate_and_score_completions` scores fixed completions (its
  `_generate` patched to return them, so its whole reward path runs: the reward functions' None,
  the weighted nansum, the unscorable rows, nanmean and nanstd, the scaling, nan_to_num) with
  three reward functions of ours reading a table; `group_advantages` on the same table gives its
  advantages for scale_rewards group, batch and none, and its logged reward and
  frac_reward_zero_std;
- the loss: TRL's `_compute_loss(model, inputs)` on micro-batches we build (prompts of equal
  length, so its left padding adds nothing; right-padded completions, one truncated and masked as
  mask_truncated_completions masks it) against `policy_loss` on the same model's logits, for
  every loss type, β 0 and 0.04 (the KL weighted by the ratio, TRL's default
  use_bias_correction_kl, or not), num_iterations 1 (no old log-probabilities) and 2 (old ones
  off the current ones, so that both sides clip): the loss, the log-probabilities and entropies
  (temperature 0.7), and every metric TRL logs (kl, entropy, clip_ratio/*);
- the gradient on the model's parameters, for grpo and dapo with β > 0, on- and off-policy.

The trainer has gradient_accumulation_steps = ACCUMULATION, so TRL's current accumulation and
its steps_per_generation (which defaults to it) are both ACCUMULATION: TRL divides grpo's,
bnpo's and dr_grpo's loss by it, not dapo's, whose normaliser num_items_in_batch spans the
generation batch; dplaunch's engine divides every loss by the accumulation and its dapo caller
multiplies by it, with dapo_tokens = num_items_in_batch ÷ ranks (one rank here)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

from dplaunch.train.grpo_loss import (  # noqa: E402
    LOSS_TYPES,
    TRL_ONLY_LOSSES,
    LossSettings,
    group_advantages,
    grpo_metrics,
    policy_loss,
    token_logps_and_entropy,
)
from tests.chat_tokenizers import bpe_tokenizer  # noqa: E402

QWEN_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
TINY_QWEN = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip
NUM_GENERATIONS = 4
ACCUMULATION = 2
TEMPERATURE = 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28
MAX_COMPLETION_LENGTH = 8  # above the batch's longest: dr_grpo divides by the setting
PROMPT_LENGTH = 5
# the completions' tokens, the last one truncated (no EOS, the batch's full length)
COMPLETION_LENGTHS = (6, 3, 5, 1, 4, 6)
TRUNCATED = 5
ADVANTAGES = (-1.2, 0.7, 0.4, -1.1, -0.9, 0.3)

N = math.nan
# rewards of 4 prompts × 4 completions by 3 functions (NaN: the function returned None)
REWARDS = [
    [1.0, 0.2, 0.0], [0.0, 0.9, 1.0], [0.5, 0.5, 0.25], [1.0, 0.0, 0.5],
    # one unscorable row; other rows scored by some functions only
    [1.0, N, 0.0], [N, N, N], [N, 0.4, N], [0.0, 1.0, N],
    # equal weighted rewards: std 0
    [1.0, N, 0.0], [1.0, N, 0.0], [1.0, N, 0.0], [1.0, N, 0.0],
    # one scorable row only: no std in its group
    [N, N, N], [0.3, N, 1.0], [N, N, N], [N, N, N],
]  # fmt: skip
WEIGHTS = (1.0, 0.5, -2.0)


def _reward(column: int):
    """A reward function reading REWARDS' COLUMN, the row named by the completion's text."""

    def reward(prompts: list, completions: list[str], **_: Any) -> list[float | None]:
        values = [REWARDS[int(text.split()[-1])][column] for text in completions]
        return [None if math.isnan(value) else value for value in values]

    reward.__name__ = f"reward_{column}"
    return reward


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    logging.getLogger("trl").setLevel(logging.ERROR)
    tokenizer = bpe_tokenizer(list(QWEN_SPECIAL.values()), QWEN_SPECIAL)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), **TINY_QWEN))
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")),
        report_to=[],
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        per_device_train_batch_size=NUM_GENERATIONS,
        gradient_accumulation_steps=ACCUMULATION,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        beta=0.0,  # β is set per test: with β > 0 TRL would load a reference model by name
        reward_weights=list(WEIGHTS),
    )
    built = GRPOTrainer(
        model=model,
        reward_funcs=[_reward(column) for column in range(len(WEIGHTS))],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hello"}] * NUM_GENERATIONS),
        processing_class=tokenizer,
    )
    built.model.train()  # TRL logs under "train" when its model trains
    # set by Trainer's loop, which does not run here
    built.current_gradient_accumulation_steps = ACCUMULATION
    assert built.args.steps_per_generation == ACCUMULATION
    return built


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_are_trls(trainer, monkeypatch, scale_rewards):
    tokenizer = trainer.processing_class
    rows = len(REWARDS)
    prompt = tokenizer("the film was great").input_ids
    answer = tokenizer(" positive").input_ids + [tokenizer.eos_token_id]

    def generate(prompts: list) -> tuple:
        assert len(prompts) == rows
        texts = [f"answer {row}" for row in range(rows)]
        return [prompt] * rows, [answer] * rows, None, texts, None, {}, None, None

    monkeypatch.setattr(trainer, "_generate", generate)
    monkeypatch.setattr(trainer, "scale_rewards", scale_rewards)
    trainer._metrics["train"].clear()
    theirs = trainer._generate_and_score_completions([{"prompt": "hello"}] * rows)

    ours = group_advantages(
        torch.tensor(REWARDS), torch.tensor(WEIGHTS), NUM_GENERATIONS, scale_rewards
    )
    torch.testing.assert_close(ours.advantages, theirs["advantages"], atol=1e-6, rtol=0)
    logged = trainer._metrics["train"]
    assert ours.rewards.nanmean().item() == pytest.approx(logged["reward"][-1], abs=1e-6)
    assert ours.std_zero.float().mean().item() == logged["frac_reward_zero_std"][-1]
    # the cases the table was built for
    assert ours.advantages[5] == 0 and math.isnan(ours.rewards[5])  # unscorable
    assert (ours.advantages[8:12] == 0).all()
    assert ours.std_zero[8:12].all() == (scale_rewards != "batch")  # batch: the batch's std
    assert ours.advantages[12:].abs().max() == 0
    assert (ours.advantages[:4] != 0).all()


@pytest.fixture(scope="module")
def batch(trainer) -> dict[str, torch.Tensor]:
    """A micro-batch as TRL's _compute_loss takes it (before old and reference log-probs)."""
    tokenizer = trainer.processing_class
    generator = torch.Generator().manual_seed(1)
    rows, width = len(COMPLETION_LENGTHS), max(COMPLETION_LENGTHS)
    # ordinary tokens only: below the EOS and padding tokens, added last
    words = torch.randint(
        0, tokenizer.eos_token_id, (rows, PROMPT_LENGTH + width), generator=generator
    )
    completion_ids = torch.full((rows, width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(COMPLETION_LENGTHS):
        completion_ids[row, :length] = words[row, PROMPT_LENGTH : PROMPT_LENGTH + length]
        if row != TRUNCATED:  # ends with EOS; the truncated one is masked whole
            completion_ids[row, length - 1] = tokenizer.eos_token_id
            completion_mask[row, :length] = 1
    return {
        "prompt_ids": words[:, :PROMPT_LENGTH],
        "prompt_mask": torch.ones(rows, PROMPT_LENGTH, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        # as if the step had other micro-batches: dapo divides by the step's tokens
        "num_items_in_batch": completion_mask.sum() + 13,
    }


def _trl_logps(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, entropy, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, batch["completion_ids"].size(1), compute_entropy=True
    )
    return logps, entropy


def _trl_inputs(trainer, batch, beta: float, num_iterations: int) -> dict[str, torch.Tensor]:
    """BATCH with old log-probabilities off the current ones (num_iterations 2) and a reference's
    (β > 0), zero off the completions' tokens as TRL's are."""
    inputs = dict(batch)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        current = _trl_logps(trainer, batch)[0]
    mask = batch["completion_mask"]
    if num_iterations > 1:
        noise = torch.randn(current.shape, generator=generator)
        inputs["old_per_token_logps"] = (current + 0.5 * noise) * mask
    if beta:
        noise = torch.randn(current.shape, generator=generator)
        inputs["ref_per_token_logps"] = (current + 0.2 * noise) * mask
    return inputs


def _ours(trainer, inputs, loss_type: str, beta: float, correction: bool = True):
    """(dplaunch's loss as the engine backpropagates it, its LossTerms, logps, entropy) on
    dplaunch's layout: prompt then completion, right-padded, per-token tensors on the shifted
    targets."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    lengths = torch.tensor(COMPLETION_LENGTHS)
    width = inputs["completion_ids"].size(1)
    # the real tokens attended, the truncated completion's too: its targets are masked anyway
    attention = torch.cat(
        [inputs["prompt_mask"], (torch.arange(width) < lengths[:, None]).long()], dim=1
    )
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logps, entropy = token_logps_and_entropy(logits, ids[:, 1:], TEMPERATURE)

    def shifted(values: torch.Tensor) -> torch.Tensor:
        # the prompt's targets (its tokens after the first) come first
        return torch.cat([values.new_zeros(len(values), PROMPT_LENGTH - 1), values], dim=1)

    old, ref = inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps")
    loss, terms = policy_loss(
        logps,
        None if old is None else shifted(old),
        None if ref is None else shifted(ref),
        inputs["advantages"],
        shifted(inputs["completion_mask"].float()),
        entropy=entropy,
        settings=LossSettings(
            loss_type, EPSILON, EPSILON_HIGH, beta, MAX_COMPLETION_LENGTH, correction
        ),
        dapo_tokens=inputs["num_items_in_batch"] / 1,  # ÷ the ranks
    )
    if loss_type == "dapo":  # its caller's share: the engine divides by the accumulation
        loss = loss * ACCUMULATION
    return loss / ACCUMULATION, terms, logps, entropy


def _configure(trainer, monkeypatch, loss_type: str, beta: float, correction: bool = True) -> None:
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "beta", beta)
    monkeypatch.setattr(trainer.args, "use_bias_correction_kl", correction)
    trainer._metrics["train"].clear()


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize(("beta", "correction"), [(0.0, True), (0.04, True), (0.04, False)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_metrics_are_trls(
    trainer, batch, monkeypatch, loss_type, beta, correction, num_iterations
):
    inputs = _trl_inputs(trainer, batch, beta, num_iterations)
    _configure(trainer, monkeypatch, loss_type, beta, correction)
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, inputs)
        logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        ours, terms, logps, entropy = _ours(trainer, inputs, loss_type, beta, correction)

    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    mask = batch["completion_mask"].bool()
    their_logps, their_entropy = _trl_logps(trainer, batch)
    completion = slice(PROMPT_LENGTH - 1, None)
    torch.testing.assert_close(logps[:, completion][mask], their_logps[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[:, completion][mask], their_entropy[mask], atol=1e-5, rtol=0)

    metrics = grpo_metrics(terms.sums(), terms.extremes(), beta=beta)
    assert set(metrics) == set(logged)
    for key, value in logged.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key
    if num_iterations > 1:  # the ratios left the clip range on both sides
        assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0
    else:
        assert logged["clip_ratio/region_mean"] == 0


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gradients_are_trls(trainer, batch, monkeypatch, loss_type, num_iterations):
    # β > 0 with the KL weighted by the ratio, whose gradient counts even on-policy
    inputs = _trl_inputs(trainer, batch, beta=0.04, num_iterations=num_iterations)
    _configure(trainer, monkeypatch, loss_type, 0.04)
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]

    def gradients(loss: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss, parameters, allow_unused=True))

    theirs = gradients(trainer._compute_loss(trainer.model, inputs))
    ours = gradients(_ours(trainer, inputs, loss_type, 0.04)[0])
    assert any(g is not None and g.abs().max() > 1e-4 for g in theirs)
    for mine, reference in zip(ours, theirs, strict=True):
        if reference is None:
            assert mine is None or mine.abs().max() == 0
        else:
            torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)


def test_trl_only_losses_are_refused():
    from trl import GRPOConfig

    # TRL 1.16 has every one of them
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert all(f"'{name}'" in help_text for name in (*LOSS_TYPES, *TRL_ONLY_LOSSES))
    logps = torch.zeros(1, 2)
    for loss_type in TRL_ONLY_LOSSES:
        with pytest.raises(ValueError, match="loss_type"):
            policy_loss(
                logps, None, None, torch.ones(1), torch.ones(1, 2), entropy=logps,
                settings=LossSettings(loss_type, 0.2),
            )  # fmt: skip
