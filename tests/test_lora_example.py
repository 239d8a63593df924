"""The LoRA chat example a user runs (configs/sft-lora.yaml): its shipped conversations are what
examples/make_chat_data.py generates, and the run plans as a LoRA run, before anything starts."""

from __future__ import annotations

import json
import runpy

from tests.helpers import REPO, run_dplaunch

LORA_CONFIG = REPO / "configs" / "sft-lora.yaml"
SHIPPED = REPO / "dplaunch" / "resources" / "data"


def test_the_chat_data_generator_is_deterministic_and_the_shipped_files_are_current(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # make_chat_data imports its neighbour
    make = runpy.run_path(str(REPO / "examples" / "make_chat_data.py"))["main"]
    for attempt in ("one", "two"):
        (tmp_path / attempt).mkdir()
        make(
            str(tmp_path / attempt / "chat-train.jsonl"),
            str(tmp_path / attempt / "chat-eval.jsonl"),
        )
    for name in ("chat-train.jsonl", "chat-eval.jsonl"):
        generated = (tmp_path / "one" / name).read_bytes()
        assert generated == (tmp_path / "two" / name).read_bytes(), name
        assert generated == (SHIPPED / name).read_bytes(), f"regenerate {name}"
    train = (SHIPPED / "chat-train.jsonl").read_text().splitlines()
    held_out = (SHIPPED / "chat-eval.jsonl").read_text().splitlines()
    assert (len(train), len(held_out)) == (2000, 200)
    assert not set(train) & set(held_out)  # the evaluation conversations are held out
    messages = json.loads(held_out[0])["messages"]
    assert {m["role"] for m in messages} <= {"system", "user", "assistant"}


def test_the_lora_example_plans_as_a_lora_run_on_2_cpu_ranks(tmp_path):
    plan = run_dplaunch("plan", LORA_CONFIG, "--gpus", "2", "--gpu-memory", "16")
    assert plan.returncode == 0, plan.stderr
    # r 16 on the 7 linear layers of 4 blocks (hidden 128, kv 64, MLP 256): 16·(in + out) each;
    # the embedding and head (259 × 128 each) and the final norm (128) trained in full
    adapters = 4 * 16 * (128 + 128 + 2 * (128 + 64) + 128 + 128 + 3 * (128 + 256))
    saved = 2 * 259 * 128 + 128
    assert (
        f"LoRA r 16 on all-linear: {adapters + saved:,} trainable parameters ({adapters:,} in "
        f"adapters + {saved:,} in modules_to_save"
    ) in plan.stdout
    dry = run_dplaunch(
        "train", LORA_CONFIG, "--cpu", "--gpus", "2", "--dry-run", "-o", tmp_path / "run"
    )
    assert dry.returncode == 0, dry.stderr
    assert "engine: ddp" in dry.stdout
    assert "micro batch 8 × grad-accum 1 × dp 2 = global batch 16" in dry.stdout
    assert not (tmp_path / "run").exists()
