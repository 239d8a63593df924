"""Online RL (model.task: grpo) in the ranks: the prompts of each step, their completions
sampled and scored, the advantages, and the loss on the completions' tokens (TRL 1.16's
GRPOTrainer; tasks/grpo.py names this module as the task's objective).

One step trains train.global_batch_size completions: P = global ÷ num_generations prompts, each
sampled num_generations times. Completion j of the step's prompt p is number k = p·G + j; the
data-parallel rank r trains the completions r·B/dp … (r+1)·B/dp − 1 (TRL's process slice), and
samples them itself (train/generation.py: seeded by the prompt's global index in the run and j,
so any layout draws the same). Each rank scores its completions, the rewards of all are
gathered (a group may be split between ranks), the advantages computed on every rank alike
(train/grpo_loss.py), and the rank's completions cut into its micro-batches: one row each, the
prompt's tokens then the completion's, right-padded, with the completion's trained tokens in
``mask``. With train.grpo.num_iterations μ > 1, the same completions train μ optimizer steps, the
ratio against their log-probabilities at generation (``old_logps``); with beta > 0 the
reference's log-probabilities (``ref_logps``) come from a frozen copy of the starting weights
built as dpo's (train/preference.py), or the policy with its adapters off under LoRA.

A checkpoint inside a batch's μ steps keeps that batch (ROLLOUT_FILE, one per rank), so that a
resumed run trains the very completions and ratios a straight run does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dplaunch.config.schema import GrpoConfig, RunConfig
from dplaunch.planning.plan import Plan
from dplaunch.tasks.grpo_rewards import RewardError, check_rewards, combine, score
from dplaunch.train.chunked_loss import ChunkedHead
from dplaunch.train.data import Batcher, Sharding
from dplaunch.train.generation import EngineSampler, Sampler, Sampling, completion_seed
from dplaunch.train.grpo_loss import (
    LossSettings,
    group_advantages,
    grpo_metrics,
    nan_std,
    policy_loss,
    token_logps_and_entropy,
)
from dplaunch.train.objective import Objective
from dplaunch.train.preference import log_prob_chunks

# a rank's batch of completions kept in a checkpoint taken inside its num_iterations steps
ROLLOUT_FILE = "grpo-rollout-rank{rank}.pt"
# the prompt column the reward functions receive as `prompts` (TRL's)
PROMPT = "prompt"
# the columns of a tokenised prompt row that are dplaunch's, not the record's
OWN_COLUMNS = ("input_ids",)


class PromptBatcher(Batcher):
    """The prompts of each step: P = global batch ÷ num_generations rows of the dataset, in the
    seeded epoch order, the same on every rank (each rank samples its share of their
    completions); a batch of prompts serves num_iterations steps."""

    def __init__(self, dataset: Any, sharding: Sharding, *, settings: GrpoConfig, **kwargs: Any):
        super().__init__(dataset, sharding, **kwargs)
        self.group = settings.num_generations
        self.iterations = settings.num_iterations
        self.prompts_per_step = sharding.global_batch_size // self.group
        self.rounds_per_epoch = len(dataset) // self.prompts_per_step
        self.steps_per_epoch = self.rounds_per_epoch * self.iterations
        # set by start_grpo: keeps a batch in a checkpoint taken inside its num_iterations steps
        self.keep_rollout: Any = None

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The step's prompts: one entry, {round, rows}: the batch of prompts' number in the run
        and their dataset rows."""
        round_ = step // self.iterations
        epoch, in_epoch = divmod(round_, self.rounds_per_epoch)
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, self.epoch_order(epoch)
        start = in_epoch * self.prompts_per_step
        rows = self._order[start : start + self.prompts_per_step]
        return [{"round": torch.tensor(round_), "rows": torch.from_numpy(np.asarray(rows))}]

    def save_position(self, checkpoint: Path) -> None:
        if self.keep_rollout is not None:
            self.keep_rollout(checkpoint)


@dataclass
class Rollout:
    """One batch of prompts' completions on this rank: its micro-batches (kept on the host),
    the metrics of the whole batch, and a few completions to log."""

    round: int
    micro_batches: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]
    shown: list[dict[str, Any]] = field(default_factory=list)


