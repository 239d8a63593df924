"""Preference tuning (model.task: dpo): bad pairs are refused before launch in one line; the
planner counts the reference model per layout; every layout trains as DDP does with the reference
sharded as the policy; LoRA's reference is its base; precomputed reference log-probabilities
train as a live reference; a resumed run continues exactly.

TRL equivalence (masks, per-step losses and rewards): tests/test_dpo_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from tests.helpers import (
    REPO,
    files_under,
    read_metrics,
    refusal_line,
    run_dplaunch,
    train,
)

DPO_CONFIG = REPO / "configs" / "dpo.yaml"
TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip
PROMPT = [{"role": "user", "content": "Review: the film was great.\nPositive or negative?"}]


def _said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


GOOD = {"prompt": PROMPT, "chosen": _said("positive"), "rejected": _said("negative")}


def dpo_run_file(path: Path, **train_keys) -> Path:
    """configs/dpo.yaml with a tiny model, no evaluation set, 4 steps of 8 pairs in
    micro-batches of 2, and TRAIN_KEYS."""
    data = yaml.safe_load(DPO_CONFIG.read_text())
    data["model"]["config"] = dict(TINY)
    data["data"].pop("eval_dataset", None)
    data["train"].update(
        {
            "max_steps": 4, "global_batch_size": 8, "micro_batch_size": 2, "lr": 5e-3,
            "warmup_steps": 0, "log_every": 1, "eval_every": None, "report_to": [],
            **train_keys,
        }
    )  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


# -- refused before launch ---------------------------------------------------------------------


def _prepare(tmp: Path, records: list[dict] | None = None, *assignments: str, **train_keys):
    """prepare_training_run (nothing written) for the tiny run on RECORDS (GOOD ones before
    them, enough for a global batch); the UserError's line."""
    from dplaunch.launching.prepare import prepare_training_run

    settings = list(assignments)
    if records is not None:
        path = tmp / "pairs.jsonl"
        rows = [GOOD] * 8 + records
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        settings.append(f"data.dataset={path}")
    flags = RunFlags(
        config=dpo_run_file(tmp / "dpo.yaml", **train_keys), gpus=2, cpu=True,
        assignments=settings,
    )  # fmt: skip
    with pytest.raises(UserError) as refused:
        prepare_training_run(flags, render_only=True)
    return refused.value.line()


REFUSED = [
    (
        "same-responses",
        [{"prompt": PROMPT, "chosen": _said("yes"), "rejected": _said("yes")}],
        "line 9 of {tmp}/pairs.jsonl has the same chosen and rejected response: nothing to prefer",
    ),
    (
        "same-texts",
        [{"prompt": "a", "chosen": " b", "rejected": " b"}] * 0
        + [{"prompt": PROMPT, "chosen": _said("x"), "rejected": _said("x")}],
        "the same chosen and rejected response",
    ),
    (
        "empty-response",
        [{"prompt": PROMPT, "chosen": _said("positive"), "rejected": _said("  ")}],
        "line 9 of {tmp}/pairs.jsonl has an empty rejected response — fix that record or drop it",
    ),
    (
        "empty-list",
        [{"prompt": PROMPT, "chosen": [], "rejected": _said("no")}],
        "line 9 of {tmp}/pairs.jsonl has an empty 'chosen' list",
    ),
    (
        "missing-column",
        [{"prompt": PROMPT, "chosen": _said("positive")}],
        "line 9 of {tmp}/pairs.jsonl has no 'rejected' — give every record a chosen and a "
        "rejected response",
    ),
    (
        "mixed-kinds",
        [{"prompt": "Review: great.", "chosen": _said("positive"), "rejected": " negative"}],
        "has a text prompt, a message-list chosen, a text rejected — make them all texts, or all "
        "lists of messages",
    ),
    (
        "no-shared-prompt",
        [{"chosen": PROMPT + _said("a"), "rejected": _said("b")}],
        "has no 'prompt', and its chosen and rejected responses do not start alike",
    ),
    (
        "response-without-answer",
        [
            {
                "prompt": PROMPT,
                "chosen": [{"role": "user", "content": "hm"}],
                "rejected": _said("no"),
            }
        ],
        "'chosen' has no assistant turn: nothing to train on",
    ),
]


