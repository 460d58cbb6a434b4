"""train.report_to, offline: a real tiny run streams its metrics to TensorBoard event files, a wandb offline run
and an MLflow file store in the run folder, each read back from its files and compared with metrics.jsonl; a
resumed run continues the same runs; a missing library is named before any work."""

import glob
import json
import struct
import sys
from pathlib import Path

import pytest

from orpo.train.settings import train_settings

from orpo.train.tracking import Trackers, TrackingError, require

from conftest import shortest_pairs

SETTINGS = {"batch_size": 2, "max_steps": 4, "checkpoint_every": 2, "lr": 0.01, "lora": {"rank": 4, "alpha": 8},
            "report_to": ["tensorboard", "wandb", "mlflow"]}
WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks


def records(data: bytes, start: int, block: int):
    """Payloads of a log of [crc32 (4) | length (2) | type (1) | data] records, split across fixed-size blocks."""
    pos, pending = start, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        elif kind == 0 and length == 0:
            pos += (block - pos % block) % block


def events(path: Path) -> list:
    """The events of one TFRecord event file ([length (8) | crc (4) | event | crc (4)] records)."""
    from tensorboardX.proto import event_pb2

    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12:pos + 12 + n])
        out.append(event)
        pos += 12 + n + 4
    return out


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over a folder's event files."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in events(path):
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def wandb_history(run_file: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows = []
    for payload in records(data, 7, WANDB_BLOCK):
        r = wandb_internal_pb2.Record()
        r.ParseFromString(payload)
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def mlflow_metric(store: Path, name: str) -> dict[int, float]:
    """{step: value} of one metric in an MLflow file store (lines of `timestamp value step`)."""
    (path,) = glob.glob(str(store / "*" / "*" / "metrics" / name))
    return {int(s): float(v) for _, v, s in (ln.split() for ln in Path(path).read_text().splitlines())}


@pytest.fixture(scope="module")
def tracked_run(tiny_base, tiny_rendered, tmp_path_factory) -> Path:
    from orpo.train.trainer import train

    mp = pytest.MonkeyPatch()
    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        mp.delenv(var, raising=False)
    root = tmp_path_factory.mktemp("tracked")
    try:
        train(tiny_base, shortest_pairs(tiny_rendered, root / "rendered"), root / "run", train_settings(SETTINGS))
    finally:
        mp.undo()
    return root / "run"


def logged(run: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    index = json.loads((run / "index.json").read_text())
    validation = {0: index["baseline"], **{int(k): v["validation"] for k, v in index["checkpoints"].items()}}
    return {x["step"]: x for x in lines if x["split"] == "train"}, validation


def test_tensorboard_event_files_hold_every_step_and_validation(tracked_run):
    train, validation = logged(tracked_run)
    scalars = tensorboard_scalars(tracked_run / "tensorboard")
    assert set(scalars["train/loss"]) == {1, 2, 3, 4} and set(scalars["validation/loss"]) == {0, 2, 4}
    for step, m in train.items():  # event files store float32
        for key in ("loss", "accuracy", "lr", "tokens_per_s", "grad_norm"):
            assert scalars[f"train/{key}"][step] == pytest.approx(m[key], rel=1e-6, abs=1e-9), (key, step)
    for step, v in validation.items():
        assert scalars["validation/margin"][step] == pytest.approx(v["margin"], rel=1e-6, abs=1e-9)


def test_wandb_offline_run_holds_the_metrics(tracked_run):
    train, validation = logged(tracked_run)
    (run_file,) = glob.glob(str(tracked_run / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(Path(run_file))
    steps = {row["_step"]: row for row in history}
    assert {s: steps[s]["train/loss"] for s in train} == {s: m["loss"] for s, m in train.items()}
    assert {s: steps[s]["validation/accuracy"] for s in validation} == {s: v["accuracy"] for s, v in validation.items()}
    ids = json.loads((tracked_run / "tracking.json").read_text())
    assert run_file.endswith(f"run-{ids['wandb']}.wandb")


def test_mlflow_file_store_holds_the_metrics_and_settings(tracked_run):
    train, validation = logged(tracked_run)
    store = tracked_run / "mlruns"
    assert mlflow_metric(store, "train/loss") == {s: m["loss"] for s, m in train.items()}
    assert mlflow_metric(store, "validation/nll") == {s: v["nll"] for s, v in validation.items()}
    run_id = json.loads((tracked_run / "tracking.json").read_text())["mlflow"]
    params = store.glob(f"*/{run_id}/params")
    folder = next(params)
    assert (folder / "lr").read_text() == "0.01" and (folder / "lora.rank").read_text() == "4"


def test_a_resumed_run_continues_the_same_runs(tmp_path, monkeypatch):
    for var in ("WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    record = {"settings": {"lr": 0.1}}
    with Trackers(["tensorboard", "wandb", "mlflow"], tmp_path, record, 0) as t:
        for step in (1, 2, 3):
            t.log({"loss": 1.0 / step, "split": "train"}, step, "train")
    first = json.loads((tmp_path / "tracking.json").read_text())
    with Trackers(["tensorboard", "wandb", "mlflow"], tmp_path, record, 2) as t:  # killed after 3, resumed from 2
        t.log({"loss": 0.25}, 3, "train")
    assert json.loads((tmp_path / "tracking.json").read_text()) == first
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / f"run-{first['wandb']}.wandb")))
    assert len(runs) == 2  # one offline folder per process, one run id: `wandb sync` uploads both into it
    # MLflow: the same run, the resumed step's value last.
    (path,) = glob.glob(str(tmp_path / "mlruns" / "*" / first["mlflow"] / "metrics" / "train" / "loss"))
    assert [ln.split()[1:] for ln in Path(path).read_text().splitlines()][-1] == ["0.25", "3"]
    # TensorBoard: the second writer starts with a purge at step 3, so readers drop the first run's step 3.
    from tensorboardX.proto import event_pb2

    later = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))[-1]
    starts = [e.step for e in events(later) if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [3]
    assert [(e.step, e.summary.value[0].simple_value) for e in events(later) if e.summary.value] == [(3, 0.25)]


def test_a_missing_library_is_named_before_any_work(tiny_base, tmp_path, monkeypatch):
    from orpo.train.trainer import train

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # what an environment without it imports
    with pytest.raises(TrackingError, match=r"report_to: tensorboard needs the tensorboardX package.*pip install "
                                            r"tensorboardX"):
        train(tiny_base, tmp_path / "no-rendered-needed", tmp_path / "run", train_settings({"report_to": ["tensorboard"]}))
    assert not (tmp_path / "run.partial").exists()
    require(["wandb", "mlflow"])  # installed here: no error
