"""GRPO (model.task: grpo) in the ranks, its maths only: the advantages of a step's rewards,
each completion token's log-probability and entropy, the clipped policy loss and the sums
behind the metrics TRL users read; as TRL 1.16's GRPOTrainer computes them (token level, tested
against it in tests/test_grpo_loss.py).

A micro-batch's row is one completion: its prompt's tokens then its own, right-padded, so that
positions stay natural. Per-token tensors are aligned with the shifted targets
(``input_ids[:, 1:]``), shape [n, L−1]; the mask is 1 where the target is a trained completion
token (up to and including its EOS; 0 on the prompt, on padding, and on a whole truncated
completion with ``mask_truncated_completions``).

Advantages (``group_advantages``; TRL's ``sum_then_normalize``). The batch holds B = P·G
completions, prompt-major (completion j of prompt p at row p·G + j), rewarded by F functions, a
function's NaN standing for its None. The reward r is the weighted sum of a row's rewards over
the functions that scored it, NaN where none did (unscorable). With the means and standard
deviations taken over the scored rows only (NaN-aware; the standard deviation with Bessel's
correction, NaN under two values):

- ``group``: A = (r − mean of its group) / (std of its group + 10⁻⁴);
- ``batch``: A = (r − mean of its group) / (std of the whole batch + 10⁻⁴);
- ``none`` (Dr. GRPO): A = r − mean of its group;

and A = 0 wherever it is NaN: an unscorable row, and every row of a group with a single scored
completion under ``group`` (its std is NaN). ``std_zero`` marks the rows whose std (the group's
under ``group`` and ``none``, the batch's under ``batch``) is 0 (TRL's frac_reward_zero_std).
The batch is the whole step's, every rank's completions: each rank gathers the rewards, computes
every advantage, and keeps its own rows, as TRL does.

The loss (``policy_loss``), per token t of completion i, with ρ = exp(log π − log π_old) (π_old:
the policy at generation; with num_iterations 1 it is the policy itself, ρ = 1 with ρ's
gradient), ε_low = epsilon, ε_high = epsilon_high (unset: epsilon):

    ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) + β·ρ·KL,
    KL = exp(log π_ref − log π) − (log π_ref − log π) − 1   (Schulman's k3, ≥ 0; with β > 0),

and the micro-batch's loss, by loss_type, summing over its trained tokens (m the mask):

- ``grpo``: the mean over its rows of each row's token mean Σ_t m·ℓ / max(Σ_t m, 1);
- ``bnpo``: Σ m·ℓ / max(Σ m, 1), a token mean over the micro-batch;
- ``dr_grpo``: Σ m·ℓ / (rows × max_completion_length);
- ``dapo``: Σ m·ℓ / dapo_tokens, with dapo_tokens the trained tokens of the whole step (every
  micro-batch of every rank) divided by the ranks, so that the step's gradient (the ranks'
  averaged) is that of one token mean over it.

The KL is weighted by ρ (TRL 1.16's default use_bias_correction_kl, DeepSeek-V3.2's unbiased
reverse-KL gradient: tokens sampled from π_old estimate a KL of π) unless
``kl_bias_correction`` is off; ρ keeps its gradient there, so the KL's gradient changes even
on-policy, where ρ = 1. The logged kl is the weighted one, as TRL logs it.

TRL divides grpo's, bnpo's and dr_grpo's values by the gradient accumulation itself, and not
dapo's (whose normaliser already spans the step); dplaunch's engine divides every loss by the
accumulation, so the caller multiplies dapo's by the accumulation steps (and passes the others
unchanged). TRL's dapo matches with its default steps_per_generation = accumulation steps.

The metrics (``LossTerms``, ``grpo_metrics``): TRL's kl (with β > 0), entropy and
clip_ratio/{low,high,region}_mean are token means over the trained tokens (low: ρ < 1 − ε_low
with A < 0; high: ρ > 1 + ε_high with A > 0: the tokens whose clipped term wins, without
gradient; region: either), so each micro-batch keeps detached sums and the token count, which
ranks and micro-batches add up; clip_ratio/low_min and clip_ratio/high_max are the lowest
(highest) row's token mean of low (high), reduced with a max. TRL logs each micro-batch's value
and averages them at its logging step; these are the step's own means (token-weighted), the
same with one micro-batch per step.

dplaunch does not compute TRL 1.16's newer losses (``TRL_ONLY_LOSSES``), importance sampling at
sequence level, the entropy bonus or mask, vLLM's importance-sampling correction, or
``normalize_then_sum``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]

LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo")
# TRL 1.16's newer GRPO losses, which dplaunch does not compute
TRL_ONLY_LOSSES: tuple[str, ...] = ("cispo", "sapo", "luspo", "vespo")
TRL_ONLY_REASON = (
    "is one of TRL 1.16's newer GRPO losses, which dplaunch does not compute: "
    "use dapo, grpo, dr_grpo or bnpo"
)

# added to the standard deviation before dividing (TRL's): a group of equal rewards gets 0
STD_EPSILON = 1e-4

# LossTerms.sums()'s order: the trained tokens, then each metric's masked sum
SUM_KEYS = (
    "tokens",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
)
# LossTerms.extremes()'s order, reduced with a max (the first negated)
EXTREME_KEYS = ("clip_ratio/low_min", "clip_ratio/high_max")


@dataclasses.dataclass(frozen=True)
class GroupRewards:
    """A batch's rewards and advantages, one per completion (row)."""

    advantages: torch.Tensor  # [B], 0 for unscorable rows
    rewards: torch.Tensor  # [B], the weighted sum; NaN where every function gave None
    std_zero: torch.Tensor  # [B] bool: the std the row is scaled by is 0


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the non-NaN VALUES (along DIM, or of all), with Bessel's
    correction; NaN where fewer than two are left."""
    present = ~torch.isnan(values)
    if dim is None:
        values, present, dim = values.reshape(-1), present.reshape(-1), 0
    count = present.sum(dim, keepdim=True)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    squares = torch.where(present, (values - mean) ** 2, torch.zeros_like(values)).sum(
        dim, keepdim=True
    )
    variance = squares / (count - 1).clamp(min=1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, math.nan))
    return variance.sqrt().squeeze(dim)


def group_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards,
) -> GroupRewards:
    """The advantage of each of the B completions (prompt-major, NUM_GENERATIONS per prompt)
    from REWARDS_PER_FUNC [B, F] (NaN: the function returned None) and the functions'
    WEIGHTS [F]; TRL 1.16's sum_then_normalize (see the module's docstring)."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards {scale_rewards!r}: expected group, batch or none")
    scores = rewards_per_func.float()
    size = scores.size(0)
    if size % num_generations:
        raise ValueError(f"{size} completions are not groups of {num_generations}")
    unscorable = torch.isnan(scores).all(dim=1)
    rewards = (scores * weights.to(scores).unsqueeze(0)).nansum(dim=1)
    # nansum would make an unscorable row's reward 0, a score it never got: NaN keeps it out of
    # its group's mean and std
    rewards = rewards.masked_fill(unscorable, math.nan)
    groups = rewards.view(-1, num_generations)
    baseline = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nan_std(rewards).expand(size) if size > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # "none" computes it too: std_zero reports it
        std = nan_std(groups, dim=1).repeat_interleave(num_generations)
    else:  # one completion per prompt (an evaluation's): nothing to scale by
        std = torch.zeros_like(rewards)
    advantages = rewards - baseline
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    # torch.isclose's default tolerance against 0 (TRL's test): |std| ≤ 1e-8; NaN is not zero
    std_zero = torch.isclose(std, torch.zeros_like(std))
    return GroupRewards(torch.nan_to_num(advantages, nan=0.0), rewards, std_zero)