@pytest.mark.parametrize("records,expected", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_pair_the_ranks_cannot_train_on_is_refused_naming_its_line(tmp_path, records, expected):
    line = _prepare(tmp_path, records)
    assert line.startswith("data.dataset: ")
    assert expected.replace("{tmp}", str(tmp_path)) in line


def test_records_without_the_pairs_columns_are_refused_at_the_first(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": PROMPT + _said("positive")}) + "\n" * 1)
    line = _prepare(tmp_path, None, f"data.dataset={path}")
    assert line.startswith(
        f"data.dataset: the records of {path} have no 'chosen' and 'rejected' column (the first "
        "one's: messages), which model.task dpo trains on"
    )


@pytest.mark.parametrize(
    "assignments,train_keys,expected",
    [
        (["data.format=conversational"], {}, "data.format: is for supervised fine-tuning"),
        (["data.packing=true"], {}, "data.packing: dpo trains each pair in rows of its own"),
        (["data.streaming=true"], {}, "data.streaming: dpo reads its pairs whole"),
        (
            [],
            {"precompute_ref": True, "preference": {"loss": "simpo"}},
            "train.precompute_ref: the simpo loss has no reference model to precompute",
        ),
        (["model.task=sft"], {"precompute_ref": True}, "is for preference tuning, but model.task is sft"),
        (
            [],
            {"preference": {"loss": "orpo", "simpo_gamma": 1.0}},
            "train.preference.simpo_gamma: is not read by the orpo loss (only by simpo) — remove "
            "it, or use train.preference.loss simpo",
        ),
        (
            [],
            {"preference": {"loss": "ipo", "label_smoothing": 0.1}},
            "train.preference.label_smoothing: is not read by the ipo loss (only by sigmoid or "
            "simpo)",
        ),
        (["parallel.tp=2"], {}, "parallel.tp: model.task dpo trains on data-parallel layouts only"),
        (["parallel.pp=2"], {}, "parallel.pp: model.task dpo trains on data-parallel layouts only"),
        (["data.chat_template=null"], {}, "has no chat template to render the messages of line 1"),
        (
            ["data.max_length=16", "data.truncation=drop"],
            {},
            "train.global_batch_size: 0 training pairs are kept (8 left out), fewer than one",
        ),
    ],
    ids=["sft-key", "packing", "streaming", "precompute-simpo", "dpo-key-with-sft", "gamma-orpo", "smoothing-ipo", "tp", "pp", "no-template", "too-few-kept"],
)  # fmt: skip
def test_a_run_file_dpo_cannot_train_is_refused_naming_the_key(
    tmp_path, assignments, train_keys, expected
):
    assert expected in _prepare(tmp_path, [], *assignments, **train_keys)


def test_a_refused_pair_is_one_line_exit_2_and_nothing_written(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT, "chosen": _said("a"), "rejected": _said("a")}))
    out = tmp_path / "run"
    result = run_dplaunch(
        "train", dpo_run_file(tmp_path / "dpo.yaml"), "--set", f"data.dataset={path}", "-o", out
    )
    refusal_line(result, "nothing to prefer")
    assert not out.exists() and files_under(tmp_path) == ["dpo.yaml", "pairs.jsonl"]


def test_dplaunch_data_shows_each_pairs_chosen_and_rejected_masks_as_the_ranks_train_them(capsys):
    from dplaunch.commands.data import run_data
    from dplaunch.config.load import load_run_config
    from dplaunch.train.data import attach_chat_template, load_splits, tokenize
    from dplaunch.train.modeling import load_tokenizer

    options = {"show": 3, "start": 2, "blocks": 0, "boundaries": False}
    assert run_data(RunFlags(config=DPO_CONFIG), as_json=True, **options) == 0
    shown = json.loads(capsys.readouterr().out)
    config = load_run_config(DPO_CONFIG)
    tokenizer = load_tokenizer(config.model)
    attach_chat_template(tokenizer, config.data, "dpo")
    rows = tokenize(load_splits(config.data, config.train.seed)[0], tokenizer, config.data, "dpo")
    assert shown["stats"]["pairs"] == shown["stats"]["kept"] == len(rows) == 1200
    assert [e["index"] for e in shown["examples"]] == [2, 3, 4]
    for example in shown["examples"]:
        row = rows[example["index"]]
        for side in ("chosen", "rejected"):
            assert example[side]["trained"] == [label != -100 for label in row[f"{side}_labels"]]
            trained = "".join(
                t
                for t, on in zip(example[side]["tokens"], example[side]["trained"], strict=True)
                if on
            )
            assert trained.endswith("</s>") and "user" not in trained
    assert run_data(RunFlags(config=DPO_CONFIG), as_json=False, **options) == 0
    out = capsys.readouterr().out
    assert "pairs: 1,200 — 1,200 kept, 0 left out whole" in out
    assert "pair 2, chosen: " in out and "pair 2, rejected: " in out and "[[" in out