class GrpoObjective(Objective):
    """The rollout of each step, the loss of its micro-batches, and the metrics since the last
    log line."""

    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        accelerator: Any,
        engine: Any,
        batcher: PromptBatcher,
        sampler: Sampler,
        reference: Any,
    ):
        self.settings = settings = config.train.grpo
        assert settings is not None
        self.config, self.plan, self.engine = config, plan, engine
        self.accelerator, self.tokenizer = accelerator, sampler.tokenizer
        self.batcher, self.sampler, self.reference = batcher, sampler, reference
        self.rank = self.accelerator.process_index
        self.loss_settings = LossSettings.of(settings)
        # train.loss_chunk: the completions' log-probabilities a chunk of tokens at a time
        self.chunked = log_prob_chunks(accelerator.unwrap_model(engine.model), config, plan)
        self.functions = check_rewards(settings.rewards, settings.reward_weights, None, Path.cwd())
        self.weights = settings.reward_weights or [1.0] * len(self.functions)
        self.current: Rollout | None = None
        self.loss_totals: torch.Tensor | None = None
        self.loss_extremes: torch.Tensor | None = None
        self.rollout_metrics: list[dict[str, float]] = []
        self.shown: list[dict[str, Any]] = []
        self.generation_s = 0.0

    # --- the step's completions ---------------------------------------------------------------

    def rollout(self, step: int, prompts: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """The step's micro-batches of completions: sampled, scored and prepared at the first
        of its batch's num_iterations steps (or read from a resumed checkpoint), reused after."""
        (entry,) = prompts
        round_ = int(entry["round"])
        if self.current is None or self.current.round != round_:
            started = time.perf_counter()
            self.current = self._roll(round_, entry["rows"].tolist(), step)
            self.generation_s += time.perf_counter() - started
            self.rollout_metrics.append(self.current.metrics)
            self.shown = self.current.shown
        return [dict(batch) for batch in self.current.micro_batches]

    def _slice(self) -> tuple[int, int]:
        """This rank's completions of a step: numbers [first, end)."""
        share = self.plan.global_batch_size // self.plan.data_parallel_size
        first = self.accelerator.process_index * share
        return first, first + share

    def _roll(self, round_: int, rows: list[int], step: int) -> Rollout:
        group, seed = self.settings.num_generations, self.config.train.seed
        first, end = self._slice()
        groups = range(first // group, (end - 1) // group + 1)
        dataset = self.batcher.dataset
        records = {p: dataset[int(rows[p])] for p in groups}
        completions: dict[int, list[int]] = {}
        for p in groups:
            prompt_index = round_ * self.batcher.prompts_per_step + p
            seeds = [completion_seed(seed, prompt_index, j) for j in range(group)]
            for j, ids in enumerate(self.sampler.generate(records[p]["input_ids"], seeds)):
                completions[p * group + j] = ids
        self._idle_in_step(len(groups), records[groups[0]]["input_ids"])
        mine = list(range(first, end))
        texts = [self._text(completions[k], records[k // group]) for k in mine]
        prompt_values = [records[k // group][PROMPT] for k in mine]
        columns = {
            name: [records[k // group][name] for k in mine]
            for name in records[groups[0]]
            if name not in (PROMPT, *OWN_COLUMNS)
        }
        try:
            local = score(self.functions, self.weights, prompt_values, texts, columns, step + 1)
        except RewardError as error:
            raise RewardFailure(str(error)) from None
        per_func = torch.tensor(local, dtype=torch.float32).T.contiguous()  # [mine, functions]
        gathered = self.accelerator.gather(per_func.to(self.accelerator.device)).cpu()
        scored = group_advantages(
            gathered,
            torch.tensor(self.weights, dtype=torch.float32),
            group,
            self.settings.scale_rewards,
        )
        advantages = scored.advantages[first:end]
        rows_of = [self._row(records[k // group]["input_ids"], completions[k]) for k in mine]
        batches = self._micro_batches(rows_of, advantages)
        metrics = self._rollout_metrics(gathered, scored, rows_of)
        shown = [
            {"prompt": records[k // group][PROMPT], "completion": texts[i],
             "reward": float(scored.rewards[k])}
            for i, k in enumerate(mine[: self.settings.log_completions])
        ]  # fmt: skip
        return Rollout(round_, batches, metrics, shown)

    def _idle_in_step(self, groups: int, prompt_ids: list[int]) -> None:
        """Where the ranks generate in step, a rank with fewer prompts' groups than another runs
        idle batches until every rank has run as many."""
        if not self.plan.forwards_are_collective:
            return
        count = torch.tensor([float(groups)], device=self.accelerator.device)
        most = int(self.accelerator.reduce(count, reduction="max"))
        for _ in range(most - groups):
            self.sampler.idle(prompt_ids, self.settings.num_generations)

    def _text(self, ids: list[int], record: dict[str, Any]) -> Any:
        """The completion as the reward functions see it: its text (special tokens skipped),
        as one assistant message when the prompt is a conversation (TRL's)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(record[PROMPT], list):
            return [{"role": "assistant", "content": text}]
        return text

    def _row(self, prompt: list[int], completion: list[int]) -> tuple[list[int], int, int, bool]:
        """(prompt + completion ids, prompt length, completion length, truncated: no EOS)."""
        eos = set(eos_ids(self.tokenizer))
        truncated = not completion or completion[-1] not in eos
        return [*prompt, *completion], len(prompt), len(completion), truncated

    def _micro_batches(
        self, rows: list[tuple[list[int], int, int, bool]], advantages: torch.Tensor
    ) -> list[dict[str, torch.Tensor]]:
        micro, pad = self.plan.micro_batch_size, self.tokenizer.pad_token_id or 0
        masked = self.settings.mask_truncated_completions
        batches = []
        for start in range(0, len(rows), micro):
            chunk = rows[start : start + micro]
            width = max(len(ids) for ids, *_ in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width - 1), dtype=torch.float32)
            for i, (ids, prompt, completion, truncated) in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.tensor(ids)
                attention[i, : len(ids)] = 1
                if not (masked and truncated):
                    # target t is input t + 1: the completion's tokens are targets prompt−1 …
                    mask[i, prompt - 1 : prompt - 1 + completion] = 1.0
            batches.append(
                {
                    "input_ids": input_ids,
                    "attention_mask": attention,
                    "mask": mask,
                    "advantages": advantages[start : start + micro].clone(),
                }
            )
        self._add_logps(batches)
        return batches

    def _add_logps(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """The log-probabilities a batch's loss compares with, computed now: the policy's at
        generation (num_iterations > 1) and the reference's (beta > 0); and dapo's token count
        of the whole step over every rank."""
        device = self.accelerator.device
        policy = self.accelerator.unwrap_model(self.engine.model)
        for batch in batches:
            on_device = {k: v.to(device) for k, v in batch.items()}
            if self.settings.num_iterations > 1:
                batch["old_logps"] = self._logps(policy, on_device, self.chunked).cpu()
            if self.reference is not None:
                batch["ref_logps"] = self.reference.run(
                    policy, lambda module, chunked, b=on_device: self._logps(module, b, chunked)
                ).cpu()
        tokens = sum(float(batch["mask"].sum()) for batch in batches)
        total = self.accelerator.reduce(torch.tensor([tokens], device=device), reduction="sum")
        per_rank = float(total) / self.plan.world_size
        for batch in batches:
            batch["dapo_tokens"] = torch.tensor(per_rank)

    @torch.no_grad()
    def _logps(
        self, model: Any, batch: dict[str, torch.Tensor], chunked: ChunkedHead | None
    ) -> torch.Tensor:
        """MODEL's log-probability of each next token of BATCH, without gradients; with CHUNKED
        (MODEL's ChunkedHead: train.loss_chunk) the head a chunk of tokens at a time."""
        targets = batch["input_ids"][:, 1:]
        temperature = self.settings.temperature
        was_training = model.training
        model.eval()
        try:
            if chunked is not None:
                return chunked(
                    model,
                    batch,
                    targets,
                    lambda logits, y: token_logps_and_entropy(logits, y, temperature)[0],
                )
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits[:, :-1]
        finally:
            model.train(was_training)
        return token_logps_and_entropy(logits, targets, temperature)[0]

    def _rollout_metrics(
        self, per_func: torch.Tensor, scored: Any, rows: list[tuple[list[int], int, int, bool]]
    ) -> dict[str, float]:
        """The batch's reward metrics (TRL's names: every rank has every reward) and its
        completions' lengths (this rank's: summed over the ranks at the log line)."""
        rewards = scored.rewards
        values = {
            "reward": float(torch.nanmean(rewards)),
            "reward_std": _nanstd(rewards),
            "frac_reward_zero_std": float(scored.std_zero.float().mean()),
        }
        for index, function in enumerate(self.functions):
            column = per_func[:, index]
            values[f"rewards/{function.name}/mean"] = float(torch.nanmean(column))
            values[f"rewards/{function.name}/std"] = _nanstd(column)
        lengths = torch.tensor([float(c) for _, _, c, _ in rows])
        truncated = torch.tensor([float(t) for *_, t in rows])
        values["_length_sum"] = float(lengths.sum())
        values["_clipped_sum"] = float(truncated.sum())
        values["_completions"] = float(len(rows))
        return values

    # --- the loss -----------------------------------------------------------------------------

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A micro-batch's loss, as TRL's before its division by the accumulation (dplaunch's
        engines divide by it; dapo, normalised by the whole step's tokens, is scaled back)."""
        settings = self.settings
        targets = batch["input_ids"][:, 1:]
        if self.chunked is not None:  # train.loss_chunk: no full logits
            logps, entropy = self.chunked(
                model,
                batch,
                targets,
                lambda logits, y: token_logps_and_entropy(logits, y, settings.temperature),
            )
        else:
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).logits[:, :-1]
            logps, entropy = token_logps_and_entropy(logits, targets, settings.temperature)
        loss, terms = policy_loss(
            logps,
            batch.get("old_logps"),
            batch.get("ref_logps"),
            batch["advantages"],
            batch["mask"],
            entropy=entropy,
            settings=self.loss_settings,
            dapo_tokens=float(batch["dapo_tokens"]),
        )
        if settings.loss_type == "dapo":
            loss = loss * self.plan.gradient_accumulation_steps
        sums, extremes = terms.sums(), terms.extremes()
        if self.loss_totals is None:
            self.loss_totals, self.loss_extremes = sums, extremes
        else:
            self.loss_totals = self.loss_totals + sums
            self.loss_extremes = torch.maximum(self.loss_extremes, extremes)
        return loss

    def log_record(self, reduce: Any) -> dict[str, float]:
        """The metrics since the last log line (TRL's names), over every rank."""
        record: dict[str, float] = {}
        if self.loss_totals is not None:
            extremes = self.accelerator.reduce(self.loss_extremes, reduction="max")
            record.update(grpo_metrics(reduce(self.loss_totals), extremes, beta=self.settings.beta))
            self.loss_totals = None
        if self.rollout_metrics:
            rounds, self.rollout_metrics = self.rollout_metrics, []
            device = self.accelerator.device
            counts = torch.tensor(
                [
                    sum(r[k] for r in rounds)
                    for k in ("_length_sum", "_clipped_sum", "_completions")
                ],
                device=device,
            )
            length, clipped, completions = reduce(counts).tolist()
            record["completions/mean_length"] = length / max(completions, 1.0)
            record["completions/clipped_ratio"] = clipped / max(completions, 1.0)
            for key in rounds[0]:
                if not key.startswith("_"):
                    record[key] = sum(r[key] for r in rounds) / len(rounds)
        record["generation_s"] = round(self.generation_s, 4)
        self.generation_s = 0.0
        return record

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def eval_totals(self, batcher: Batcher) -> torch.Tensor:
        """(reward sum, completions, reward² sum) of this rank's share of an evaluation set's
        prompts: num_generations completions of each, seeded apart from training's."""
        group, seed = self.settings.num_generations, self.config.train.seed
        shard = batcher.sharding
        total = len(batcher.dataset)
        mine = list(range(shard.data_parallel_rank, total, shard.data_parallel_size))
        sums = torch.zeros(3)
        for index in mine:
            record = batcher.dataset[index]
            seeds = [completion_seed(seed, -1 - index, j) for j in range(group)]
            completions = self.sampler.generate(record["input_ids"], seeds)
            texts = [self._text(ids, record) for ids in completions]
            columns = {
                name: [record[name]] * group
                for name in record
                if name not in (PROMPT, *OWN_COLUMNS)
            }
            per_func = score(
                self.functions, self.weights, [record[PROMPT]] * group, texts, columns, 0
            )
            rewards = torch.tensor(combine(per_func, self.weights), dtype=torch.float32)
            sums += torch.stack([rewards.sum(), torch.tensor(float(group)), (rewards**2).sum()])
        if total:  # ZeRO-3, FSDP2: a rank with one prompt fewer samples an idle batch
            self._idle_in_step(len(mine), batcher.dataset[0]["input_ids"])
        return sums.to(self.accelerator.device)

    # --- resume -------------------------------------------------------------------------------

    def keep(self, checkpoint: Path) -> None:
        """A checkpoint inside a batch's num_iterations steps keeps the batch (this rank's)."""
        if self.current is not None and self.settings.num_iterations > 1:
            torch.save(
                {"round": self.current.round, "micro_batches": self.current.micro_batches},
                checkpoint / ROLLOUT_FILE.format(rank=self.rank),
            )

    def restore(self, checkpoint: Path) -> None:
        """The kept batch of a resumed checkpoint, if it has one."""
        path = checkpoint / ROLLOUT_FILE.format(rank=self.rank)
        if path.is_file():
            kept = torch.load(path, weights_only=True)
            self.current = Rollout(kept["round"], kept["micro_batches"], {})


class RewardFailure(RuntimeError):
    """A reward function failed during the run (its one line names it and the step)."""


def _nanstd(values: torch.Tensor) -> float:
    """The logged spread of VALUES without their NaNs (0 where fewer than two are left)."""
    return float(torch.nan_to_num(nan_std(values), nan=0.0))


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a completion (a tokenizer may name several)."""
    eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()


def start_grpo(
    config: RunConfig,
    plan: Plan,
    accelerator: Any,
    engine: Any,
    run_dir: Path,
    tokenizer: Any,
    batchers: tuple[Any, ...],
    say: Any,
) -> tuple[GrpoObjective, dict[str, Any]]:
    """model.task grpo's objective (tasks/grpo.py names it), given to ENGINE: its sampler, its
    reference (beta > 0), and the kept batch of a resumed checkpoint."""
    from dplaunch.run_directory.files import read_resume
    from dplaunch.train.preference import reference_model

    settings = config.train.grpo
    assert settings is not None
    batcher = batchers[0]
    assert isinstance(batcher, PromptBatcher)
    reference, described = None, {"kind": "none (beta 0)"}
    if settings.beta > 0:
        reference, described = reference_model(
            config, plan, accelerator, engine, run_dir, tokenizer
        )
        say(f"[dplaunch] reference model: {described['kind']}")
    sampling = Sampling(
        settings.max_completion_length,
        settings.temperature,
        settings.top_p,
        settings.top_k,
        eos_ids(tokenizer),
    )
    synced = plan.forwards_are_collective
    autocast = accelerator.autocast if plan.engine == "ddp" else None
    sampler = EngineSampler(
        accelerator.unwrap_model(engine.model),
        accelerator.device,
        sampling,
        tokenizer,
        synced=synced,
        **({"autocast": autocast} if autocast is not None else {}),
    )
    objective = GrpoObjective(config, plan, accelerator, engine, batcher, sampler, reference)
    batcher.keep_rollout = objective.keep
    resume = read_resume(run_dir)
    if resume is not None:
        objective.restore(Path(resume["checkpoint"]))
    engine.objective = objective
    say(
        f"[dplaunch] grpo: {plan.global_batch_size // settings.num_generations} prompts × "
        f"{settings.num_generations} completions a step ({settings.loss_type} loss, "
        f"beta {settings.beta}, {', '.join(f.name for f in objective.functions)}); "
        + ("the ranks generate in step" if synced else "each rank generates its own share")
    )
    return objective, described