def token_logps_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target [n, L−1], entropy of each next-token distribution
    [n, L−1]) under the sampling distribution, LOGITS [n, L−1, V] divided by TEMPERATURE (as
    the completions were sampled, and as TRL scores them), in fp32. The entropy is detached:
    it is a metric only."""
    log_probs = (logits.float() / temperature).log_softmax(dim=-1)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """One micro-batch's detached metric terms: masked sums over its trained tokens (added up
    over micro-batches and ranks) and each row's clip fractions (their extremes reduced with a
    max)."""

    tokens: torch.Tensor  # trained tokens: every sum's count
    kl: torch.Tensor  # Σ m·KL (0 with β = 0)
    entropy: torch.Tensor
    low: torch.Tensor  # Σ m·[ρ < 1 − ε_low and A < 0]
    high: torch.Tensor  # Σ m·[ρ > 1 + ε_high and A > 0]
    region: torch.Tensor  # Σ m·[low or high]
    row_low: torch.Tensor  # [n] each row's token mean of low; NaN for a row with no token
    row_high: torch.Tensor  # [n]

    def sums(self) -> torch.Tensor:
        """SUM_KEYS' values, one flat fp32 tensor to add up over micro-batches and ranks."""
        return torch.stack(
            [self.tokens, self.kl, self.entropy, self.low, self.high, self.region]
        ).float()

    def extremes(self) -> torch.Tensor:
        """(−lowest row low fraction, highest row high fraction) over the rows with trained
        tokens (−inf without any), one flat fp32 tensor to reduce with a max."""
        low = torch.nan_to_num(self.row_low.float(), nan=math.inf)
        high = torch.nan_to_num(self.row_high.float(), nan=-math.inf)
        lowest = low.min() if low.numel() else low.new_tensor(math.inf)
        highest = high.max() if high.numel() else high.new_tensor(-math.inf)
        return torch.stack([-lowest, highest])