# -- the plan ------------------------------------------------------------------------------------


def _big_run(tmp: Path, gpu_memory: float, *assignments: str):
    from tests.test_planning_tools import LLAMA_7B, run_config

    path = dpo_run_file(tmp / "big.yaml")
    data = yaml.safe_load(path.read_text())
    data["model"]["config"] = {**LLAMA_7B, "num_hidden_layers": 8}
    data["data"]["max_length"] = 1024
    data["train"].update({"mixed_precision": "bf16", "global_batch_size": 64})
    data["parallel"] = "auto"
    path.write_text(yaml.safe_dump(data))
    return run_config(path, "launch.gpus=8", f"launch.gpu_memory_gb={gpu_memory}", *assignments)


def test_the_plan_counts_the_reference_model_as_the_policys_weights_are_held(tmp_path):
    from dplaunch.planning.auto import plan_candidates, run_workload
    from dplaunch.planning.estimate import GIB, count_parameters
    from dplaunch.planning.model_facts import ModelFacts

    config = _big_run(tmp_path, 80)
    facts = ModelFacts.from_config_dict(config.model.config)
    psi = count_parameters(facts, "dpo").total
    workload = run_workload(config)
    assert workload.reference == "copy" and workload.rows_per_sample == 2
    rows = {
        c.name: c.memory
        for c in plan_candidates(facts, workload, gpus=8, gpus_per_node=8, gpu_memory_gb=80)
    }
    # DDP keeps fp32 weights; DeepSpeed's 16-bit ones whole (ZeRO-1/2) or in 8 parts (ZeRO-3);
    # FSDP fp32 shards; offloaded parameters take the reference's to the host
    expected = {
        "DDP": 4 * psi,
        "ZeRO-1": 2 * psi,
        "ZeRO-2": 2 * psi,
        "ZeRO-3": 2 * psi / 8,
        "FSDP": 4 * psi / 8,
    }
    for name, held in expected.items():
        assert rows[name].reference_gb == pytest.approx(held / GIB), name
    assert rows["ZeRO-3 + offload all"].reference_gb == 0
    # a pair is two rows in the forward: twice an sft example's activations
    sft = plan_candidates(
        facts, workload.__class__(**{**workload.__dict__, "task": "sft", "reference": None}),
        gpus=8, gpus_per_node=8, gpu_memory_gb=80,
    )  # fmt: skip
    by_name = {c.name: c.memory for c in sft if c.tp * c.pp * c.sp == 1}  # sp rows share names
    assert rows["ZeRO-1"].activations_gb == pytest.approx(2 * by_name["ZeRO-1"].activations_gb)
    # LoRA's reference is its base, a precomputed one none: nothing held
    lora = run_workload(_big_run(tmp_path, 80, 'model.lora={"r": 8}'))
    precomputed = run_workload(_big_run(tmp_path, 80, "train.precompute_ref=true"))
    assert (lora.reference, precomputed.reference) == ("adapters", None)
    assert not (lora.holds_reference or precomputed.holds_reference)


def test_parallel_auto_shards_further_to_hold_the_reference_model(tmp_path):
    from dplaunch.planning.auto import resolve_auto_parallel
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.plan import Machine

    def choose(gpu_memory: float, *assignments: str):
        config = _big_run(tmp_path, gpu_memory, *assignments)
        facts = ModelFacts.from_config_dict(config.model.config)
        return resolve_auto_parallel(config, facts, Machine(visible_gpus=8))

    def zero1(choice) -> float:
        return next(c.total_gb for c in choice.candidates if c.name == "ZeRO-1" and c.sp == 1)

    # a GPU between what ZeRO-1 needs without and with the reference (10% kept free)
    without, held = zero1(choose(80, "train.precompute_ref=true")), zero1(choose(80))
    assert held > without
    memory = (without + held) / 2 / 0.9
    precomputed, live = choose(memory, "train.precompute_ref=true"), choose(memory)
    assert precomputed.parallel.zero_stage == 1
    assert live.parallel.zero_stage >= 2, live.note
    chosen = next(c for c in live.candidates if c.recommended)
    assert chosen.memory.reference_gb > 0 and chosen.fits


