"""The front page and the manual say what dplaunch does: the reference is generated, the site
builds strictly, the README's run file and one-liners are accepted, its numbers are the latest."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dplaunch.config.reference import missing_descriptions, render_reference
from tests.helpers import REPO, cache_hub_dataset, child_environment, free_port, run_dplaunch

README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference.md"
# the shapes of Qwen2.5-0.5B's config.json, the README's hub model, put into a temporary hub cache
QWEN_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )


def test_the_run_file_reference_is_the_generated_one():
    assert not missing_descriptions(), "give these keys a Field(description=...) in schema.py"
    assert REFERENCE.read_text() == render_reference(), (
        "docs/reference.md is stale: python -m dplaunch.config.reference > docs/reference.md"
    )


def test_every_key_and_flag_is_in_the_reference():
    import typer

    from dplaunch.cli import app

    text = REFERENCE.read_text()
    for key in ("train.lr", "parallel.zero_stage", "launch.gpus", "data.label_names", "name"):
        assert f"| `{key}` |" in text
    train = typer.main.get_command(app).commands["train"]
    flags = [opt for param in train.params for opt in param.opts if opt.startswith("--")]
    own = {"--dry-run", "--resume", "--start-over", "--set", "--help"}
    assert "--gpus" in flags and "--fsdp" in flags
    for flag in set(flags) - own:
        assert f"`{flag}`" in text, flag


def test_the_site_builds_strictly_and_a_broken_anchor_fails_it(tmp_path):
    built = mkdocs_build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()
    broken = tmp_path / "broken"
    shutil.copytree(REPO / "docs", broken / "docs")
    shutil.copy(REPO / "mkdocs.yml", broken)
    with (broken / "docs" / "gpu.md").open("a") as page:
        page.write("\n[resume](checkpoints.md#no-such-section)\n")
    failed = mkdocs_build(broken, tmp_path / "site2")
    assert failed.returncode != 0
    assert "no-such-section" in failed.stdout + failed.stderr


def test_the_readme_is_a_front_page_with_the_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text  # CI runs the README's test command
    for page in re.findall(r"\]\(docs/([\w-]+\.md)", text):
        assert (REPO / "docs" / page).exists(), page


def test_the_readme_run_file_and_one_liners_plan_for_16_gpus(tmp_path):
    """The hub model's config and the dataset sit in a temporary offline cache, as on a cluster."""
    readme = README.read_text()
    block = re.search(r"```yaml\n(# run\.yaml\n.*?)```", readme, re.S)
    assert block, "the README's complete run file starts with '# run.yaml'"
    run_file = tmp_path / "run.yaml"
    run_file.write_text(block.group(1))
    assert block.group(0) in (REPO / "docs" / "run-file.md").read_text()  # the manual's copy
    assert len(block.group(1).splitlines()) <= 25
    home = tmp_path / "hf"
    repo = home / "hub" / "models--Qwen--Qwen2.5-0.5B"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(QWEN_CONFIG))
    texts = ["the quick brown fox " * 100] * 400  # enough tokens for one packed global batch
    splits = {"train": {"text": texts}, "validation": {"text": texts[:20]}}
    cache_hub_dataset(home, "Salesforce/wikitext", "wikitext-2-raw-v1", splits)
    env = child_environment(HF_HOME=str(home))
    lines = re.findall(r"^dplaunch (?:train|plan) run\.yaml[^#\n]*", readme, re.M)
    assert any("--gpus 16 --dry-run" in line for line in lines)
    for line in lines:
        args = shlex.split(line)[1:]
        args[1] = str(run_file)
        if args[0] == "train" and "--dry-run" not in args:
            args.append("--dry-run")
        if "--nodes" in args and args[0] == "train":  # a busy 29500 is refused on several nodes
            args += ["--master-port", str(free_port())]
        result = run_dplaunch(*args, env=env, cwd=tmp_path)
        assert result.returncode == 0, f"{line}\n{result.stderr[-1000:]}"
    assert not (tmp_path / "runs").exists()  # dry runs write nothing


