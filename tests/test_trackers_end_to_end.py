"""Two real short runs (vLLM generation + logprob workers, `torchrun --nproc_per_node=2
trainer_core.py`): one reports to W&B (offline), MLflow and trackio besides metrics.jsonl, and
what they hold is read back and compared with metrics.jsonl; then `python metrics.py compare` on
both runs, checked against the same figures computed here from their metrics.jsonl files."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import session_ray_set_aside
from local_cluster import LocalCluster, LocalClusterConfig
from metrics import moving_average, read_metrics
from trackers import flatten_config, mlflow_key
from tracker_readers import trackio_run, wandb_offline_runs

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
# As tests/test_end_to_end.py: tens of seconds a run on 2 cores (2 ranks x 4 prompts x 8 rollouts).
FAST_RUN = ["--num_steps", str(STEPS), "--prompts_per_rank", "4", "--sampling.n", "8", "--sampling.max_tokens", "4",
            "--max_tokens_per_gpu", "256", "--progress_bar", "false", "--data.max_prompt_tokens", "16",
            "--eval.every", "2", "--eval.pass_k", "2", "--checkpoint_at_end", "false"]
TRAINER_TIMEOUT_S = 600
WINDOW = 2


@pytest.fixture(scope="module")
def two_runs(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Run "trackers" (jsonl, TensorBoard, W&B, MLflow, trackio) and run "plain" (jsonl only), 3 steps each."""
    from dataset import write_arithmetic_table

    root = tmp_path_factory.mktemp("tracked-runs")
    table = write_arithmetic_table(root / "eval.jsonl", max_operand=2)  # 9 held-out prompts
    config = LocalClusterConfig(
        model_path=str(demo_assets / "model"), log_dir=str(root / "worker-logs"), generation_workers=1,
        logprob_workers=1, num_cpus=8, kv_cache_memory_bytes=128 * 2**20, max_num_seqs=256, max_model_len=64,
        global_num_verifiers=1,
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_DATA_DIR", str(root / "wandb-data"))  # W&B's artifact staging, not ~/.local
        env.setenv("TRACKIO_DIR", str(root / "trackio"))  # trackio's database, not ~/.cache
        # Earlier modules of the same run may hold the session's Ray connection (ray_local).
        with session_ray_set_aside(), LocalCluster(config) as cluster:
            _train_both(cluster, demo_assets, root, table)
    return root / "trackers", root / "plain"


def _train_both(cluster: LocalCluster, demo_assets: Path, root: Path, table: Path) -> None:
    runs = {"trackers": ["--metrics.report_to", "jsonl", "tensorboard", "wandb", "mlflow", "trackio"],
            "plain": ["--metrics.report_to", "jsonl", "--tensorboard", "false"]}
    cluster.start_workers()
    for name, extra in runs.items():
        run_dir, log = root / name, root / f"{name}.trainer.log"
        args = ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(run_dir),
                "--model.model_path", str(demo_assets / "model"),
                "--data.path", str(demo_assets / "arithmetic.jsonl"), "--eval.data.path", str(table),
                *FAST_RUN, *extra]
        code = cluster.run_trainer(args, nproc_per_node=2, timeout_s=TRAINER_TIMEOUT_S, log_path=log)
        assert code == 0, f"trainer exited {code}:\n" + "\n".join(log.read_text().splitlines()[-40:])


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time_s", "unix_time")}
            for r in read_metrics(run_dir / "metrics.jsonl")}


def test_the_trackers_hold_what_metrics_jsonl_holds(two_runs: tuple[Path, Path]) -> None:
    from mlflow.tracking import MlflowClient

    tracked, plain = two_runs
    expected = _metrics(tracked)
    assert sorted(expected) == list(range(STEPS)) and "eval/pass@2" in expected[STEPS - 1]
    config = yaml.safe_load((tracked / "config.yaml").read_text())
    plot = (tracked / "reward.png").read_bytes()

    # One W&B, MLflow and trackio run for two ranks: only rank 0 reports.
    [wandb_run] = wandb_offline_runs(tracked)
    assert wandb_run["history"] == expected
    assert wandb_run["config"] == config and wandb_run["config"]["metrics"]["report_to"][2] == "wandb"
    [artifact] = wandb_run["artifacts"]
    assert artifact.name == "reward_plot" and Path(artifact.manifest.contents[0].local_path).read_bytes() == plot

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.info.run_name == "trackers"
    for key in set().union(*expected.values()):
        history = client.get_metric_history(run.info.run_id, mlflow_key(key))
        assert sorted((m.step, m.value) for m in history) == [(s, r[key]) for s, r in expected.items() if key in r], key
    assert run.data.params == {k: str(v) for k, v in flatten_config(config).items()}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"reward.png", "config.yaml"}

    trackio = trackio_run(tracked.parent / "trackio", "grpo", "trackers")
    assert trackio["history"] == expected and trackio["config"] == config
    assert [path.read_bytes() for path in trackio["images"].values()] == [plot]
    assert (tracked / "tensorboard").is_dir()
    assert not any((plain / name).exists() for name in ("wandb", "mlflow", "tensorboard", "reward.png"))


def _reached(records: list[dict], threshold: float) -> str:
    """The table's cell, computed here from the records (trainer clock: no command marks)."""
    smoothed = moving_average([r["reward/mean"] for r in records], WINDOW)
    for i in range(WINDOW - 1, len(records)):
        if smoothed[i] >= threshold:
            return f"step {records[i]['step']} ({records[i]['time_s'] / 60:.1f} min)"
    return "not reached"


def test_compare_the_two_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "compare.png"
    # 0.0: reached by the first full window; 1.01: above any reward.
    command = [sys.executable, "metrics.py", "compare", *map(str, two_runs), "--out", str(out),
               "--window", str(WINDOW), "--thresholds", "0.0", "1.01"]
    printed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in printed.splitlines() if line.startswith("| ")}
    for run_dir in two_runs:
        records = read_metrics(run_dir / "metrics.jsonl")
        rewards = [r["reward/mean"] for r in records]
        evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
        assert len(evals) == 2  # after step 1 (every 2) and after the last step
        cells = [run_dir.name, "0", str(STEPS), _reached(records, 0.0), _reached(records, 1.01),
                 f"{statistics.mean(rewards[-WINDOW:]):.3f}", f"{evals[-1]:.3f}",
                 f"{statistics.median(r['timing/step_s'] for r in records):.2f}", "-"]
        assert rows[run_dir.name] == "| " + " | ".join(cells) + " |"
    assert out.read_bytes()[:4] == b"\x89PNG"

    # The demo's report is the same code: its table rows are compare's (window 10, its levels).
    report = tmp_path / "report.md"
    subprocess.run([sys.executable, "scripts/demo_report.py", "--runs", *map(str, two_runs), "--out_md", str(report)],
                   cwd=REPO_ROOT, check=True, capture_output=True)
    default = subprocess.run([sys.executable, "metrics.py", "compare", *map(str, two_runs), "--out", str(out)],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    table = [line for line in default.splitlines() if line.startswith("|")]
    assert table and all(line in report.read_text().splitlines() for line in table)
