"""Preference tuning (model.task: dpo) in the ranks: each response's log-probability, the losses,
the metrics TRL users read, and the reference model.

A micro-batch holds its pairs' chosen rows, then their rejected rows (train/data.py), in one
forward of the policy. A response's log-probability is the sum over its trained tokens (labels,
found as sft finds an answer: data/preference.py). The losses, per pair, as TRL 1.16 computes
them (DPOTrainer for sigmoid and ipo, the experimental ORPOTrainer and CPOTrainer for orpo and
simpo), with c, r the policy's chosen and rejected log-probabilities, c₀, r₀ the reference's,
n the response's trained tokens and β = train.preference.beta:

- ``sigmoid`` (DPO): −log σ(β·Δ) with Δ = (c − c₀) − (r − r₀); label smoothing ε mixes in the
  flipped preference (conservative DPO): −(1 − ε)·log σ(β·Δ) − ε·log σ(−β·Δ);
- ``ipo``: ((c − c₀)/n_c − (r − r₀)/n_r − 1/(2β))² (TRL's per-token IPO);
- ``orpo``, reference-free: the chosen responses' NLL (a mean over their tokens in the global
  batch) − β·log σ(log odds(c/n_c) − log odds(r/n_r));
- ``simpo``, reference-free: −log σ(β·(c/n_c − r/n_r) − γ), with label smoothing as sigmoid's.

The rewards: β·(c − c₀) and β·(r − r₀) (β·c/n_c and β·r/n_r for the reference-free losses).

The reference model is built and sharded as the policy is (``build_reference``): a frozen copy
under DDP and ZeRO-1/2 (whole on every rank, as the policy's weights are), partitioned under
ZeRO-3 (a DeepSpeed inference engine over a model built under zero.Init) and under FSDP2
(``fully_shard`` on the same mesh); with LoRA the policy itself with its adapters disabled (no
second copy); with train.precompute_ref its log-probabilities computed once, before the first
step, by the policy itself, and kept beside the tokenised data (``precompute_reference``). It is
never saved: a resumed run builds it again from the run file (or reads the kept values).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from dplaunch.config.schema import PreferenceConfig, RunConfig
from dplaunch.data.example_tokens import IGNORE_INDEX
from dplaunch.data.preference import REFERENCE_COLUMNS
from dplaunch.planning.plan import Plan
from dplaunch.train.chunked_loss import ChunkedHead
from dplaunch.train.objective import Objective

# metrics.jsonl's keys (TRL's names), in the order of the objective's sums after the pair count
METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_KEYS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def response_logps(
    model: Any, batch: dict[str, torch.Tensor], chunked: ChunkedHead | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained tokens, their number), one forward; with
    CHUNKED (train.loss_chunk) the head a chunk of tokens at a time, no full logits."""
    labels = batch["labels"][:, 1:]
    trained = labels != IGNORE_INDEX
    targets = labels.clamp(min=0)
    if chunked is not None:
        per_token = chunked(model, batch, targets, target_logps)
    else:
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits[:, :-1]
        per_token = target_logps(logits, targets)
    return (per_token * trained).sum(-1), trained.sum(-1)


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The log-probability of each target under LOGITS, in fp32 (cross-entropy is the
    log-softmax and the gather in one kernel)."""
    return -F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view(targets.shape)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − eˣ) for x < 0, without cancellation on either side of −ln 2."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def _smoothed(margin: torch.Tensor, smoothing: float) -> torch.Tensor:
    """−log σ(margin), the preference flipped with probability SMOOTHING (conservative DPO)."""
    return -(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)


class PairTerms:
    """One micro-batch's per-pair losses, rewards and logged log-probabilities (and ORPO's
    NLL and log-odds terms)."""

    def __init__(
        self,
        settings: PreferenceConfig,
        logps: torch.Tensor,
        tokens: torch.Tensor,
        reference: torch.Tensor | None,
    ):
        beta, smoothing = settings.beta, settings.label_smoothing
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.clamp(min=1).chunk(2)
        self.nll = self.log_odds = None
        if settings.loss in ("sigmoid", "ipo"):
            assert reference is not None
            chosen_ratio, rejected_ratio = (logps - reference).chunk(2)
            if settings.loss == "sigmoid":
                self.losses = _smoothed(beta * (chosen_ratio - rejected_ratio), smoothing)
            else:
                per_token = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
                self.losses = (per_token - 1 / (2 * beta)) ** 2
            self.chosen_rewards, self.rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
            self.chosen_logps, self.rejected_logps = chosen, rejected
            return
        chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
        self.chosen_rewards, self.rejected_rewards = beta * chosen_mean, beta * rejected_mean
        self.chosen_logps, self.rejected_logps = chosen_mean, rejected_mean
        if settings.loss == "simpo":
            margin = beta * (chosen_mean - rejected_mean) - settings.simpo_gamma
            self.losses = _smoothed(margin, smoothing)
            return
        # orpo: the odds ratio of the mean token probabilities; the NLL is added per micro-batch
        self.log_odds = (chosen_mean - rejected_mean) - (
            _log1mexp(chosen_mean) - _log1mexp(rejected_mean)
        )
        self.losses = -beta * F.logsigmoid(self.log_odds)
        self.nll = -chosen.sum() / chosen_tokens.sum()

    @property
    def correct(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).float()

    def sums(self) -> list[torch.Tensor]:
        """The pairs, then the sum over them of each METRIC_KEYS value (and ORPO's)."""
        values = [
            torch.tensor(float(len(self.losses)), device=self.losses.device),
            self.chosen_rewards.sum(),
            self.rejected_rewards.sum(),
            self.correct.sum(),
            (self.chosen_rewards - self.rejected_rewards).sum(),
            self.chosen_logps.sum(),
            self.rejected_logps.sum(),
        ]
        if self.log_odds is not None:
            assert self.nll is not None
            pairs = len(self.losses)
            ratio = F.logsigmoid(self.log_odds)
            values += [self.nll * pairs, ratio.mean() * pairs, self.log_odds.mean() * pairs]
        return [value.detach().float() for value in values]


class Reference(Protocol):
    """Where a micro-batch's reference log-probabilities come from."""

    def logps(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed log-probability of each row's trained tokens under the reference."""

    def run(self, model: Any, function: Any) -> Any:
        """FUNCTION(the reference's module, its ChunkedHead or None) without gradients."""


class FrozenCopy:
    """A frozen copy of the policy's starting weights, built and sharded as the policy; with
    CHUNKED (train.loss_chunk, a ChunkedHead of the copy) its log-probabilities take the head a
    chunk of tokens at a time, as the policy's, so no forward of it builds the full logits."""

    def __init__(
        self,
        module: Any,
        autocast: Any = contextlib.nullcontext,
        chunked: ChunkedHead | None = None,
    ):
        self.module = module
        self.autocast = autocast
        self.chunked = chunked

    @torch.no_grad()
    def logps(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.run(model, lambda module, chunked: response_logps(module, batch, chunked)[0])

    @torch.no_grad()
    def run(self, model: Any, function: Any) -> Any:
        """FUNCTION(the reference's module, its ChunkedHead), in the run's precision (grpo's
        token log-probs)."""
        with self.autocast():
            return function(self.module, self.chunked)


class DisabledAdapters:
    """LoRA: the policy with its adapters (and modules_to_save copies) disabled, which is the
    base it started from: no second copy of the model."""

    def __init__(self, peft_model: Any, chunked: ChunkedHead | None = None):
        self.peft_model = peft_model
        # train.loss_chunk: a ChunkedHead of the policy (the adapters' base is the same model)
        self.chunked = chunked

    @torch.no_grad()
    def logps(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.run(model, lambda module, chunked: response_logps(module, batch, chunked)[0])

    @torch.no_grad()
    def run(self, model: Any, function: Any) -> Any:
        """FUNCTION(MODEL, the policy's ChunkedHead) with the adapters disabled (grpo's token
        log-probs)."""
        # peft turns modules_to_save's gradients off and on again around the context, on the
        # parameters registered at that moment: under FSDP2 the root's unsharded ones after its
        # forward, so the sharded ones would stay frozen. What trains is put back as it was
        trains = [(p, p.requires_grad) for p in self.peft_model.parameters()]
        try:
            with self.peft_model.disable_adapter():
                return function(model, self.chunked)
        finally:
            for parameter, flag in trains:
                if parameter.is_leaf:
                    parameter.requires_grad_(flag)


class PreferenceObjective(Objective):
    """The loss of a micro-batch of pairs, and the metrics summed over the steps since the last
    log line (or over an evaluation)."""

    def __init__(
        self,
        settings: PreferenceConfig,
        reference: Reference | None,
        chunked: ChunkedHead | None = None,
    ):
        self.settings = settings
        self.reference = reference
        # train.loss_chunk: the policy's log-probabilities a chunk of tokens at a time
        self.chunked = chunked
        self.keys = METRIC_KEYS + (ORPO_KEYS if settings.loss == "orpo" else ())
        self.totals: torch.Tensor | None = None

    def _terms(self, model: Any, batch: dict[str, torch.Tensor]) -> PairTerms:
        kept = batch.pop("reference_logps", None)
        batch.pop("nll_scale", None)
        if self.settings.needs_reference and kept is None:
            assert self.reference is not None, "no reference model and no precomputed values"
            kept = self.reference.logps(model, batch)
        logps, tokens = response_logps(model, batch, self.chunked)
        return PairTerms(self.settings, logps, tokens, kept)

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of one micro-batch (the mean over its pairs); its metrics are
        added to the interval's sums."""
        scale = batch.get("nll_scale")
        terms = self._terms(model, batch)
        loss = terms.losses.mean()
        if terms.nll is not None:
            # the mean over the chosen tokens of the whole step, as one big batch would give
            loss = loss + terms.nll * (scale if scale is not None else 1.0)
        sums = torch.stack(terms.sums())
        self.totals = sums if self.totals is None else self.totals + sums
        return loss

    @torch.no_grad()
    def eval_sums(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each pair's loss, 1 per pair, whether its chosen reward is the higher)."""
        terms = self._terms(model, batch)
        losses = terms.losses
        if terms.nll is not None:  # ORPO: each pair's own NLL, the mean over its chosen tokens
            losses = losses - terms.chosen_logps
        return losses.float(), torch.ones_like(losses, dtype=torch.float32), terms.correct

    def log_record(self, reduce: Any) -> dict[str, float]:
        """The metrics since the last call, over every rank (REDUCE sums a tensor over them)."""
        if self.totals is None:
            return {}
        totals = reduce(self.totals)
        self.totals = None
        pairs = max(float(totals[0]), 1.0)
        return {key: float(value) / pairs for key, value in zip(self.keys, totals[1:], strict=True)}


def start_preference(
    config: RunConfig,
    plan: Plan,
    accelerator: Any,
    engine: Any,
    run_dir: Path,
    tokenizer: Any,
    batchers: tuple[Any, ...],
    say: Any,
) -> tuple[PreferenceObjective | None, dict[str, Any] | None]:
    """model.task dpo's objective (tasks/dpo.py names it), given to ENGINE, with its reference
    built (or its values precomputed into the BATCHERS' data) before any checkpoint is loaded;
    and what the header says of the reference."""
    reference, described = build_reference(config, plan, accelerator, engine, run_dir, tokenizer)
    say(f"[dplaunch] {reference_line(described)}")
    if config.train.precompute_ref:
        policy = policy_reference(config, accelerator, engine)
        for batcher in batchers:
            if batcher is None:
                continue
            cache_file = reference_cache_file(batcher.dataset, config, plan)
            line = precompute_reference(
                batcher, engine.model, policy, accelerator, cache_file, plan.micro_batch_size
            )
            say(f"[dplaunch] {line}")
    chunked = log_prob_chunks(accelerator.unwrap_model(engine.model), config, plan)
    if chunked is not None:
        say(f"[dplaunch] chunked log-probabilities: the head {plan.loss_chunk} tokens at a time")
    engine.objective = PreferenceObjective(config.train.preference, reference, chunked)
    return engine.objective, described


def log_prob_chunks(model: Any, config: RunConfig, plan: Plan) -> ChunkedHead | None:
    """train.loss_chunk's ChunkedHead of MODEL (a policy's or a reference's log-probabilities),
    None when the plan does not chunk: every rank cuts a row of at most the prompt's tokens and
    (grpo) the completion's into as many chunks."""
    if not plan.loss_chunk:
        return None
    grpo = config.train.grpo
    longest = config.data.max_length + (grpo.max_completion_length if grpo is not None else 0)
    return ChunkedHead(model, plan.loss_chunk, longest)


def disable_dropout(model: Any) -> None:
    """No dropout in the policy (nor so in its reference), as TRL's DPOTrainer by default: the
    log-probability ratios must not be noise."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def build_reference(
    config: RunConfig, plan: Plan, accelerator: Any, engine: Any, run_dir: Path, tokenizer: Any
) -> tuple[Reference | None, dict[str, Any]]:
    """The run's reference (None: the loss needs none, or its values are precomputed) and what
    the header says of it: its kind, and the parameters rank 0 holds of it."""
    settings = config.train.preference
    if not settings.needs_reference:
        return None, {"kind": f"none ({settings.loss} is reference-free)"}
    if config.train.precompute_ref:
        return None, {"kind": "precomputed log-probabilities (train.precompute_ref)"}
    return reference_model(config, plan, accelerator, engine, run_dir, tokenizer)


def reference_model(
    config: RunConfig, plan: Plan, accelerator: Any, engine: Any, run_dir: Path, tokenizer: Any
) -> tuple[FrozenCopy | DisabledAdapters, dict[str, Any]]:
    """The policy's starting point, built and sharded as the policy (dpo's reference, grpo's
    KL term's), and what the header says of it: its kind, and the parameters rank 0 holds."""

    # train.loss_chunk: the reference's log-probabilities a chunk of the head at a time too
    def chunked(model: Any) -> ChunkedHead | None:
        return log_prob_chunks(model, config, plan)

    if config.model.lora is not None:
        peft_model = accelerator.unwrap_model(engine.model)
        return (
            DisabledAdapters(peft_model, chunked(peft_model)),
            {"kind": "the policy with its adapters disabled"},
        )
    from dplaunch.train.modeling import load_model

    # the policy's starting weights: the same seeded construction (under ZeRO-3 zero.Init)
    model = load_model(config.model, tokenizer, config.train.seed, on_gpu=plan.target == "gpu")
    model.requires_grad_(False)
    disable_dropout(model)
    if plan.engine == "fsdp":
        from dplaunch.train.fsdp import shard_model

        # not moved to the device first (the whole fp32 model on every GPU, offload: all too):
        # fully_shard moves each block's parameters to the mesh's device as it shards them,
        # as the policy's (train/fsdp.py)
        shard_model(model, plan, compile_blocks=False, reference=True)
        module: Any = model
        kind = f"a frozen copy, FSDP2 {plan.fsdp}-sharded as the policy"
    elif plan.uses_deepspeed:
        module = _deepspeed_inference(model, run_dir)
        kind = "a frozen copy, " + (
            "ZeRO-3 partitioned as the policy" if plan.zero_stage == 3 else "whole as the policy"
        )
    else:
        module = model.to(accelerator.device)
        kind = "a frozen copy, whole as the policy (DDP)"
    module.eval()
    held, total = held_parameters(model)
    autocast = accelerator.autocast if plan.engine == "ddp" else contextlib.nullcontext
    copy = FrozenCopy(module, autocast, chunked(model))
    return copy, {"kind": kind, "held": held, "parameters": total}


def _deepspeed_inference(model: Any, run_dir: Path) -> Any:
    """MODEL as a DeepSpeed engine without an optimizer, with the run's precision and, under
    ZeRO-3, its partitioning (a forward gathers each layer as the policy's does); ZeRO-1/2
    hold the weights whole, as stage 0."""
    import deepspeed

    from dplaunch.run_directory.files import read_deepspeed_file

    ds_config = read_deepspeed_file(run_dir)
    for key in ("optimizer", "scheduler", "gradient_clipping", "data_types"):
        ds_config.pop(key, None)
    if ds_config.get("zero_optimization", {}).get("stage") != 3:
        ds_config["zero_optimization"] = {"stage": 0}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    return engine


def held_parameters(model: Any) -> tuple[int, int]:
    """(parameters this rank holds, the model's parameters): a ZeRO-3 partition or an FSDP
    shard, else the whole model."""
    held = total = 0
    for parameter in model.parameters():
        if hasattr(parameter, "ds_tensor"):
            held += parameter.ds_tensor.numel()
            total += parameter.ds_numel
        elif hasattr(parameter, "to_local"):
            held += parameter.to_local().numel()
            total += parameter.numel()
        else:
            held += parameter.numel()
            total += parameter.numel()
    return held, total


def reference_line(reference: dict[str, Any]) -> str:
    """The start-up log's line about the reference."""
    line = f"reference model: {reference['kind']}"
    if "held" in reference:
        line += (
            f"; rank 0 holds {reference['held']:,} of its {reference['parameters']:,} parameters"
        )
    return line


def policy_reference(config: RunConfig, accelerator: Any, engine: Any) -> Reference:
    """The reference as the policy gives it before its first update (train.precompute_ref): the
    policy itself, or (LoRA) with its adapters disabled."""
    if config.model.lora is not None:
        return DisabledAdapters(accelerator.unwrap_model(engine.model))
    return _Policy()


class _Policy:
    @torch.no_grad()
    def logps(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return response_logps(model, batch)[0]


def reference_cache_file(dataset: Any, config: RunConfig, plan: Plan) -> Path | None:
    """Where a tokenised dataset's precomputed reference log-probabilities are kept: beside its
    tokenised cache file, named by everything they depend on (the model's definition and
    seed, the precision and engine that compute them); None when the dataset has no cache."""
    files = getattr(dataset, "cache_files", None)
    if not files:
        return None
    tokens = Path(files[0]["filename"])
    key = {
        "tokens": tokens.name,
        "model": config.model.model_dump(mode="json"),
        "seed": config.train.seed,
        "precision": plan.mixed_precision,
        "engine": [plan.engine, plan.zero_stage, plan.fsdp],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return tokens.with_name(f"{tokens.stem}-reference-{digest}.npy")


def precompute_reference(
    batcher: Any,
    model: Any,
    reference: Reference,
    accelerator: Any,
    cache_file: Path | None,
    micro_batch_size: int,
) -> str:
    """Add the reference's log-probabilities of every pair to BATCHER's dataset
    (REFERENCE_COLUMNS): read from CACHE_FILE, else computed, each data-parallel rank its share
    (every rank as many forwards: ZeRO-3 and FSDP forwards are collective), gathered, and kept in
    CACHE_FILE. Returns what the log says."""
    dataset = batcher.dataset
    found = cache_file is not None and cache_file.is_file()
    # every rank reads, or every rank computes
    seen = accelerator.reduce(torch.tensor(float(found), device=accelerator.device), "sum")
    if int(seen) == accelerator.num_processes:
        values = np.load(cache_file)
        batcher.dataset = _with_columns(dataset, values)
        return f"{len(values)} pairs' reference log-probabilities read from {cache_file}"
    shard = batcher.sharding
    rows, ranks = len(dataset), shard.data_parallel_size
    mine = list(range(shard.data_parallel_rank, rows, ranks))
    longest = -(-rows // ranks)
    places = torch.full((longest,), -1, dtype=torch.long)
    values = torch.zeros((longest, 2), dtype=torch.float32)
    was_training = model.training
    model.eval()
    for start in range(0, longest, micro_batch_size):
        chunk = mine[start : start + micro_batch_size]
        padded = chunk + [0] * (min(micro_batch_size, longest - start) - len(chunk))
        batch = {k: v.to(accelerator.device) for k, v in batcher.collate(padded).items()}
        logps = reference.logps(model, batch).float().cpu().view(2, -1).T
        values[start : start + len(padded)] = logps
        places[start : start + len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    model.train(was_training)
    gathered_places = accelerator.gather(places.to(accelerator.device)).cpu()
    gathered = accelerator.gather(values.to(accelerator.device)).cpu()
    full = np.zeros((rows, 2), dtype=np.float32)
    real = gathered_places >= 0
    full[gathered_places[real].numpy()] = gathered[real].numpy()
    if cache_file is not None and accelerator.is_local_main_process:
        partial = cache_file.with_name(f"{cache_file.stem}.{os.getpid()}.partial.npy")
        np.save(partial, full)
        partial.replace(cache_file)
    batcher.dataset = _with_columns(dataset, full)
    kept = f", kept in {cache_file}" if cache_file is not None else ""
    return f"{rows} pairs' reference log-probabilities computed before training{kept}"


def _with_columns(dataset: Any, values: np.ndarray) -> Any:
    for index, name in enumerate(REFERENCE_COLUMNS):
        dataset = dataset.add_column(name, values[:, index].tolist())
    return dataset
