"""`model.task: grpo`: online reinforcement learning with verifiable rewards (GRPO and its
variants Dr. GRPO, DAPO, BNPO, as TRL 1.16's GRPOTrainer): the policy samples
train.grpo.num_generations completions of each prompt in every rank, reward functions score
them, each completion's advantage is its reward against its group's, and the clipped policy
loss trains on the completions' tokens (docs/grpo.md). Its rank-side code: train/grpo.py (the
objective and the rollout), train/generation.py (seeded sampling), train/grpo_loss.py (the
maths); its reward functions: tasks/grpo_rewards.py."""

from __future__ import annotations

from dplaunch.tasks.base import Task

# data.max_length of a grpo run: the prompt's tokens (cut from the left beyond it, as TRL's
# max_prompt_length); the completion adds train.grpo.max_completion_length
PROMPT_MAX_LENGTH = 512

GRPO = Task(
    name="grpo",
    summary="online RL of a causal LM: sampled completions of prompts, scored by reward functions",
    examples=True,
    prompts=True,
    # the reference model (beta > 0) and the generation are built for data-parallel layouts
    model_parallel=False,
    packs_evaluation=False,
    eval_metrics=("reward", "reward_std"),
    keys=(
        "data.chat_template",
        "data.chat_template_kwargs",
        "data.tools",
        "data.format",
        "train.grpo",
    ),
    purpose="online RL (grpo)",
    max_length=PROMPT_MAX_LENGTH,
    objective="dplaunch.train.grpo:start_grpo",
)