def test_the_forecast_counts_both_rows_of_a_pair_and_the_reference_forward():
    from dataclasses import replace

    from dplaunch.planning.forecast import forecast_step
    from dplaunch.planning.model_facts import ModelFacts
    from dplaunch.planning.rules import ParallelDims
    from dplaunch.planning.workload import Workload
    from tests.test_forecast import small_profile
    from tests.test_planning_tools import LLAMA_7B

    facts, dims, profile = (
        ModelFacts.from_config_dict(LLAMA_7B),
        ParallelDims(8, 8),
        small_profile(),
    )
    sft = Workload(micro_batch=2, seq_len=512, task="sft", global_batch_size=16)
    precomputed = replace(sft, task="dpo")
    live = replace(precomputed, reference="copy")
    flops = {
        name: forecast_step(facts, dims, work, profile).model_flops_per_step
        for name, work in (("sft", sft), ("precomputed", precomputed), ("live", live))
    }
    assert flops["precomputed"] == pytest.approx(2 * flops["sft"])
    # a forward is a third of a forward and backward (no recomputation)
    assert flops["live"] == pytest.approx(flops["precomputed"] * 4 / 3, rel=0.01)
    steps = {
        w: forecast_step(facts, dims, w, profile).terms["compute"] for w in (precomputed, live)
    }
    assert steps[live] > steps[precomputed]


# -- LoRA: the reference is the base ---------------------------------------------------------


def test_the_lora_reference_is_a_full_frozen_copy_of_the_base(tmp_path):
    """The policy with its adapters disabled gives the log-probabilities of the base it started
    from, however far the adapters (and modules_to_save copies) have moved; and what trains
    still trains afterwards."""
    import torch

    from dplaunch.config.schema import LoraConfig, ModelConfig
    from dplaunch.train.modeling import load_model
    from dplaunch.train.preference import DisabledAdapters, FrozenCopy
    from dplaunch.train.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    base = ModelConfig(config=TINY, tokenizer="byte-level", task="dpo")
    lora = base.model_copy(update={"lora": LoraConfig(r=4, modules_to_save=["lm_head"])})
    policy = load_model(lora, tokenizer, seed=3)
    copy = load_model(base, tokenizer, seed=3).eval()
    with torch.no_grad():  # as if trained: every adapter and saved copy moved
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (4, 12), generator=generator)
    labels = ids.clone()
    labels[:, :5] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    trains = [p.requires_grad for p in policy.parameters()]
    disabled = DisabledAdapters(policy).logps(policy, batch)
    assert torch.equal(disabled, FrozenCopy(copy).logps(copy, batch))
    assert [p.requires_grad for p in policy.parameters()] == trains
    # the adapters do count when enabled
    from dplaunch.train.preference import response_logps

    with torch.no_grad():
        assert not torch.allclose(response_logps(policy, batch)[0], disabled)


# -- every layout, launched ----------------------------------------------------------------------

LAYOUTS = {
    "ddp": (),
    "zero1": ("--zero", "1"),
    "zero2": ("--zero", "2"),
    "zero3": ("--zero", "3"),
    "fsdp": ("--fsdp", "full"),
    # train.loss_chunk: the policy's log-probabilities in checkpointed chunks of 5 tokens
    "zero3-chunked": ("--zero", "3", "--set", "train.loss_chunk=5"),
    "fsdp-chunked": ("--fsdp", "full", "--set", "train.loss_chunk=5"),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """The tiny run on 2 CPU ranks under each layout (one launch each)."""
    folder = tmp_path_factory.mktemp("dpo-layouts")
    config = dpo_run_file(folder / "dpo.yaml")
    runs = {}
    for name, flags in LAYOUTS.items():
        runs[name] = folder / name
        train(runs[name], "--cpu", "--gpus", "2", *flags, config=config)
    return runs


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["type"] == "train"]


def _header(run_dir: Path) -> dict:
    return next(r for r in read_metrics(run_dir) if r["type"] == "header")


KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def assert_trains_as(run_dir: Path, reference_run: Path, tolerance: float = 1e-5) -> None:
    ours, theirs = _train_records(run_dir), _train_records(reference_run)
    assert len(ours) == len(theirs) == 4
    for mine, ddp in zip(ours, theirs, strict=True):
        for key in KEYS:
            assert mine[key] == pytest.approx(ddp[key], abs=tolerance), (mine["step"], key)
        assert mine["rewards/accuracies"] == ddp["rewards/accuracies"]


