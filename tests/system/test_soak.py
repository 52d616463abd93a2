"""benchmarks/soak.py: the snapshot comparison (pure, in soak_parts.py), and its quick check end to end (real
local_cluster.py: vLLM worker, logprob worker, torchrun with 2 FSDP ranks) for the report's
structure. No timing or memory thresholds here: the soak's figures are in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import soak_parts as soak
from support.paths import REPO_ROOT

QUICK_TIMEOUT_S = 900  # ~1.5 min on 2 idle cores; generous for a busy machine


def _memory(anon_kb: int, shmem_kb: int = 0, file_kb: int = 1000) -> dict[str, int]:
    return {"VmRSS": anon_kb + shmem_kb + file_kb, "RssAnon": anon_kb, "RssShmem": shmem_kb, "RssFile": file_kb}


def _snapshot(step: int, processes: dict[int, tuple[str, float, dict[str, int]]]) -> dict:
    return {"step": step, "processes": {pid: {"label": label, "first_seen_s": first, **memory}
                                        for pid, (label, first, memory) in processes.items()}}


def test_compare_matches_processes_by_pid_and_takes_the_largest_ratio() -> None:
    early = _snapshot(50, {10: ("registry actor", 2.0, _memory(1000)), 9: ("registry actor", 1.0, _memory(2000, 500)),
                           20: ("trainer rank 0", 3.0, _memory(4000)), 30: ("Ray idle worker", 4.0, _memory(100))})
    late = _snapshot(300, {10: ("registry actor", 2.0, _memory(1050)), 9: ("registry actor", 1.0, _memory(2000, 1000)),
                           20: ("trainer rank 0", 3.0, _memory(4400)), 40: ("Ray idle worker", 5.0, _memory(300))})
    rows = {r["label"]: r for r in soak.compare(early, late)}
    assert set(rows) == {"registry actor #1", "registry actor #2", "trainer rank 0", "Ray idle worker #1",
                         "Ray idle worker #2"}
    assert rows["registry actor #1"]["pid"] == 9  # numbered by start order
    assert rows["registry actor #1"]["ratio"] == pytest.approx(3000 / 2500)  # RssAnon + RssShmem
    assert rows["registry actor #1"]["vmrss_ratio"] == pytest.approx(4000 / 3500, abs=1e-4)
    assert rows["trainer rank 0"]["ratio"] == 1.1
    assert rows["Ray idle worker #1"]["status"] == "gone" and rows["Ray idle worker #1"]["ratio"] is None
    assert rows["Ray idle worker #2"]["status"] == "new" and rows["Ray idle worker #2"]["rss_early_kb"] is None
    assert soak.rss_growth(list(rows.values())) == (1.2, "registry actor #1")
    with pytest.raises(ValueError, match="both snapshots"):
        soak.rss_growth([rows["Ray idle worker #1"]])


def test_process_timelines_give_each_process_its_rss_per_point_and_none_where_absent() -> None:
    points = [_snapshot(25, {9: ("registry actor", 1.0, _memory(2000, 100)), 30: ("idle", 4.0, _memory(100))}),
              _snapshot(50, {9: ("registry actor", 1.0, _memory(2100, 100)), 40: ("idle", 5.0, _memory(300))})]
    for point, t_s in zip(points, (10.0, 20.0)):
        point["t_s"] = t_s
    timeline = soak.process_timelines(points)
    assert timeline["steps"] == [25, 50] and timeline["t_s"] == [10.0, 20.0]
    assert [(r["label"], r["rss_kb"]) for r in timeline["rows"]] == [
        ("registry actor", [2100, 2200]), ("idle #2", [None, 300]), ("idle #1", [100, None])]


def test_config_needs_the_early_step_before_the_last() -> None:
    assert soak.SoakConfig(num_steps=12, early_step=4).early_step == 4
    with pytest.raises(ValueError, match="early_step"):
        soak.SoakConfig(num_steps=50, early_step=50)
    with pytest.raises(ValueError, match="timeline_every"):
        soak.SoakConfig(timeline_every=-1)


def test_trainer_args_keep_the_demo_config_and_turn_off_checkpoints_and_eval(tmp_path: Path) -> None:
    from async_grpo.config.run_config import load_config
    from async_grpo.trainer.config import TrainerConfig

    args = soak.trainer_args(soak.SoakConfig(num_steps=300), tmp_path, ["--seed", "3"])
    trainer = load_config(TrainerConfig, [*args, "--model.model_path", "m"])
    assert trainer.num_steps == trainer.optim.total_steps == 300
    assert trainer.checkpoint_every == 0 and not trainer.checkpoint_at_end and trainer.eval.every == 0
    experience = trainer.experience
    assert trainer.seed == 3 and experience.sampling.n == 16 and trainer.epochs_per_step == 4  # the demo's otherwise


@pytest.mark.vllm
@pytest.mark.distributed
def test_quick_soak_reports_both_snapshots_per_process(demo_assets: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        # --smoke true: 8 steps, snapshots at 4 and 8, 500 prompts, every process read every 2 s and
        # at every 4th record (soak_parts.SMOKE). The session's demo assets are the ones the soak
        # would write (prepare_demo.py with 500 prompts), so it reuses them.
        [sys.executable, "-m", "benchmarks.soak", "--smoke", "true", "--work_dir", str(tmp_path),
         "--assets_dir", str(demo_assets),
         # Small steps (the demo's are 2 x 16 prompts x 16 rollouts): the report's structure is
         # under test here, and a step's size changes nothing in it.
         "--", "--prompts_per_rank", "4", "--sampling.n", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=QUICK_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    steps = soak.SMOKE["num_steps"]
    assert report["status"] == "ok" and report["steps"] == steps
    assert report["snapshots"]["early"]["step"] >= 4 and report["snapshots"]["late"]["step"] == steps
    rows = {r["label"]: r for r in report["rows"]}
    for label in ("trainer rank 0", "trainer rank 1", "generation worker actor", "vLLM EngineCore"):
        row = rows[label]
        assert row["status"] == "both", row
        assert row["rss_early_kb"] > 0 and row["rss_late_kb"] > 0
        assert row["ratio"] == round(row["rss_late_kb"] / row["rss_early_kb"], 4)
    assert not any("this benchmark" in label for label in rows)
    timeline = report["rss_timeline"]
    assert timeline["steps"][0] >= 4 and timeline["steps"][-1] == steps  # about every 4 records
    assert timeline["steps"] == sorted(set(timeline["steps"]))
    engine = next(r for r in timeline["rows"] if r["label"] == "vLLM EngineCore")
    assert all(v is not None and v > 0 for v in engine["rss_kb"])
    compared = [r["ratio"] for r in report["rows"] if r["ratio"] is not None]
    assert report["rss_growth"] == max(compared) and report["target"] == soak.TARGET_GROWTH
    assert report["met"] == (report["rss_growth"] < soak.TARGET_GROWTH)
    store = report["object_store"]
    for name in ("early", "late"):
        assert store[name]["reading"]["capacity_bytes"] > 0 and store[name]["reading"]["used_bytes"] >= 0
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"soak: steps={steps} early_step=")
    assert f"rss_growth={report['rss_growth']:.3f} " in last and "target=1.10 met=" in last