def test_the_readme_performance_table_has_the_latest_ratios():
    results = REPO / "benchmarks" / "results"
    table = {
        ("startup", "dplaunch / accelerate launch (--help)"),
        ("launch_overhead", "dplaunch train / accelerate launch (to first step)"),
        ("throughput", "DDP: dplaunch / HF Trainer"),
        ("throughput", "DDP: dplaunch / hand-written loop"),
        ("throughput", "ZeRO-2: dplaunch / HF Trainer"),
        ("throughput", "ZeRO-2: dplaunch / hand-written loop"),
        ("scaling", "2-rank efficiency: tokens/s(2) / (2 × tokens/s(1))"),
    }
    readme = README.read_text()
    performance = (REPO / "docs" / "performance.md").read_text()
    for name, ratio in table:
        value = json.loads((results / f"{name}.json").read_text())["ratios"][ratio]["value"]
        assert f"{value:.3f}" in readme, (name, ratio, value)
        assert f"{value:.3f}" in performance, (name, ratio, value)


# what accelerate's test script prints first, from an Accelerator as a user's script builds it
PROBE = """
from accelerate import Accelerator
state = Accelerator()
print(f"probe: {state.distributed_type.value} {state.num_processes}", flush=True)
"""


@pytest.mark.multiprocess
def test_accelerate_launch_of_a_cpu_run_needs_accelerate_use_cpu(tmp_path):
    """docs/training.md: `accelerate test --config_file RUN/accelerate.yaml` (accelerate-launch of
    its test script) on a CPU-rendered run forms no CPU world without ACCELERATE_USE_CPU=1: two
    processes each alone; with it, one MULTI_CPU world of 2. The probe prints the same state."""
    docs = (REPO / "docs" / "training.md").read_text()
    assert '"Distributed\nenvironment: NO, Num processes: 1"' in docs
    assert "With `ACCELERATE_USE_CPU=1`, which `launch.sh` exports" in docs
    readme = README.read_text()
    assert '("Distributed environment: NO, Num processes: 1")' in readme
    assert "only with `ACCELERATE_USE_CPU=1`, which `launch.sh` sets without DeepSpeed" in readme
    rendered = run_dplaunch(
        "config", REPO / "examples" / "tiny-llama.yaml", "--cpu", "--gpus", "2", "--out", tmp_path
    )
    assert rendered.returncode == 0, rendered.stderr
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launch += [str(tmp_path / "accelerate.yaml"), "--main_process_port", "0", str(probe)]
    seen = {}
    for use_cpu in (None, "1"):
        env = child_environment()
        env.pop("ACCELERATE_USE_CPU", None)
        if use_cpu:
            env["ACCELERATE_USE_CPU"] = use_cpu
        result = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        seen[use_cpu] = sorted(re.findall(r"probe: (\S+ \d+)", result.stdout))
    assert seen[None] == ["NO 1", "NO 1"]
    assert seen["1"] == ["MULTI_CPU 2", "MULTI_CPU 2"]


def test_the_lora_example_counts_what_its_run_prints():
    # before: docs/sft.md said 0.66 M parameters train, the run printed 197,504 of 854,784
    from dplaunch.config.load import load_run_config
    from dplaunch.train.lora import trained_line
    from dplaunch.train.modeling import load_model, load_tokenizer

    config = load_run_config(REPO / "configs" / "sft-lora.yaml")
    model = load_model(config.model, load_tokenizer(config.model), config.train.seed)
    printed = trained_line(model)
    counts = re.match(r"LoRA: ([\d,]+ of [\d,]+) parameters train \((\S+):", printed)
    assert counts, printed
    assert (
        f"`LoRA: {counts[1]} parameters train ({counts[2]}:" in (REPO / "docs/sft.md").read_text()
    )
    assert f"({counts[1]} parameters train:" in (REPO / "configs/sft-lora.yaml").read_text()


def test_the_docs_name_the_hub_cli_the_pinned_huggingface_hub_ships():
    # before: `huggingface-cli download …`, a command huggingface_hub no longer installs since 1.0
    import huggingface_hub

    assert int(huggingface_hub.__version__.split(".")[0]) >= 1  # `hf` only
    texts = [README, *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("dplaunch/**/*.py"))]
    named = [str(path.relative_to(REPO)) for path in texts if "huggingface-cli" in path.read_text()]
    assert not named, named
