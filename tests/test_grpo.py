"""Online RL (model.task: grpo): bad inputs are refused before launch in one line; completions
are seeded per prompt and completion, never per rank, so every layout samples the same ones and
trains as DDP does (DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP2 on 2 ranks, 1 rank at the same global batch; LoRA
under ZeRO-3 as LoRA under DDP), with the KL to a reference model and two iterations per batch
of completions; a run stopped inside a batch's iterations resumes exactly; a reward function
that fails during the run stops it with one line naming it and the step.

The maths against TRL 1.16's GRPOTrainer: tests/test_grpo_loss.py; the reward functions:
tests/test_grpo_rewards.py; the sampler: test_the_sampler_* below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dplaunch.config.flags import RunFlags
from dplaunch.errors import UserError
from dplaunch.planning.estimate import estimate_memory
from dplaunch.planning.forecast import forecast_step
from dplaunch.planning.model_facts import ModelFacts
from dplaunch.planning.profiles import datasheet_profile
from dplaunch.planning.rules import ParallelDims
from dplaunch.planning.workload import Generation, Workload
from dplaunch.train.generation import Sampling, completion_seed, draw, filtered_logits
from tests.helpers import REPO, read_metrics, run_dplaunch, train

GRPO_CONFIG = REPO / "configs" / "grpo.yaml"
TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 259,
    "max_position_embeddings": 64, "tie_word_embeddings": False,
}  # fmt: skip


def grpo_run_file(path: Path, **grpo_keys) -> Path:
    """configs/grpo.yaml with a tiny model, 4 steps of 8 completions (2 prompts × 4) in
    micro-batches of 2, the KL term and two iterations per batch, and GRPO_KEYS."""
    data = yaml.safe_load(GRPO_CONFIG.read_text())
    data["model"]["config"] = dict(TINY)
    data["data"].pop("eval_dataset", None)
    data["train"].update(
        {
            "max_steps": 4, "global_batch_size": 8, "micro_batch_size": 2, "lr": 5e-3,
            "log_every": 1, "eval_every": None, "report_to": [], "seed": 3,
        }
    )  # fmt: skip
    if "rewards" in grpo_keys:  # the example's two weights are for its two rewards
        data["train"]["grpo"].pop("reward_weights")
    data["train"]["grpo"].update(
        {"num_generations": 4, "max_completion_length": 5, "beta": 0.04, "num_iterations": 2,
         **grpo_keys}
    )  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


def _refused(tmp: Path, *assignments: str, records: list[dict] | None = None, **grpo) -> str:
    """The UserError line of prepare_training_run (nothing written) for the tiny run."""
    from dplaunch.launching.prepare import prepare_training_run

    settings = list(assignments)
    if records is not None:
        path = tmp / "prompts.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        settings.append(f"data.dataset={path}")
    flags = RunFlags(
        config=grpo_run_file(tmp / "grpo.yaml", **grpo), gpus=2, cpu=True, assignments=settings
    )
    with pytest.raises(UserError) as refused:
        prepare_training_run(flags, render_only=True)
    assert not list(tmp.glob("runs*")), "nothing written"
    return refused.value.line()


# -- refused before launch ---------------------------------------------------------------------


def test_num_generations_not_dividing_the_batch_is_refused_with_the_nearest_that_do(tmp_path):
    line = _refused(tmp_path, num_generations=3)
    assert line.startswith("train.global_batch_size: is 8 completions, which num_generations 3")
    assert "use 6 or 9" in line


@pytest.mark.parametrize(
    "grpo,expected",
    [
        ({"loss_type": "cispo"}, "cispo is one of TRL 1.16's newer losses"),
        ({"generation_backend": "vllm"}, "vllm is not supported yet"),
        ({"reward_weights": [1.0]}, "has 1 weight(s) for 2 reward function(s)"),
        ({"rewards": ["no_such_module_xyz:score"]}, "no_such_module_xyz"),
        ({"rewards": [{"exact_match": "solution"}]}, "solution"),
    ],
    ids=["trl-only-loss", "vllm", "weights", "reward-import", "reward-column"],
)
def test_bad_grpo_settings_are_refused_in_one_line(tmp_path, grpo, expected):
    line = _refused(tmp_path, **grpo)
    assert line.startswith("train.grpo"), line
    assert expected in line, line


def test_a_reward_function_with_a_wrong_signature_is_refused_before_launch(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def score(x):\n    return [0.0]\n")
    line = _refused(tmp_path, rewards=[f"{tmp_path}/my_rewards.py:score"])
    assert line.startswith("train.grpo.rewards") and "score" in line, line


def test_records_without_a_prompt_are_refused(tmp_path):
    line = _refused(tmp_path, records=[{"question": "1+1=", "answer": "2"}] * 8)
    assert line.startswith("data.dataset:") and "no 'prompt' column" in line, line


@pytest.mark.parametrize(
    "assignment,expected",
    [
        ("parallel.tp=2", "parallel.tp: model.task grpo trains on data-parallel layouts only"),
        ("data.streaming=true", "data.streaming: grpo reads its prompts whole"),
        ("data.packing=true", "data.packing: grpo generates each prompt's completions"),
        ("data.truncation=drop", "data.truncation: is for supervised fine-tuning"),
    ],
    ids=["tp", "streaming", "packing", "sft-key"],
)
def test_layouts_and_keys_grpo_cannot_use_are_refused(tmp_path, assignment, expected):
    assert expected in _refused(tmp_path, assignment)


def test_train_grpo_under_another_task_is_refused(tmp_path):
    line = _refused(tmp_path, "model.task=sft")
    assert line.startswith("train.grpo: is for online RL (grpo), but model.task is sft"), line


# -- the plan and the forecast -----------------------------------------------------------------

LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 32000,
}  # fmt: skip


def _grpo_workload(**generation) -> Workload:
    options = {"rows": 8, "completion_tokens": 1024, "iterations": 1, **generation}
    return Workload(
        micro_batch=8, seq_len=512 + options["completion_tokens"], mixed_precision="bf16",
        task="grpo", global_batch_size=64, reference="copy", generation=Generation(**options),
    )  # fmt: skip


def test_the_plan_counts_the_kv_cache_of_a_group_and_the_reference():
    facts = ModelFacts.from_config_dict(LLAMA_1B)
    estimate = estimate_memory(facts, ParallelDims(8, 8), _grpo_workload())
    # 2 (k, v) × 22 layers × 4 kv heads × 64 × 8 rows × (512 + 1024) tokens × 2 bytes, and
    # the 8 rows' last logits in fp32
    kv, logits = 2 * 22 * 4 * 64 * 8 * 1536 * 2, 8 * 32000 * 4
    assert estimate.kv_cache_gb * 2**30 == pytest.approx(kv + logits)
    assert estimate.reference_gb > 0
    lines = "\n".join(estimate.breakdown_lines())
    assert "KV cache while sampling (grpo)" in lines and "reference model" in lines


def test_a_run_files_workload_holds_its_generation_and_reference(tmp_path):
    from dplaunch.config.load import load_run_config
    from dplaunch.planning.auto import run_workload

    config = load_run_config(grpo_run_file(tmp_path / "grpo.yaml"))
    work = run_workload(config)
    assert work.generation == Generation(rows=4, completion_tokens=5, iterations=2)
    assert work.seq_len == config.data.max_length + 5 and work.reference == "copy"


def test_the_forecast_counts_the_sampling_its_gathers_and_one_batch_per_iterations():
    facts, h100 = ModelFacts.from_config_dict(LLAMA_1B), datasheet_profile("H100", 8, 1)
    ddp = forecast_step(facts, ParallelDims(8, 8), _grpo_workload(), h100)
    generate = ddp.phases["generate"]
    assert set(generate) == {"decode", "overhead", "communication", "scoring"}
    assert ddp.terms["generation"] == pytest.approx(sum(generate.values()))
    assert generate["communication"] == 0.0 and generate["decode"] > 0.0
    # a decode step reads the weights: 8 groups (64 completions ÷ 8 ranks … 8 a group) × 1024
    # tokens × 2.2 GB ÷ 70 % of 3.35 TB/s, and the prefills
    assert generate["decode"] == pytest.approx(1024 * 2.2e9 / (0.7 * 3.35e12), rel=0.1)
    zero3 = forecast_step(facts, ParallelDims(8, 8, zero_stage=3), _grpo_workload(), h100)
    assert zero3.phases["generate"]["communication"] > 0.0  # every decode step gathers
    twice = forecast_step(facts, ParallelDims(8, 8), _grpo_workload(iterations=2), h100)
    assert twice.phases["generate"]["decode"] == pytest.approx(generate["decode"] / 2)
    longer = forecast_step(facts, ParallelDims(8, 8), _grpo_workload(completion_tokens=2048), h100)
    assert longer.phases["generate"]["decode"] > 1.9 * generate["decode"]


# -- the sampler -------------------------------------------------------------------------------


def test_the_sampler_draws_by_the_inverse_cumulative_distribution_after_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    sampling = Sampling(4, temperature=1.0, top_p=1.0, top_k=None, eos_ids=())
    full = filtered_logits(logits, sampling)
    # the cumulative distribution 0.1, 0.3, 0.6, 1.0
    picks = [int(draw(full, torch.tensor([u]))) for u in (0.05, 0.25, 0.55, 0.95)]
    assert picks == [0, 1, 2, 3]
    top2 = filtered_logits(logits, Sampling(4, 1.0, 1.0, 2, ()))
    assert torch.isinf(top2[0, :2]).all() and torch.isfinite(top2[0, 2:]).all()
    # top-p 0.5: 0.4 alone does not reach it, 0.4 + 0.3 does: the two likeliest are kept
    nucleus = filtered_logits(logits, Sampling(4, 1.0, 0.5, None, ()))
    assert torch.isinf(nucleus[0, :2]).all() and torch.isfinite(nucleus[0, 2:]).all()


def test_a_completion_seed_depends_on_the_prompt_and_the_completion_only():
    seeds = {completion_seed(3, p, j) for p in range(10) for j in range(8)}
    assert len(seeds) == 80
    assert completion_seed(3, 5, 2) == completion_seed(3, 5, 2) != completion_seed(4, 5, 2)


# -- every layout trains as DDP does -----------------------------------------------------------

LAYOUTS = {
    "ddp": ("--gpus", "2"),
    "one-rank": ("--gpus", "1"),
    "zero1": ("--gpus", "2", "--zero", "1"),
    "zero2": ("--gpus", "2", "--zero", "2"),
    "zero3": ("--gpus", "2", "--zero", "3"),
    "fsdp2": ("--gpus", "2", "--fsdp", "full"),
    # train.loss_chunk: the completions' log-probabilities in checkpointed chunks of 3 tokens
    "ddp-chunked": ("--gpus", "2", "--set", "train.loss_chunk=3"),
}
LORA = ("--set", "model.lora.r=4")


# a reward that a random tiny model's completions already spread (the example's are all 0 at
# first, which would leave every advantage, loss and update 0): the text's bytes, mod 7
VARIED = "def varied(prompts, completions, **columns):\n    return [float(sum(c.encode()) % 7) for c in completions]\n"


def varied_run_file(tmp: Path) -> Path:
    (tmp / "varied_reward.py").write_text(VARIED)
    return grpo_run_file(tmp / "grpo.yaml", rewards=[f"{tmp}/varied_reward.py:varied", "format"])


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """The tiny run on each layout (and LoRA under DDP and ZeRO-3): their run directories."""
    tmp = tmp_path_factory.mktemp("grpo")
    run_file = varied_run_file(tmp)
    runs = {}
    for name, flags in [
        *LAYOUTS.items(),
        ("lora-ddp", ("--gpus", "2", *LORA)),
        ("lora-zero3", ("--gpus", "2", "--zero", "3", *LORA)),
    ]:
        runs[name] = tmp / name
        train(runs[name], "--cpu", *flags, config=run_file)
    return runs


def _steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["type"] == "train"]


KEYS = ("loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length")


def _assert_same(run: Path, reference: Path) -> None:
    got, want = _steps(run), _steps(reference)
    assert [r["step"] for r in got] == [1, 2, 3, 4] == [r["step"] for r in want]
    for mine, theirs in zip(got, want, strict=True):
        # the same completions: their rewards and lengths equal exactly (logged at the steps that
        # sample them, 1 and 3, as TRL's: the second iteration of a batch samples none)
        assert ("reward" in mine) == ("reward" in theirs) == (mine["step"] % 2 == 1)
        for key in ("reward", "reward_std", "completions/mean_length"):
            assert mine.get(key) == theirs.get(key), (run.name, mine["step"], key)
        for key in ("loss", "kl", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), (run.name, mine["step"], key)


@pytest.mark.parametrize("layout", ["one-rank", "zero1", "zero2", "zero3", "fsdp2", "ddp-chunked"])
def test_every_layout_samples_the_same_completions_and_trains_as_ddp(grpo_runs, layout):
    _assert_same(grpo_runs[layout], grpo_runs["ddp"])


def test_lora_under_zero3_trains_as_lora_under_ddp(grpo_runs):
    _assert_same(grpo_runs["lora-zero3"], grpo_runs["lora-ddp"])
    header = read_metrics(grpo_runs["lora-zero3"])[0]
    assert header["reference"]["kind"] == "the policy with its adapters disabled"


def test_the_run_learns_something_and_logs_trls_metrics(grpo_runs):
    steps = _steps(grpo_runs["ddp"])
    for key in (
        *KEYS, "rewards/varied/mean", "rewards/format/std", "frac_reward_zero_std",
        "clip_ratio/region_mean", "completions/clipped_ratio",
    ):  # fmt: skip
        assert key in steps[0], key
    # the rewards spread, so the advantages are not 0; at a batch's first step the ratio is 1
    # and equal-length groups make the loss about 0, at its second the ratio and the KL move it
    assert steps[0]["reward_std"] > 0
    assert abs(steps[1]["loss"]) > 1e-3 and abs(steps[3]["loss"]) > 1e-3
    # the policy starts at the reference (KL 0) and moves away from it
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0 and steps[3]["kl"] > 0.0
    # a few completions with their rewards, at the steps that sample
    shown = [r for r in read_metrics(grpo_runs["ddp"]) if r["type"] == "completions"]
    assert [r["step"] for r in shown] == [1, 3]
    assert len(shown[0]["completions"]) == 2 and {"prompt", "completion", "reward"} <= set(
        shown[0]["completions"][0]
    )
    export = grpo_runs["ddp"] / "model"
    assert (export / "config.json").is_file() and not list(export.glob("*reference*"))


def test_a_run_stopped_inside_a_batchs_iterations_resumes_exactly(grpo_runs, tmp_path):
    run_file = varied_run_file(tmp_path)
    run = tmp_path / "run"
    # step 3 is the first of the second batch's two: the checkpoint keeps that batch
    train(run, "--cpu", "--gpus", "2", "--set", "train.stop_after_steps=3", config=run_file)
    assert list((run / "checkpoints" / "step-3").glob("grpo-rollout-rank*.pt"))
    train(run, "--cpu", "--gpus", "2", "--resume", "auto", config=run_file)
    resumed = {r["step"]: r for r in _steps(run)}
    for straight in _steps(grpo_runs["ddp"]):
        mine = resumed[straight["step"]]
        for key in ("loss", "kl"):
            assert mine[key] == pytest.approx(straight[key], abs=1e-5), (straight["step"], key)


def test_a_reward_function_failing_during_the_run_stops_it_in_one_line(tmp_path):
    (tmp_path / "bad_rewards.py").write_text(
        "def short(prompts, completions, **columns):\n    return [0.0]\n"
    )
    run_file = grpo_run_file(tmp_path / "grpo.yaml", rewards=[f"{tmp_path}/bad_rewards.py:short"])
    result = run_dplaunch("train", run_file, "--cpu", "--gpus", "1", "-o", tmp_path / "run")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("[rank")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "short" in lines[0] and "at step 1" in lines[0] and "1 values for 8" in lines[0], lines


def test_dplaunch_data_shows_the_prompts_as_the_policy_reads_them(tmp_path):
    result = run_dplaunch("data", grpo_run_file(tmp_path / "grpo.yaml"), "--show", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    stats, (shown,) = report["stats"], report["examples"]
    assert stats["prompts"] == 1024 and stats["prompts_per_step"] == 2
    assert stats["steps_per_epoch"] == 1024 and stats["cut"] == 0
    assert shown["text"].endswith("=") and set(shown["columns"]) == {"answer"}
