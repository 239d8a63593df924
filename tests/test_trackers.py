"""train.report_to: TensorBoard, wandb (offline), MLflow (a file store) and Trackio (its local
database) get the run's config and exactly the scalars of metrics.jsonl, under the run's name; no
secret from the environment lands in the run directory. One shared 2-rank run, read back through
each tracker's own files."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_environment, read_metrics, run_dplaunch

SECRET = "wandb-key-that-must-not-be-written-0123456789"
TRACKED = [name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name)]
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        len(TRACKED) < 3, reason="make test puts wandb, mlflow-skinny and trackio in"
    ),
]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trackers") / "tracked-run"
    result = run_dplaunch(
        "train", "examples/tiny-llama.yaml", "--cpu", "--gpus", "2", "--max-steps", "4",
        "--set", "train.eval_every=2",
        "--set", "train.report_to=[tensorboard,wandb,mlflow,trackio]", "-o", run,
        env=child_environment(
            WANDB_MODE="offline", WANDB_API_KEY=SECRET, WANDB_SILENT="true",
            TRACKIO_DIR=str(run.parent / "trackio"), TRACKIO_PROJECT="dplaunch-test",
        ),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run


def expected_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's scalars as the trackers name them: `train/loss`, `eval/eval_loss`…"""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run):
        if "step" not in record or record["type"] == "header":
            continue
        for name, value in record.items():
            if name in ("type", "step") or not isinstance(value, (int, float)):
                continue
            series.setdefault(f"{record['type']}/{name}", []).append((record["step"], value))
    return series


def assert_same_series(logged: list, expected: list, tag: str) -> None:
    """The same steps, and the same values to float32 rounding (a tracker may store float32)."""
    assert [step for step, _ in logged] == [step for step, _ in expected], tag
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), tag


def test_mlflow_gets_the_config_and_the_scalars_of_metrics_jsonl(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the rank that wrote it

    client = MlflowClient(tracking_uri=(tracked_run / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("dplaunch")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == tracked_run.name
    assert (
        run.data.params["train.lr"] == "0.001"
        and run.data.params["model.config.hidden_size"] == "64"
    )
    expected = expected_scalars(tracked_run)
    assert {"train/loss", "train/lr", "eval/eval_loss"} <= expected.keys()
    for tag, values in expected.items():
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)]
        assert_same_series(sorted(logged), values, tag)


def test_wandb_offline_gets_the_config_and_the_scalars_of_metrics_jsonl(tracked_run):
    (offline,) = (tracked_run / "wandb").glob("offline-run-*")
    history, config, name = read_wandb_run(next(offline.glob("run-*.wandb")))
    assert name == tracked_run.name
    assert config["train.lr"] == 0.001 and config["model.config.hidden_size"] == 64
    expected = expected_scalars(tracked_run)
    for tag, values in expected.items():
        logged = [(row["_step"], row[tag]) for row in history if tag in row]
        assert_same_series(logged, values, tag)


def test_trackio_gets_the_config_and_the_scalars_of_metrics_jsonl(tracked_run):
    import subprocess
    import sys

    # trackio reads TRACKIO_DIR when imported: read its database in a process of its own
    code = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "print(json.dumps([S.get_logs('dplaunch-test', sys.argv[1]), "
        "S.get_run_config('dplaunch-test', sys.argv[1])], default=str))"
    )
    read = subprocess.run(
        [sys.executable, "-c", code, tracked_run.name],
        env=child_environment(TRACKIO_DIR=str(tracked_run.parent / "trackio")),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    logs, config = json.loads(read.stdout.strip().splitlines()[-1])
    assert config["train.lr"] == 0.001 and config["model.config.hidden_size"] == 64
    expected = expected_scalars(tracked_run)
    # an evaluation shares its step with a training record: both must be kept
    assert {step for step, _ in expected["eval/eval_loss"]} & {
        step for step, _ in expected["train/loss"]
    }
    for tag, values in expected.items():
        logged = [(row["step"], row[tag]) for row in logs if tag in row]
        assert_same_series(logged, values, tag)


def test_no_secret_of_the_environment_is_written_to_the_run_directory(tracked_run):
    for path in tracked_run.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def read_wandb_run(path: Path) -> tuple[list[dict], dict, str]:
    """(history rows, config, run name) of an offline wandb run file: a LevelDB-style log of
    protobuf Records (7-byte file header, 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()[7:]
    block, payloads, partial, offset = 32768, [], b"", 0
    first_block = block - 7
    while offset + 7 <= len(data):
        room = (
            (first_block - offset)
            if offset < first_block
            else block - (offset - first_block) % block
        )
        if room < 7:  # the block's tail is padding
            offset += room
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        partial += chunk
        if kind in (1, 4):  # FULL or LAST
            payloads.append(partial)
            partial = b""
    history, config, name = [], {}, ""
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # wandb-core names a key in nested_key (the older `key` stays empty)
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "run":
            name = record.run.display_name
    return history, config, name


def test_tensorboard_gets_the_scalars_of_metrics_jsonl(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tracked_run / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    expected = expected_scalars(tracked_run)
    assert {"train/loss", "train/lr", "eval/eval_loss"} <= expected.keys()
    for tag, values in expected.items():
        logged = [(event.step, event.value) for event in board.Scalars(tag)]
        assert_same_series(logged, values, tag)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="checks a process that could load it"
)
def test_the_tensorboard_writer_does_not_load_tensorflow(tmp_path):
    # TensorBoard's writer loads TensorFlow for its file API whenever it is installed (about 3 s of
    # a rank's start-up, measured); rank 0's writer uses tensorboard's own stub instead
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dplaunch.train.metrics import MetricsWriter\n"
        "writer = MetricsWriter(Path(sys.argv[1]), True)\n"
        "writer.write('train', step=1, loss=2.5)\n"
        "writer.close()\n"
        "print('tensorflow' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [(1, 2.5)]


def test_one_tracker_may_be_named_as_a_string_as_transformers_takes_it():
    # before: "train.report_to: Input should be a valid list"
    from dplaunch.config.schema import TrainConfig

    assert TrainConfig(report_to="wandb").report_to == ["wandb"]
    assert TrainConfig(report_to="none").report_to == []
    assert TrainConfig(report_to=["tensorboard", "mlflow"]).report_to == ["tensorboard", "mlflow"]
