"""dplaunch's preference tuning (model.task: dpo) is TRL 1.16's: each pair's tokens and masks are
those DPOTrainer prepares, for texts and conversations, with an explicit or an implicit prompt
(token level, on offline BPE tokenizers with real chat templates); and a one-rank run of a tiny
model built from a config trains as DPOTrainer (sigmoid and IPO) and CPOTrainer's SimPO
(reference-free) do on the same pairs in the same order, per step, within 1e-5 in fp32. The
other losses' terms (ORPO's odds ratio, label smoothing) are TRL's functions' on the same
log-probabilities."""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("trl")

from dplaunch.config.schema import DataConfig  # noqa: E402
from dplaunch.train.data import preference_examples_of  # noqa: E402
from tests.chat_tokenizers import bpe_tokenizer, family_tokenizer  # noqa: E402
from tests.helpers import read_metrics, train  # noqa: E402

LLAMA_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TINY_QWEN = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


def _quiet() -> None:
    logging.getLogger("trl").setLevel(logging.ERROR)


def trl_pairs(
    records: list[dict], tokenizer
) -> list[tuple[list[int], list[bool], list[int], list[bool]]]:
    """(chosen ids, trained, rejected ids, trained) of each record as TRL's DPOTrainer prepares
    it (its collator: prompt + response, the response's tokens trained)."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import DPOConfig, DPOTrainer

    _quiet()
    config = Qwen2Config(vocab_size=len(tokenizer), **TINY_QWEN)
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], max_length=None, use_cpu=True, bf16=False
    )
    trainer = DPOTrainer(
        model=Qwen2ForCausalLM(config),
        ref_model=Qwen2ForCausalLM(config),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
    )
    out = []
    for row in trainer.train_dataset:
        prompt = row["prompt_ids"]
        sides = [
            (prompt + row[f"{side}_ids"], [False] * len(prompt) + [True] * len(row[f"{side}_ids"]))
            for side in ("chosen", "rejected")
        ]
        out.append((*sides[0], *sides[1]))
    return out


def dplaunch_pairs(records: list[dict], tokenizer, **data) -> list:
    """Each record's two TokenizedExamples as the ranks build them (no length limit here)."""
    config = DataConfig(dataset="unused.jsonl", max_length=100_000, **data)
    pipeline = preference_examples_of(tokenizer, config)
    details: list = []
    pipeline.tokens([pipeline.examples(record) for record in records], details)
    return details


def assert_same_pairs(records: list[dict], tokenizer, **data) -> list:
    theirs = trl_pairs(records, tokenizer)
    ours = dplaunch_pairs(records, tokenizer, **data)
    for (c_ids, c_mask, r_ids, r_mask), (chosen, rejected) in zip(theirs, ours, strict=True):
        assert chosen.input_ids == c_ids and chosen.trained == c_mask
        assert rejected.input_ids == r_ids and rejected.trained == r_mask
    return ours


def _reviews() -> list[tuple[str, str, str]]:
    # prompts end with or without the space the answer's first token takes (" positive")
    pairs = []
    for number, (thing, mood) in enumerate(
        itertools.product(("film", "book", "hotel", "museum"), ("great", "dull", "good", "bad"))
    ):
        spaced = number % 4 < 2
        good = mood in ("great", "good")
        words = ("positive", "negative") if good else ("negative", "positive")
        prompt = f"Review: the {thing} was {mood}. Sentiment:" + (" " if spaced else "")
        lead = "" if spaced else " "
        pairs.append((prompt, lead + words[0], lead + words[1]))
    return pairs


REVIEWS = _reviews()


def test_text_pairs_train_the_tokens_dpotrainer_trains():
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL, bos="<s>")
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in REVIEWS]
    ours = assert_same_pairs(records, tokenizer)
    first = ours[0][0]
    assert first.input_ids[0] == tokenizer.bos_token_id  # the BOS a text prompt is read with
    assert tokenizer.decode(
        [t for t, on in zip(first.input_ids, first.trained, strict=True) if on]
    ) in (
        " positive</s>",
        " negative</s>",
    )


def test_the_implicit_prompt_of_two_texts_is_their_common_start():
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL)
    records = [{"chosen": p + c, "rejected": p + r} for p, c, r in REVIEWS]
    # the common start, less the space that then begins both responses
    explicit = [
        {"prompt": p.rstrip(" "), "chosen": (p + c)[len(p.rstrip(" ")) :], "rejected": (p + r)[len(p.rstrip(" ")) :]}
        for p, c, r in REVIEWS
    ]  # fmt: skip
    implicit = assert_same_pairs(records, tokenizer)
    for (c1, r1), (c2, r2) in zip(implicit, dplaunch_pairs(explicit, tokenizer), strict=True):
        assert (c1.input_ids, c1.labels, r1.input_ids, r1.labels) == (
            c2.input_ids, c2.labels, r2.input_ids, r2.labels,
        )  # fmt: skip