def grpo_metrics(sums: torch.Tensor, extremes: torch.Tensor, *, beta: float) -> dict[str, float]:
    """TRL's names and values of the metrics from SUMS (LossTerms.sums() added up) and EXTREMES
    (LossTerms.extremes() maxed); kl only with BETA > 0, as TRL logs it. A clip extreme over no
    row is NaN (TRL's nanmin of nothing)."""
    values = [float(value) for value in sums]
    tokens = max(values[0], 1.0)  # TRL's: a step without trained tokens logs 0
    metrics = {key: value / tokens for key, value in zip(SUM_KEYS[1:], values[1:], strict=True)}
    if beta == 0:
        del metrics["kl"]
    lowest, highest = -float(extremes[0]), float(extremes[1])
    metrics["clip_ratio/low_min"] = lowest if math.isfinite(lowest) else math.nan
    metrics["clip_ratio/high_max"] = highest if math.isfinite(highest) else math.nan
    return metrics


def _row_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean of VALUES over its trained tokens; NaN for a row without any."""
    return (values * mask).sum(-1) / mask.sum(-1)


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """train.grpo's keys the loss reads (LossSettings.of(config.train.grpo))."""

    loss_type: LossType
    epsilon: float
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    # weigh the KL by the probability ratio (TRL's use_bias_correction_kl, on by default)
    kl_bias_correction: bool = True

    @classmethod
    def of(cls, settings: Any) -> LossSettings:
        return cls(
            settings.loss_type,
            settings.epsilon,
            settings.epsilon_high,
            settings.beta,
            settings.max_completion_length,
            settings.kl_bias_correction,
        )


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor,
    settings: LossSettings,
    dapo_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossTerms]:
    """A micro-batch's GRPO loss (before dplaunch's engine divides it by the accumulation: dapo's
    caller multiplies it by the accumulation steps first) and its metric terms, from the
    policy's LOGPS [n, L−1], the log-probabilities at generation OLD_LOGPS (None with
    num_iterations 1: the policy's own, detached), the reference's REF_LOGPS (used with
    beta > 0), the rows' ADVANTAGES [n], the trained tokens' MASK [n, L−1] and the tokens'
    ENTROPY (for the metric), under SETTINGS; see the module's docstring."""
    loss_type, epsilon, epsilon_high = settings.loss_type, settings.epsilon, settings.epsilon_high
    beta, max_completion_length = settings.beta, settings.max_completion_length
    kl_bias_correction = settings.kl_bias_correction
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPO loss_type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    low_bound = 1 - epsilon
    high_bound = 1 + (epsilon if epsilon_high is None else epsilon_high)
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    # off the trained tokens the buffers hold anything (TRL's zeros, a prompt's values): the
    # ratio is 1 and the KL 0 there, so no inf meets the mask, in the loss or its gradient
    ratio = torch.exp((logps - old) * mask)
    advantage = advantages.to(logps.dtype).unsqueeze(1)
    clipped = ratio.clamp(low_bound, high_bound)
    per_token = -torch.minimum(ratio * advantage, clipped * advantage)
    kl = torch.zeros_like(logps)
    if beta != 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        gap = (ref_logps - logps) * mask
        kl = torch.exp(gap) - gap - 1
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    masked = per_token * mask
    # (the loss type grpo is the last branch: tests/test_layout.py keeps comparisons with the
    # task's name, also grpo, inside dplaunch/tasks/)
    if loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        loss = masked.sum() / (logps.size(0) * max_completion_length)
    elif loss_type == "dapo":
        if dapo_tokens is None:
            raise ValueError("dapo needs dapo_tokens: the step's trained tokens ÷ the ranks")
        loss = masked.sum() / dapo_tokens
    else:  # grpo: each completion's token mean, then their mean
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    with torch.no_grad():
        low = ((ratio < low_bound) & (advantage < 0)).to(mask.dtype)
        high = ((ratio > high_bound) & (advantage > 0)).to(mask.dtype)
        region = torch.maximum(low, high)
        terms = LossTerms(
            tokens=mask.sum(),
            kl=(kl * mask).sum(),
            entropy=(entropy.to(mask.dtype) * mask).sum(),
            low=(low * mask).sum(),
            high=(high * mask).sum(),
            region=(region * mask).sum(),
            row_low=_row_means(low, mask),
            row_high=_row_means(high, mask),
        )
    return loss, terms
