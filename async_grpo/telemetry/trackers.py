"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow, trackio.

MetricsLogger (metrics.py) owns them on rank 0 and hands each one every step's record under its
own names (`reward/mean`, `timing/step_s`, ...; MLflow refuses `@`, so eval/pass@k is
eval/pass_at_k there), the run's config (run_dir/config.yaml) at start and the reward plot (a
PNG) at the end. Every tracker stays on this machine: W&B runs offline into run_dir/wandb
(`wandb sync` uploads it later), MLflow writes to an SQLite file under run_dir/mlflow (MLflow's
own default backend), trackio to its local database; W&B's and MLflow's usage telemetry is kept
off too. A tracker that cannot start, or fails later, is reported in one line and dropped; the
run goes on with the others and metrics.jsonl, which is always written (docs/trackers.md).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

TRACKER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
# MLflow allows alphanumerics and `_ - . space : /` in metric names (mlflow.utils.validation);
# `eval/pass@k` is the one key of ours outside that set, logged there as `eval/pass_at_k`.
_MLFLOW_KEY_REPLACEMENTS = {"@": "_at_"}
_MLFLOW_PARAMS_PER_BATCH = 100  # MlflowClient.log_batch's limit on params per call
_MLFLOW_PARAM_MAX_CHARS = 6000  # MLflow 3's longest param value; longer values are cut (the
# whole config also goes up as the config.yaml artifact)
_MLFLOW_DB = "mlflow.db"
_MLFLOW_STEPS_IN_FLIGHT = 2  # steps whose metrics MLflow may still be writing in the background
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class Tracker(Protocol):
    """One experiment tracker: a run opened at construction, closed by close()."""

    name: str

    def log(self, step: int, record: dict[str, float]) -> None:
        """Every metric of one step, keyed as in metrics.jsonl."""

    def log_plot(self, path: Path) -> None:
        """The run's reward plot (a PNG), as an artifact or image."""

    def close(self) -> None:
        """Finish the run (flush and release files)."""


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config sections as dotted keys (`optim.lr`), for trackers whose params are flat."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def mlflow_key(key: str) -> str:
    """A metric key as MLflow accepts it (only `@` differs among ours: eval/pass@4 -> eval/pass_at_4)."""
    for old, new in _MLFLOW_KEY_REPLACEMENTS.items():
        key = key.replace(old, new)
    return key