def test_a_pair_whose_responses_begin_differently_starts_both_at_the_earlier_token():
    """'Sentiment: ' + 'positive' is one token ' positive' whose space lies in the prompt;
    'Sentiment: ' + '?' leaves the space a token of its own. DPOTrainer gives a pair one prompt
    length, so the rejected response is scored from that space token too: each side masked
    alone (as sft) would compare log-probabilities of different stretches."""
    tokenizer = bpe_tokenizer(["<s>", "</s>", "<unk>"], LLAMA_SPECIAL)
    prompt = "Review: the film was great. Sentiment: "
    records = [{"prompt": prompt, "chosen": "positive", "rejected": "?"}]
    ((chosen, rejected),) = assert_same_pairs(records, tokenizer)
    # without the pair's rule the rejected response would start one token later
    space = tokenizer.convert_tokens_to_ids("Ġ")
    start = rejected.trained.index(True)
    assert rejected.input_ids[start] == space and chosen.trained.index(True) == start


@pytest.mark.parametrize("family", ["qwen2.5", "phi3", "deepseek-v3"])
def test_conversational_pairs_train_what_dpotrainer_trains_under_real_templates(family):
    tokenizer = family_tokenizer(family)
    system = [{"role": "system", "content": "be brief"}]
    records = [
        {
            "prompt": (system if number % 2 else []) + [{"role": "user", "content": f"the {thing} was {mood}?"}],
            "chosen": [{"role": "assistant", "content": "positive" if mood == "great" else "negative"}],
            "rejected": [{"role": "assistant", "content": "negative" if mood == "great" else "positive"}],
        }
        for number, (thing, mood) in enumerate(itertools.product(("film", "hotel"), ("great", "dull")))
    ]  # fmt: skip
    assert_same_pairs(records, tokenizer)
    # the implicit form: two whole conversations sharing their prompt
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
        for r in records
    ]
    for left, right in zip(
        assert_same_pairs(implicit, tokenizer), dplaunch_pairs(records, tokenizer), strict=True
    ):
        assert [side.labels for side in left] == [side.labels for side in right]


def test_tools_and_template_variables_reach_the_pair_as_they_reach_sft():
    tokenizer = family_tokenizer("qwen3")
    chat = [{"role": "user", "content": "the film was dull?"}]
    records = [
        {
            "prompt": chat,
            "chosen": [{"role": "assistant", "content": "negative"}],
            "rejected": [{"role": "assistant", "content": "positive"}],
            "chat_template_kwargs": {"enable_thinking": on},
        }
        for on in (True, False)
    ]
    thinking, quiet = assert_same_pairs(records, tokenizer)
    # with thinking off the empty think block is the generation prompt's (given at inference)
    assert thinking[0].input_ids == quiet[0].input_ids
    trained = [
        tokenizer.decode([t for t, on in zip(side.input_ids, side.trained, strict=True) if on])
        for side in (thinking[0], quiet[0])
    ]
    assert trained == ["<think>\n\n</think>\n\nnegative<|im_end|>\n", "negative<|im_end|>\n"]


# one-rank training against TRL's trainers ----------------------------------------------------

PAIRS = 24
STEPS = 6
BATCH = 4
SEED = 5
LR = 2e-3
TEMPLATE = (
    "{% for m in messages %}{{ bos_token + m['role'] + '\\n' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)
MODEL = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip
# DPOTrainer's sigmoid and (per-token) IPO, CPOTrainer's SimPO (reference-free)
LOSSES = ("sigmoid", "ipo", "simpo")
TRL_KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def _pair_records() -> list[dict]:
    things = ("film", "hotel", "dinner", "concert", "phone", "museum")
    moods = ("great", "dull", "lovely", "awful")
    records = []
    for number, (thing, mood) in enumerate(itertools.product(things, moods)):
        good = mood in ("great", "lovely")
        prompt = [
            {"role": "user", "content": f"Review: the {thing} was {mood}" + "!" * (number % 5)}
        ]
        if number % 3 == 0:
            prompt.insert(0, {"role": "system", "content": "Answer in one word."})
        records.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": "positive" if good else "negative"}],
                "rejected": [{"role": "assistant", "content": "negative, surely" if good else "positive"}],
            }
        )  # fmt: skip
    return records[:PAIRS]


def _run_file(folder: Path, loss: str) -> Path:
    import yaml

    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in _pair_records()))
    run = {
        "model": {"config": MODEL, "tokenizer": "byte-level", "task": "dpo"},
        "data": {"dataset": str(data), "chat_template": TEMPLATE, "max_length": 256},
        "train": {
            "global_batch_size": BATCH, "micro_batch_size": BATCH, "max_steps": STEPS, "lr": LR,
            "weight_decay": 0.0, "scheduler": "linear", "warmup_steps": 0, "max_grad_norm": 1.0,
            "seed": SEED, "log_every": 1, "report_to": [],
            "preference": {"loss": loss, "beta": 0.2},
        },
    }  # fmt: skip
    path = folder / f"{loss}.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """dplaunch's per-step records of a one-rank run with each loss."""
    runs = {}
    for loss in LOSSES:
        folder = tmp_path_factory.mktemp(loss)
        run_dir = folder / "run"
        train(run_dir, "--cpu", "--gpus", "1", config=_run_file(folder, loss))
        runs[loss] = [r for r in read_metrics(run_dir) if r["type"] == "train"]
    return runs


