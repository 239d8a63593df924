"""The catalogue of user mistakes: each is one line naming the field and the fix, exit code 2,
no traceback, and nothing written. Every case runs the `dplaunch` command line through its main()
in this process (tests/helpers.run_cli); a few run it as a process too, as a user's shell does."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.helpers import (
    DEFAULT_CONFIG,
    SFT_CONFIG,
    TINY_LLAMA,
    child_environment,
    files_under,
    refusal_line,
    run_cli,
    run_dplaunch,
    write_config,
)


def _bad_yaml(tmp: Path) -> list:
    path = tmp / "bad.yaml"
    path.write_text("model:\n  config: {model_type: llama\ndata: [\n")
    return ["train", path]


def _list_yaml(tmp: Path) -> list:
    path = tmp / "list.yaml"
    path.write_text("- a\n- b\n")
    return ["train", path]


def _latin1_yaml(tmp: Path) -> list:
    path = tmp / "latin1.yaml"
    path.write_bytes("# a run file saved as Latin-1\nname: café\n".encode("latin-1"))
    return ["train", path]


def _declared_format_mismatch(tmp: Path) -> list:
    path = tmp / "pc.jsonl"
    path.write_text('{"prompt": "Review: ok. ", "completion": "positive"}\n' * 20)
    sets = [f"data.dataset={path}", "data.eval_dataset=null", "data.format=conversational"]
    return ["train", SFT_CONFIG, *[part for s in sets for part in ("--set", s)]]


def _tiny(tmp: Path, **sections) -> Path:
    return write_config(tmp / "run.yaml", **sections)


def _no_config_json(tmp: Path) -> list:
    (tmp / "empty-model").mkdir()
    return [
        "train",
        TINY_LLAMA,
        "--set",
        "model.config=null",
        "--set",
        f"model.name_or_path={tmp / 'empty-model'}",
    ]


def _busy_port(tmp: Path) -> list:
    return [
        "train",
        TINY_LLAMA,
        "--cpu",
        "--gpus",
        "2",
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--master-port",
        str(BUSY_PORT),
    ]


def _existing_run(tmp: Path) -> list:
    run = tmp / "out"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    return ["train", TINY_LLAMA, "-o", run]


def _existing_checkpointed_run(tmp: Path) -> list:
    argv = _existing_run(tmp)
    (tmp / "out" / "checkpoints").mkdir()
    return argv


def _output_under_a_file(tmp: Path) -> list:
    (tmp / "afile").write_text("x")
    return ["train", TINY_LLAMA, "-o", tmp / "afile" / "run"]


def _model_with_its_own_code(tmp: Path) -> list:
    model = tmp / "custom-model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "my-llama", "auto_map": {"AutoModelForCausalLM": "modeling.MyLlama"}}'
    )
    (model / "modeling.py").write_text("raise SystemExit('this must never run')\n")
    return [
        "train",
        TINY_LLAMA,
        "--set",
        "model.config=null",
        "--set",
        f"model.name_or_path={model}",
    ]


def _launch_into_sysfs(tmp: Path) -> list:
    (tmp / "script.py").write_text("print('never started')\n")
    return ["launch", tmp / "script.py", "--cpu", "-o", "/sys/dplaunch-run"]


BUSY_PORT = 0
# a 2-node job rendered to stdout: only the SLURM values below are wrong
SLURM_JOB = ["--gpus", "8", "--nodes", "2", "--out", "-"]

# (id, argv builder, text the one line must contain)
CASES = [
    ("config-missing", lambda t: ["train", t / "nope.yaml"], "CONFIG: "),
    ("config-is-a-directory", lambda t: ["train", t], "is a directory"),
    ("config-not-yaml", _bad_yaml, "not valid YAML at line"),
    ("config-not-a-mapping", _list_yaml, "must hold a mapping"),
    (
        "unknown-top-level-key",
        lambda t: ["train", _tiny(t, optimiser={"name": "adam"})],
        "optimiser: unknown key",
    ),
    (
        "unknown-nested-key",
        lambda t: ["train", TINY_LLAMA, "--set", "train.lrr=1"],
        "train.lrr: unknown key — did you mean train.lr? known keys here: checkpoint_every,",
    ),
    (
        "shortened-key",
        lambda t: ["train", TINY_LLAMA, "--set", "parallel.zero=2"],
        "parallel.zero: unknown key — did you mean parallel.zero_stage? known keys here: auto,",
    ),
    (
        "unknown-key-like-none",
        lambda t: ["train", TINY_LLAMA, "--set", "train.foo=1"],
        "train.foo: unknown key — known keys here: checkpoint_every,",
    ),
    (
        "wrong-type",
        lambda t: ["train", TINY_LLAMA, "--set", "train.lr=fast"],
        "train.lr: 'fast' is invalid",
    ),
    (
        "out-of-range",
        lambda t: ["train", TINY_LLAMA, "--set", "train.global_batch_size=0"],
        "train.global_batch_size",
    ),
    (
        "bad-set-syntax",
        lambda t: ["train", TINY_LLAMA, "--set", "train.lr"],
        "--set: 'train.lr' is not key.path=value",
    ),
    (
        "batch-not-divisible",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "3"],
        "not divisible by the data-parallel size 3",
    ),
    (
        "micro-larger-than-global",
        lambda t: ["train", TINY_LLAMA, "--micro-batch", "16"],
        "micro_batch_size 16 is larger",
    ),
    ("config-without-out", lambda t: ["config", TINY_LLAMA], "--out: no directory"),
    (
        "config-out-and-output-dir-differ",
        lambda t: ["config", TINY_LLAMA, "--out", t / "a", "-o", t / "b"],
        "name two directories",
    ),
    ("zero-gpus", lambda t: ["train", TINY_LLAMA, "--gpus", "0"], "launch.gpus: 0 ranks requested"),
    ("negative-gpus", lambda t: ["train", TINY_LLAMA, "--set", "launch.gpus=-2"], "launch.gpus"),
    (
        "more-gpus-than-visible",
        lambda t: ["train", TINY_LLAMA, "--gpus", "4"],
        "4 GPUs requested but this machine shows 2",
    ),
    (
        "bad-zero-stage",
        lambda t: ["train", TINY_LLAMA, "--set", "parallel.zero_stage=5"],
        "parallel.zero_stage",
    ),
    (
        "impossible-mesh",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "4", "--tp", "3"],
        "does not divide 4 GPUs",
    ),
    (
        "pp-with-zero3",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "2", "--pp", "2", "--zero", "3"],
        "ZeRO-3 cannot be combined with pipeline",
    ),
    (
        "compile-with-pp",
        lambda t: [
            "train",
            TINY_LLAMA,
            "--cpu",
            "--gpus",
            "2",
            "--pp",
            "2",
            "--set",
            "train.compile=true",
        ],
        "train.compile: torch.compile is applied to DDP and ZeRO models only",
    ),
    (
        "tp-not-dividing-heads",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "4", "--tp", "4"],
        "does not divide the model's 2 KV heads",
    ),
    (
        "pp-unsupported-family",
        lambda t: ["train", DEFAULT_CONFIG, "--cpu", "--gpus", "2", "--pp", "2"],
        "not supported for 'bert'",
    ),
    (
        "pp-more-stages-than-layers",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "8", "--pp", "8"],
        "more stages than the model's 4 layers",
    ),
    (
        "offload-without-zero",
        lambda t: ["train", TINY_LLAMA, "--offload", "optimizer"],
        "optimizer offload needs ZeRO",
    ),
    (
        "fp16-on-cpu",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--mixed-precision", "fp16"],
        "fp16 needs GPUs",
    ),
    (
        "model-dir-missing",
        lambda t: [
            "train",
            TINY_LLAMA,
            "--set",
            "model.config=null",
            "--set",
            f"model.name_or_path={t}/no-model",
        ],
        "does not exist",
    ),
    ("model-dir-without-config-json", _no_config_json, "has no config.json"),
    (
        "model-config-without-type",
        lambda t: ["train", _tiny(t, model={"config": {"hidden_size": 8}})],
        "model_type",
    ),
    (
        "dataset-missing",
        lambda t: ["train", TINY_LLAMA, "--set", f"data.dataset={t}/nope.jsonl"],
        "data.dataset: ",
    ),
    (
        "text-column-missing",
        lambda t: ["train", TINY_LLAMA, "--set", "data.text_column=body"],
        "data.text_column: column 'body'",
    ),
    (
        "label-column-missing",
        lambda t: ["train", DEFAULT_CONFIG, "--set", "data.label_column=stars"],
        "data.label_column: column 'stars'",
    ),
    (
        "eval-split-missing",
        lambda t: [
            "train",
            TINY_LLAMA,
            "--set",
            "data.eval_fraction=null",
            "--set",
            "data.eval_split=validation",
        ],
        "data.eval_split",
    ),
    ("output-dir-under-a-file", _output_under_a_file, "output_dir: "),
    # root may write anywhere os.access looks; sysfs refuses new files even to root
    (
        "output-dir-unwritable",
        lambda t: ["train", TINY_LLAMA, "-o", "/sys/dplaunch-run"],
        "output_dir: cannot create files in /sys",
    ),
    (
        "launch-output-dir-unwritable",
        _launch_into_sysfs,
        "output_dir: cannot create files in /sys",
    ),
    ("model-code-not-trusted", _model_with_its_own_code, "model.trust_remote_code: "),
    (
        "output-dir-holds-a-run",
        _existing_run,
        "already holds a run (metrics.jsonl) — choose another --output-dir (it holds no checkpoint",
    ),
    (
        "output-dir-holds-a-checkpointed-run",
        _existing_checkpointed_run,
        "already holds a run (metrics.jsonl, checkpoints) — pass --resume auto to continue it",
    ),
    ("port-in-use-multi-node", _busy_port, "port"),
    (
        "node-rank-too-large",
        lambda t: ["train", TINY_LLAMA, "--cpu", "--gpus", "2", "--nodes", "2", "--node-rank", "2"],
        "launch.node_rank",
    ),
    (
        "slurm-bad-time",
        lambda t: ["slurm", TINY_LLAMA, *SLURM_JOB, "--time", "abc"],
        "--time: 'abc' is not a SLURM time",
    ),
    (
        "slurm-job-name-with-slash",
        lambda t: ["slurm", TINY_LLAMA, *SLURM_JOB, "--job-name", "a/b"],
        "--job-name: 'a/b' contains '/'",
    ),
    (
        "slurm-zero-cpus-per-gpu",
        lambda t: ["slurm", TINY_LLAMA, *SLURM_JOB, "--cpus-per-gpu", "0"],
        "--cpus-per-gpu: 0",
    ),
    ("launch-script-missing", lambda t: ["launch", t / "nope.py", "--cpu"], "SCRIPT: "),
    (
        "run-file-not-utf8",
        _latin1_yaml,
        "CONFIG: {tmp}/latin1.yaml is not UTF-8 text (byte 0xe9 at line 2, column 10) — save "
        "the run file as UTF-8",
    ),
    (
        "format-conversational-on-prompt-completion",
        _declared_format_mismatch,
        "data.format: is conversational, which needs a 'messages' (or ShareGPT 'conversations') "
        "column, but the first record of {tmp}/pc.jsonl has the columns completion, prompt — "
        "remove data.format (these columns say prompt-completion)",
    ),
]


@pytest.fixture(scope="module")
def busy_port():
    global BUSY_PORT
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        BUSY_PORT = sock.getsockname()[1]
        yield BUSY_PORT


@pytest.mark.parametrize("builder,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, busy_port, builder, expected):
    argv = builder(tmp_path)
    if argv[0] == "train" and "-o" not in argv:
        argv += ["-o", tmp_path / "run"]
    before = files_under(tmp_path)
    result = run_cli(*argv, env=child_environment(CUDA_VISIBLE_DEVICES="0,1"), timeout=60)
    line = refusal_line(result, expected.replace("{tmp}", str(tmp_path)))
    assert " — " in line or "unknown key" in line or ":" in line
    assert files_under(tmp_path) == before, "something was written"


# refused by the run file's schema, by the plan, and by a command's own option
IN_A_PROCESS = ("unknown-nested-key", "impossible-mesh", "slurm-bad-time")


@pytest.mark.parametrize(
    "builder,expected",
    [c[1:] for c in CASES if c[0] in IN_A_PROCESS],
    ids=[c[0] for c in CASES if c[0] in IN_A_PROCESS],
)
def test_bad_input_in_a_process_is_one_line_exit_2_and_no_traceback(
    tmp_path, busy_port, builder, expected
):
    argv = [*builder(tmp_path), "-o", tmp_path / "run"]
    result = run_dplaunch(*argv, env=child_environment(CUDA_VISIBLE_DEVICES="0,1"), timeout=60)
    refusal_line(result, expected)
    assert files_under(tmp_path) == [], "something was written"


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 25