class TensorBoardTracker:
    """run_dir/tensorboard; a resumed run hides its events of steps >= resume_step (purge_step)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step)
        self._last_step = 0

    def log(self, step: int, record: dict[str, float]) -> None:
        for key, value in record.items():
            self._writer.add_scalar(key, value, step)
        self._last_step = step

    def log_plot(self, path: Path) -> None:
        import matplotlib.image

        # HWC uint8/float RGBA from the PNG; TensorBoard shows it under Images at the last step.
        self._writer.add_image("reward_plot", matplotlib.image.imread(str(path)), self._last_step, dataformats="HWC")

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run under run_dir/wandb, offline unless mode says online. Each trainer start is its
    own W&B run (a resumed run's name ends in `-resumed-at-N`); the reward plot is a `plot`
    artifact named `reward_plot`."""

    name = "wandb"

    def __init__(self, run_dir: Path, *, project: str, run_name: str, mode: str, config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        directory = run_dir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        # console off: W&B would otherwise wrap the trainer's stdout/stderr to capture them.
        settings = wandb.Settings(mode=mode, console="off", silent=True)
        # The mode goes to the process-wide settings too: W&B's own usage telemetry reads those,
        # not the run's, and would otherwise try to reach its server from an offline run.
        wandb.setup(settings=settings)
        self._run = wandb.init(project=project, name=run_name, dir=str(directory), config=config,
                               settings=settings)

    def log(self, step: int, record: dict[str, float]) -> None:
        self._run.log(record, step=step)

    def log_plot(self, path: Path) -> None:
        artifact = self._wandb.Artifact("reward_plot", type="plot")
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run. Tracking URI "" means MLflow's default backend, an SQLite file, placed at
    run_dir/mlflow/mlflow.db with artifacts in run_dir/mlflow/artifacts. The config goes up as
    params (dotted keys) and as the config.yaml artifact; the reward plot as an artifact."""

    name = "mlflow"

    def __init__(self, run_dir: Path, *, project: str, run_name: str, tracking_uri: str,
                 config: dict[str, Any], config_path: Path | None) -> None:
        # MLflow sends usage telemetry unless this is set; it reads the variable when the client
        # is set up (at import), so it is set first. A user's own setting wins.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow.telemetry
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        mlflow.telemetry.set_telemetry_client()  # again, in case mlflow was imported before
        artifact_location = None
        if not tracking_uri:
            root = (run_dir / "mlflow").resolve()
            root.mkdir(parents=True, exist_ok=True)
            tracking_uri = f"sqlite:///{root / _MLFLOW_DB}"
            artifact_location = (root / "artifacts").as_uri()
        self._client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._client.create_experiment(project, artifact_location=artifact_location))
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self._pending: collections.deque = collections.deque()
        params = [Param(key, str(value)[:_MLFLOW_PARAM_MAX_CHARS]) for key, value in flatten_config(config).items()]
        for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start:start + _MLFLOW_PARAMS_PER_BATCH])
        if config_path is not None:
            self._client.log_artifact(self.run_id, str(config_path))

    def log(self, step: int, record: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(key), float(value), now_ms, step) for key, value in record.items()]
        # Asynchronous: MLflow's own thread commits the batch to its database (~30-50 ms a step
        # on 2 busy cores when done inline, benchmarks/trackers.py). Waiting on the batch from
        # _MLFLOW_STEPS_IN_FLIGHT steps ago bounds the backlog and raises its failure here.
        self._pending.append(self._client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        if len(self._pending) > _MLFLOW_STEPS_IN_FLIGHT:
            self._pending.popleft().wait()

    def log_plot(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        while self._pending:
            self._pending.popleft().wait()  # raises what the background write met
        self._client.set_terminated(self.run_id)


class TrackioTracker:
    """A trackio run in trackio's local database, one SQLite file per project in TRACKIO_DIR
    (by default ~/.cache/huggingface/trackio, read when trackio is first imported), where
    `trackio show` compares all runs of the project; no Space or server is given, so nothing
    leaves the machine. The reward plot is logged as a trackio Image at the last step."""

    name = "trackio"

    def __init__(self, *, project: str, run_name: str, config: dict[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        # trackio prints its banner (where the data went, how to open the dashboard) to stdout:
        # it goes to this module's log instead, beside the trainer's other lines.
        banner = io.StringIO()
        with contextlib.redirect_stdout(banner):
            self._run = trackio.init(project=project, name=run_name, config=config, embed=False)
        text = _ANSI_ESCAPE.sub("", banner.getvalue())  # it colours the `trackio show` command
        logger.info("trackio: %s", " | ".join(line.strip("* ") for line in text.splitlines() if line.strip()))
        self._last_step = 0

    def log(self, step: int, record: dict[str, float]) -> None:
        self._trackio.log(record, step=step)
        self._last_step = step

    def log_plot(self, path: Path) -> None:
        self._trackio.log({"reward_plot": self._trackio.Image(str(path))}, step=self._last_step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # its "Run finished" banner
            self._trackio.finish()


def start_tracker(name: str, run_dir: Path, *, project: str, run_name: str, wandb_mode: str,
                  mlflow_tracking_uri: str, resume_step: int | None) -> Tracker:
    """Open one tracker's run (raises whatever the tracker raises: the caller reports it)."""
    config_path = run_dir / "config.yaml"
    config = _read_config(config_path)
    if name == "tensorboard":
        return TensorBoardTracker(run_dir, resume_step)
    if name == "wandb":
        return WandbTracker(run_dir, project=project, run_name=run_name, mode=wandb_mode, config=config)
    if name == "mlflow":
        return MlflowTracker(run_dir, project=project, run_name=run_name, tracking_uri=mlflow_tracking_uri,
                             config=config, config_path=config_path if config_path.is_file() else None)
    if name == "trackio":
        return TrackioTracker(project=project, run_name=run_name, config=config)
    raise ValueError(f"unknown tracker {name!r}; known: {TRACKER_NAMES}")


def _read_config(path: Path) -> dict[str, Any]:
    """The run's resolved config as the trainer saved it (empty when there is none, e.g. in tests)."""
    import yaml

    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for the one line a failing tracker gets."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
