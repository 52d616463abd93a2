"""Trackers for real, offline: what MetricsLogger hands W&B (offline run files), MLflow (its
SQLite store under the run dir) and TensorBoard is read back with each tool's own reader (W&B:
its .wandb transaction log) and compared with metrics.jsonl; a tracker that cannot start or fails
later costs one line, never the run; nothing tries to reach the network; only rank 0 writes."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_grpo.config.run_config import ConfigError, load_config
from async_grpo.telemetry.metrics import MetricsConfig, read_metrics
from async_grpo.telemetry.trackers import TensorBoardTracker, flatten_config, mlflow_key
from support.paths import REPO_ROOT, TESTS
from support.tracker_readers import trackio_run, wandb_offline_runs
from support.tracker_runs import RUN_CONFIG, STEPS, logged_record, write_run


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B's artifact staging in tmp_path (not ~/.local/share/wandb)."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


@pytest.mark.system
def test_wandb_and_mlflow_hold_every_metric_the_config_and_the_plot(tmp_path: Path, offline: None) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "my-run"
    write_run(run_dir, ("jsonl", "tensorboard", "wandb", "mlflow"))
    expected = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time_s", "unix_time")}
                for r in read_metrics(run_dir / "metrics.jsonl")}
    # The sink's collapse monitor adds its two metrics; logged_record's reward rises every step,
    # so it never stands below its best and nothing is warned.
    watched = {"collapse/reward_below_best": 0.0, "counts/collapse_warnings": 0.0}
    assert expected == {step: {**logged_record(step), **watched} for step in range(STEPS)}
    plot = (run_dir / "reward.png").read_bytes()
    assert plot[:4] == b"\x89PNG"

    [wandb_run] = wandb_offline_runs(run_dir)
    assert wandb_run["history"] == expected
    assert wandb_run["config"] == RUN_CONFIG
    [artifact] = wandb_run["artifacts"]
    assert (artifact.name, artifact.type) == ("reward_plot", "plot")
    [entry] = artifact.manifest.contents
    assert entry.path == "reward.png"
    assert entry.digest == base64.b64encode(hashlib.md5(plot).digest()).decode()
    assert Path(entry.local_path).read_bytes() == plot and str(tmp_path / "wandb-data") in entry.local_path

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    for key in expected[1]:
        history = client.get_metric_history(run.info.run_id, mlflow_key(key))
        assert sorted((m.step, m.value) for m in history) == [(s, r[key]) for s, r in expected.items() if key in r], key
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4"
    assert run.data.params == {k: str(v) for k, v in flatten_config(RUN_CONFIG).items()}
    assert run.data.params["optim.lr"] == "0.001"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"reward.png", "config.yaml"}
    local = client.download_artifacts(run.info.run_id, "reward.png", str(tmp_path / "download"))
    assert Path(local).read_bytes() == plot
    assert str(run_dir / "mlflow" / "artifacts") in run.info.artifact_uri

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert events.Tags()["images"] == ["reward_plot"]
    assert [(e.step, e.value) for e in events.Scalars("eval/pass@4")] == [(1, 0.5), (3, 0.875)]


@pytest.mark.system
def test_a_tracker_that_cannot_start_costs_one_line_not_the_run(tmp_path: Path, offline: None,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "mlflow").write_text("a file where MLflow's folder would go")  # MLflow cannot start
    with caplog.at_level(logging.WARNING):
        write_run(run_dir, ("jsonl", "wandb", "mlflow", "tensorboard"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings), warnings
    assert warnings[0].startswith("metrics.report_to: wandb did not start (ModuleNotFoundError")
    assert warnings[1].startswith("metrics.report_to: mlflow did not start (FileExistsError")
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["counts/trackers_off"] == 2.0 for r in records)
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "reward.png").is_file()


def test_a_tracker_that_fails_later_is_dropped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    original = TensorBoardTracker.log

    def fail_at_step_2(self: TensorBoardTracker, step: int, record: dict[str, float]) -> None:
        if step == 2:
            raise OSError("No space left on device\nsecond line")
        original(self, step, record)

    monkeypatch.setattr(TensorBoardTracker, "log", fail_at_step_2)
    with caplog.at_level(logging.WARNING):
        write_run(tmp_path, ("jsonl", "tensorboard"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["metrics: tensorboard failed at step 2 (OSError: No space left on device); "
                        "it is off for the rest of the run"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("counts/trackers_off") for r in records] == [None, None, None, 1.0]


def test_only_rank0_reports(tmp_path: Path, offline: None) -> None:
    write_run(tmp_path, ("jsonl", "tensorboard", "wandb", "mlflow"), is_main=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_report_to_from_the_command_line_and_its_checks() -> None:
    import dataclasses

    from async_grpo.trainer.config import TrainerConfig

    parsed = load_config(MetricsConfig, ["--report_to", "jsonl", "wandb", "mlflow"])
    assert parsed.report_to == ("jsonl", "wandb", "mlflow")
    assert MetricsConfig().report_to == ("jsonl", "tensorboard")
    with pytest.raises(ConfigError, match=r"report_to\[1\]: 'neptune' is not one of"):
        load_config(MetricsConfig, ["--report_to", "jsonl", "neptune"])
    with pytest.raises(ValueError, match=r"MetricsConfig.report_to names \['wandb'\] more than once"):
        MetricsConfig(report_to=("wandb", "wandb"))
    assert {f.name: f.type for f in dataclasses.fields(TrainerConfig)}["metrics"] in (MetricsConfig, "MetricsConfig")


@pytest.mark.system
def test_trackio_holds_every_metric_the_config_and_the_plot(tmp_path: Path) -> None:
    """In child processes: trackio reads TRACKIO_DIR once, when first imported."""
    run_dir = tmp_path / "trackio-run"
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": f"{REPO_ROOT}:{TESTS}"}
    writer = (f"from pathlib import Path; from support.tracker_runs import write_run; "
              f"write_run(Path({str(run_dir)!r}), ('jsonl', 'trackio'))")
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, capture_output=True, text=True)
    stored = trackio_run(tmp_path / "trackio", "grpo", "trackio-run")
    expected = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time_s", "unix_time")}
                for r in read_metrics(run_dir / "metrics.jsonl")}
    assert stored["history"] == expected
    assert stored["config"] == RUN_CONFIG
    assert list(stored["images"]) == [STEPS - 1]
    assert stored["images"][STEPS - 1].read_bytes() == (run_dir / "reward.png").read_bytes()
    assert list((tmp_path / "trackio").glob("grpo.db"))


# Run in a child process, so that the check covers interpreter exit too (W&B's usage telemetry
# exported from a background thread and at exit), with the test runner's and CI's variables
# removed: MLflow turns its telemetry off by itself when it sees them, and the tracker must not
# depend on that. The audit hook sees Python's own lookups and connections; W&B's Go service
# was checked with strace (docs/trackers.md).
_NETWORK_PROBE = """
import os, socket, sys, atexit
attempts = []
def audit(event, args):
    if event == "socket.getaddrinfo" and args[0] not in (None, "localhost", "127.0.0.1", "::1"):
        attempts.append(f"{event} {args[0]}:{args[1]}")
    elif event == "socket.connect" and args[0].family in (socket.AF_INET, socket.AF_INET6):
        if not str(args[1][0]).startswith(("127.", "::1")):
            attempts.append(f"{event} {args[1]}")
sys.addaudithook(audit)
atexit.register(lambda: os.write(2, f"NETWORK ATTEMPTS {attempts}\\n".encode()))  # runs last
from pathlib import Path
from support.tracker_runs import write_run
write_run(Path(sys.argv[1]), ("jsonl", "tensorboard", "wandb", "mlflow", "trackio"))
"""


@pytest.mark.system
def test_no_tracker_reaches_for_the_network(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "CI", "MLFLOW_DISABLE_TELEMETRY",
                                                            "DO_NOT_TRACK", "WANDB_MODE")}
    env.update(PYTHONPATH=f"{REPO_ROOT}:{TESTS}", TRACKIO_DIR=str(tmp_path / "trackio"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    child = subprocess.run([sys.executable, "-c", _NETWORK_PROBE, str(tmp_path / "run")], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "NETWORK ATTEMPTS []" in child.stderr.splitlines(), child.stderr[-3000:]
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == STEPS
