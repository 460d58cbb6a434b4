"""Experiment tracking (`train.report_to`): every training step's metrics and every validation streamed to
TensorBoard event files, Weights & Biases and MLflow, through those libraries, into the run folder.

- tensorboard: `<run>/tensorboard/` (tensorboardX's writer); `tensorboard --logdir results/train/run/tensorboard`.
- wandb: offline unless WANDB_MODE says otherwise (nothing leaves the machine): `<run>/wandb/offline-run-*`,
  uploaded later with `wandb sync`. WANDB_PROJECT names the project (default orpo).
- mlflow: a file store `<run>/mlruns` (`mlflow ui --backend-store-uri results/train/run/mlruns`), or the
  server or store MLFLOW_TRACKING_URI names. MLFLOW_EXPERIMENT_NAME names the experiment (default orpo).

Scalars are named `train/<metric>` and `validation/<metric>` at their optimizer step (step 0: the baseline
validation). A resumed run continues the same wandb and MLflow runs (their ids are kept in
`<run>/tracking.json`) and drops TensorBoard's events after the resume point.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

# The module each backend imports, and what to install when it is missing.
MODULES = {"tensorboard": ("tensorboardX", "tensorboardX"), "wandb": ("wandb", "wandb"),
           "mlflow": ("mlflow", "mlflow-skinny (or mlflow)")}
IDS_FILE = "tracking.json"


def final_folder(work: Path) -> Path:
    """The run folder the work folder (`<run>.partial`) becomes when the run completes."""
    return work.with_name(work.name.removesuffix(".partial"))


class TrackingError(RuntimeError):
    """A requested tracking backend cannot run (its library is missing)."""


def require(names: Iterable[str]) -> None:
    """Fail before any work when a backend in `names` (train.report_to) has no library installed."""
    for name in names:
        module, package = MODULES[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise TrackingError(f"train.report_to: {name} needs the {package} package, which is not installed "
                                f"({e}); install it (`pip install {package.split()[0]}`, or the project's "
                                "`tracking` extra) or drop it from train.report_to") from None


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (booleans and strings, like `split`, left out), step excluded."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys (lora.rank, engine.head, ...), what hyperparameter tables show."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The backends of train.report_to, open on one run folder; `log` sends one step's scalars to each."""

    def __init__(self, names: Iterable[str], folder: Path, record: dict[str, Any], start: int):
        names = list(dict.fromkeys(names))
        require(names)
        self.folder, self.start = Path(folder), start
        ids_path = self.folder / IDS_FILE
        ids = json.loads(ids_path.read_text()) if start and ids_path.exists() else {}
        settings = record["settings"]
        kinds = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}
        self.backends = [kinds[name](self.folder, settings, start, ids.get(name)) for name in names]
        kept = {b.name: b.run_id for b in self.backends if b.run_id}
        if kept:
            ids_path.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")

    def log(self, metrics: dict[str, Any], step: int, split: str) -> None:
        """One step's numeric metrics as `<split>/<name>` scalars at `step`."""
        values = {f"{split}/{k}": v for k, v in numeric(metrics).items()}
        for b in self.backends:
            b.log(values, step)

    def flush(self) -> None:
        for b in self.backends:
            b.flush()

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, kind, value, tb) -> None:
        for b in self.backends:
            b.close(failed=kind is not None)


class _Backend:
    """What every tracker does unless it says otherwise: nothing to flush (each log is written when called)."""

    def flush(self) -> None:
        pass


class _TensorBoard(_Backend):
    name = "tensorboard"

    def __init__(self, folder: Path, settings: dict[str, Any], start: int, run_id: str | None):
        from tensorboardX import SummaryWriter

        # purge_step: TensorBoard hides what the killed run logged after the checkpoint it resumes from.
        self.writer = SummaryWriter(logdir=str(folder / "tensorboard"), purge_step=start + 1 if start else None)
        self.run_id = None
        if not start:
            self.writer.add_text("settings", "```json\n" + json.dumps(settings, indent=2, sort_keys=True) + "\n```", 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Wandb(_Backend):
    name = "wandb"

    def __init__(self, folder: Path, settings: dict[str, Any], start: int, run_id: str | None):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "orpo"), dir=str(folder), config=settings,
            mode=os.environ.get("WANDB_MODE", "offline"), id=run_id, resume="allow" if run_id else None,
            # Our stdout and stderr stay ours (Snakemake logs them): wandb neither wraps the console nor prints
            # its footer, which would name the work folder; close() names the run folder instead.
            settings=wandb.Settings(console="off", quiet=True))
        self.run_id, self.offline = self.run.id, self.run.settings.mode in ("offline", "dryrun")
        self.where = final_folder(folder) / Path(self.run.dir).parent.relative_to(folder)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        if self.offline:
            print(f"wandb: offline run {self.where}; upload it with `wandb sync {self.where}`", file=sys.stderr)


class _Mlflow(_Backend):
    name = "mlflow"

    def __init__(self, folder: Path, settings: dict[str, Any], start: int, run_id: str | None):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{(folder / 'mlruns').resolve()}"
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; a store inside the run folder is what is asked for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "orpo")
            experiment = self.client.get_experiment_by_name(name)
            # Artifacts (none are logged) would go under the run folder, not the work folder it is renamed from.
            artifacts = (final_folder(folder) / "mlruns" / "artifacts").resolve().as_uri()
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(name, artifact_location=artifacts))
            run_id = self.client.create_run(experiment_id, run_name=folder.name.removesuffix(".partial")).info.run_id
            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flat(settings).items()]
            self.client.log_batch(run_id, params=params)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