def _trl_history(loss: str) -> list[dict]:
    """TRL's per-step log of the same run: the model dplaunch's ranks build, the pairs in the
    order of dplaunch's first epoch, one micro-batch a step."""
    import torch
    from datasets import Dataset

    from dplaunch.config.schema import ModelConfig
    from dplaunch.train.modeling import load_model
    from dplaunch.train.tokenizer import byte_level_tokenizer

    _quiet()
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = ModelConfig(config=MODEL, tokenizer="byte-level", task="dpo")
    generator = torch.Generator().manual_seed(SEED * 1_000_003)  # data.py's epoch order
    order = torch.randperm(PAIRS, generator=generator).tolist()
    records = _pair_records()
    dataset = Dataset.from_list([records[i] for i in order])
    common = dict(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False,
        per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", seed=SEED, train_sampling_strategy="sequential",
        beta=0.2,
    )  # fmt: skip
    if loss in ("sigmoid", "ipo"):
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, max_length=None, gradient_checkpointing=False, loss_type=loss)
        trainer = DPOTrainer(
            model=load_model(config, tokenizer, SEED),
            ref_model=load_model(config, tokenizer, SEED),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        # SimPO as the paper writes it: no NLL term beside it (cpo_alpha 0)
        args = CPOConfig(
            **common, max_length=256, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5
        )
        trainer = CPOTrainer(
            model=load_model(config, tokenizer, SEED),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("loss", LOSSES)
def test_a_one_rank_run_trains_as_trl_does_step_by_step(one_rank_runs, loss):
    ours = one_rank_runs[loss]
    theirs = _trl_history(loss)
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, trl) in enumerate(zip(ours, theirs, strict=True), 1):
        for key in TRL_KEYS:
            assert mine[key] == pytest.approx(trl[key], abs=1e-5), (step, key, mine[key], trl[key])
    # the run learnt something: the rewards moved apart
    assert ours[-1]["rewards/margins"] != pytest.approx(ours[0]["rewards/margins"], abs=1e-3)


def _logps() -> tuple:
    import torch

    generator = torch.Generator().manual_seed(0)
    chosen, rejected = (
        -torch.rand(6, generator=generator) * 3,
        -torch.rand(6, generator=generator) * 3,
    )
    tokens = torch.tensor([4, 7, 2, 9, 3, 5, 6, 2, 8, 4, 5, 7])
    return chosen, rejected, tokens


def _terms(loss: str, logps, tokens, reference=None, **settings):
    from dplaunch.config.schema import PreferenceConfig
    from dplaunch.train.preference import PairTerms

    return PairTerms(PreferenceConfig(loss=loss, beta=0.2, **settings), logps, tokens, reference)


def _trainer_self(**fields):
    from types import SimpleNamespace

    return SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), **fields)


def test_the_orpo_odds_ratio_term_and_rewards_are_trls():
    import torch
    from trl.experimental.orpo import ORPOTrainer

    chosen, rejected, tokens = _logps()
    n_chosen, n_rejected = tokens.chunk(2)
    # ORPOTrainer's log-probabilities are the responses' means over their tokens
    means = (chosen / n_chosen, rejected / n_rejected)
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        _trainer_self(beta=0.2), *means
    )
    terms = _terms("orpo", torch.cat([chosen, rejected]), tokens)
    torch.testing.assert_close(terms.losses, -losses)  # ORPOTrainer subtracts it
    torch.testing.assert_close(terms.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(terms.rejected_rewards, rejected_rewards)
    torch.testing.assert_close(terms.log_odds.mean(), log_odds)
    # the NLL term: the mean over the chosen responses' tokens
    torch.testing.assert_close(terms.nll, -chosen.sum() / n_chosen.sum())


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_label_smoothing_is_trls_conservative_loss(loss):
    """TRL's CPOTrainer smooths its sigmoid and SimPO losses as conservative DPO does; dplaunch's
    DPO sigmoid takes the same on the log-ratio margin (DPOTrainer 1.16's sigmoid has none)."""
    import torch
    from trl.experimental.cpo import CPOTrainer

    chosen, rejected, tokens = _logps()
    n_chosen, n_rejected = tokens.chunk(2)
    reference = torch.cat([chosen, rejected]) * 0.9
    trainer = _trainer_self(
        beta=0.2, label_smoothing=0.15, loss_type=loss, simpo_gamma=0.5, alpha=0.0
    )
    if loss == "sigmoid":  # CPO's sigmoid on the log-ratios is DPO's
        inputs = (chosen - reference[:6], rejected - reference[6:])
    else:
        inputs = (chosen / n_chosen, rejected / n_rejected)
    losses, _, _ = CPOTrainer.cpo_loss(trainer, *inputs)
    terms = _terms(
        loss, torch.cat([chosen, rejected]), tokens, reference if loss == "sigmoid" else None,
        label_smoothing=0.15,
    )  # fmt: skip
    torch.testing.assert_close(terms.losses, losses)