@pytest.mark.parametrize(
    "layout", ["zero1", "zero2", "zero3", "fsdp", "zero3-chunked", "fsdp-chunked"]
)
def test_every_layout_trains_as_ddp_does(layouts, layout):
    assert_trains_as(layouts[layout], layouts["ddp"])
    # the rewards moved: the policy left its reference
    assert _train_records(layouts["ddp"])[-1]["rewards/margins"] != 0


def test_the_reference_is_sharded_as_the_policy_rank_0_holding_a_share(layouts):
    held = {name: _header(run)["reference"] for name, run in layouts.items()}
    total = held["ddp"]["parameters"]
    for name in ("ddp", "zero1", "zero2"):
        assert held[name]["held"] == held[name]["parameters"] == total, name
    for name in ("zero3", "fsdp"):
        assert held[name]["parameters"] == total
        assert 0 < held[name]["held"] <= total / 2 + 64, (name, held[name])  # one of 2 shares
    assert "ZeRO-3 partitioned" in held["zero3"]["kind"] and "FSDP2" in held["fsdp"]["kind"]


@pytest.fixture(scope="module")
def resumed_ddp(tmp_path_factory) -> Path:
    """The DDP run stopped at step 2 and resumed: the reference is built again."""
    folder = tmp_path_factory.mktemp("dpo-resume")
    config = dpo_run_file(folder / "dpo.yaml")
    run = folder / "run"
    train(run, "--cpu", "--gpus", "2", "--set", "train.stop_after_steps=2", config=config)
    train(run, "--cpu", "--gpus", "2", "--resume", "auto", config=config)
    return run


def test_a_resumed_run_continues_bit_exactly(resumed_ddp, layouts):
    resumed = [r["loss"] for r in _train_records(resumed_ddp)]
    straight = [r["loss"] for r in _train_records(layouts["ddp"])]
    assert resumed == straight


def test_checkpoints_and_exports_hold_the_policy_only(resumed_ddp):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(resumed_ddp / "model")
    (checkpoint,) = resumed_ddp.glob("checkpoints/*/model.safetensors")
    assert set(load_file(checkpoint)) == set(exported.state_dict())
    held = _header(resumed_ddp)["reference"]["parameters"]
    assert sum(p.numel() for p in exported.parameters()) == held


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory) -> tuple[Path, list[str]]:
    """train.precompute_ref under ZeRO-3 (partitioned forwards), stopped at step 2 and resumed
    (the kept values read back); the two launches' outputs."""
    folder = tmp_path_factory.mktemp("dpo-precomputed")
    config = dpo_run_file(folder / "dpo.yaml", precompute_ref=True)
    run = folder / "run"
    first = train(
        run,
        "--cpu",
        "--gpus",
        "2",
        "--zero",
        "3",
        "--set",
        "train.stop_after_steps=2",
        config=config,
    )
    second = train(run, "--cpu", "--gpus", "2", "--zero", "3", "--resume", "auto", config=config)
    return run, [first.stdout, second.stdout]


def test_precomputed_reference_values_train_as_a_live_reference(precomputed, layouts):
    run, (first, second) = precomputed
    assert_trains_as(run, layouts["ddp"])
    assert _header(run)["reference"] == {
        "kind": "precomputed log-probabilities (train.precompute_ref)"
    }
    assert "reference log-probabilities computed before training, kept in" in first
    assert "reference log-probabilities read from" in second


@pytest.fixture(scope="module")
def lora_fsdp(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpo-lora")
    config = dpo_run_file(folder / "dpo.yaml")
    run = folder / "run"
    lora = '{"r": 4, "modules_to_save": ["lm_head"]}'
    train(
        run, "--cpu", "--gpus", "2", "--fsdp", "full", "--set", f"model.lora={lora}", config=config
    )
    return run


def test_lora_under_fsdp_trains_its_saved_modules_against_the_disabled_adapters(lora_fsdp):
    """The reference forward disables the adapters; peft turns modules_to_save's gradients off
    and on around it, under FSDP2 on the unsharded parameters only: the sharded lm_head copy
    stayed frozen and the export found no trained value for it (fixed in DisabledAdapters)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert _header(lora_fsdp)["reference"]["kind"] == "the policy with its adapters disabled"
    records = _train_records(lora_fsdp)
    assert records[-1]["rewards/margins"] != 0
    adapter = load_file(lora_fsdp / "adapter" / "adapter_model.safetensors")
    assert any("lm_head" in key for key in adapter)
    base = AutoModelForCausalLM.from_pretrained(lora_fsdp / "model")
    assert PeftModel.from_pretrained(base, lora_fsdp / "adapter") is not None
