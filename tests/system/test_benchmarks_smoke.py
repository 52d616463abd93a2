"""Every benchmark's smoke mode runs as its recorded command does (`python -m benchmarks.NAME`
from the repository root) and prints its summary line with the figures it promises, so a config
change cannot break a recorded command unseen. No figure is compared with a threshold: a smoke
run's numbers mean nothing.

    .venv/bin/python -m pytest tests/system/test_benchmarks_smoke.py -q --durations=0

Each runs as `python -m benchmarks.NAME --smoke true` (the script's SMOKE sizes: a few steps, tiny
shapes; a local cluster's vLLM engines uncompiled, harness.SMOKE_ENGINE) plus where its inputs and
outputs go. The smokes whose workers are the same (algorithms, data_path, demo_ab, distill, step_profile,
learning_parity, and checkpoint_async on the demo model) run on one cluster (`--attach`,
benchmarks/clusters.py; support.cluster's demo cluster, which the end-to-end and crash-resume
modules then use too), and so does async_overlap's real mode (its split and simulated modes start their own):
each would start its own otherwise, ~50 CPU-s apiece; the others start theirs as their recorded
commands do. Already run elsewhere in smoke mode, not repeated
here: soak.py (tests/system/test_soak.py) and scale.py (tests/system/test_scale_benchmark.py).
scripts/suite_profile.py, which profiles the suite, has its smoke here too (run by its path).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.harness import parse_summary_line
from local_cluster import LocalCluster
from support.cluster import demo_cluster
from support.paths import REPO_ROOT

pytestmark = [pytest.mark.system]

SMOKE_TIMEOUT_S = 1200  # a cluster smoke takes 1-3 min on 2 idle cores; a busy machine, several times that
ASSETS = "{assets}"  # replaced by the session's demo assets (tests/conftest.py)
WORK = "{work}"  # replaced by the test's own folder


@dataclass(frozen=True)
class Smoke:
    """One benchmark's smoke command and what its summary line must hold."""

    module: str
    """benchmarks.<module>."""
    args: tuple[str, ...]
    """Flags after `--smoke true`: where its inputs and outputs go (ASSETS / WORK filled in)."""
    prefix: str
    """The summary line's name (before ': '; '' for a line of key=value pairs alone)."""
    figures: tuple[str, ...]
    """Keys the summary line must carry."""
    marks: tuple[str, ...] = ()
    """Tiers beyond system (vllm, distributed)."""
    shared: bool = False
    """Runs on the module's shared cluster (`--attach`, the smoke_cluster fixture) instead of starting its own."""
    script: str = ""
    """A script run by its path from the repository root (scripts/suite_profile.py), not as `-m benchmarks.<module>`."""


CLUSTER = ("vllm", "distributed")  # a local cluster: a vLLM worker and torchrun ranks
DEMO = ("--assets_dir", ASSETS)
SMOKES = (
    Smoke("batcher", (), "", ("window", "target", "fill", "padding")),
    Smoke("learnability", (), "", ("warmup", "well_formed", "sampled_correct")),
    Smoke("logprob_batching", (), "", ("speedup", "tiny_speedup", "batched_tok_s", "sequential_tok_s")),
    Smoke("memory", (), "", ("tokens", "chunked_mib", "full_mib", "ratio")),
    Smoke("packing", (), "", ("speedup", "cpu_speedup", "packed_s", "padded_s")),
    Smoke("prefix_cache_reset", (), "prefix_cache_reset", ("ns_per_block", "sized_blocks", "card_blocks", "ratio")),
    Smoke("shared_prompts", (), "shared_prompts", ("speedup", "cpu_speedup", "whole_tokens", "shared_tokens")),
    Smoke("reward", (), "", ("hostile_over_clean", "clean_samples_per_s", "hostile_samples_per_s")),
    Smoke("trackers", (), "", ("jsonl_log_ms", "tensorboard_log_ratio")),
    Smoke("trainer_throughput", (), "", ("tokens_per_s", "mfu", "step_s")),
    Smoke("long_context", (), "long_context", ("mem_ratio", "rss_ratio", "step_ratio", "longest_ratio", "packer_takes"),
          ("distributed",)),
    Smoke("gpu_report", ("--out", f"{WORK}/gpu_report.md"), "gpu_report", ("rows", "skipped", "failed")),
    Smoke("suite_profile", (), "suite_profile",
          ("wall_s", "machine_cpu_s", "attributed_cpu_s", "engine_starts", "trainer_launches", "ray_heads"),
          script="scripts/suite_profile.py"),
    Smoke("judge_throughput", ("--work_dir", WORK), "judge_throughput",
          ("speedup", "batched_per_s", "one_per_s", "parsable", "requests"), ("vllm",)),
    Smoke("inflight", ("--work_dir", WORK), "inflight",
          ("speedup", "keep_token_staleness", "wait_token_staleness", "staleness_source"), ("vllm",)),
    # Local-cluster smokes last: they take minutes each.
    Smoke("weight_push", ("--work_dir", WORK), "", ("gather_gbps", "sharded_gbps", "fraction_of_memcpy"), CLUSTER),
    Smoke("realistic_run", ("--work_dir", WORK), "realistic_run", ("steps", "tokens_per_step", "step_s_median"),
          CLUSTER),
    # Last: these share one cluster (smoke_cluster), kept for the end-to-end module.
    Smoke("async_overlap", (*DEMO, "--work_dir", WORK), "async_overlap",
          ("speedup", "split_speedup", "split_ideal", "split_G_s", "split_T_s", "simulated_speedup", "simulated_ideal",
           "overlap_efficiency", "G_s", "T_s"), CLUSTER,
          shared=True),
    Smoke("algorithms", (*DEMO, "--out_dir", WORK), "algorithms", ("baseline",), CLUSTER, shared=True),
    Smoke("data_path", (*DEMO, "--out_dir", WORK), "data_path",
          ("wait_ratio", "step_ratio", "ray_bytes_per_step", "scatter_bytes_per_step"), CLUSTER, shared=True),
    Smoke("demo_ab", (*DEMO, "--out_dir", WORK, "--a", "", "--b", "--max_lag 1"), "demo_ab",
          ("step_s_ratio", "a_step_s", "b_step_s", "wait_s_ratio"), CLUSTER, shared=True),
    Smoke("distill", (*DEMO, "--out_dir", WORK), "distill", ("teacher", "distill"), CLUSTER, shared=True),
    Smoke("checkpoint_async", ("--work_dir", WORK, "--model_dir", f"{ASSETS}/model"), "checkpoint_async",
          ("weights_mb", "sync_checkpoint_s", "async_checkpoint_s", "blocked_ratio"), CLUSTER, shared=True),
    Smoke("step_profile", ("--assets", ASSETS), "step_profile", ("median_step_s", "cores", "trainer_faults_per_step"),
          CLUSTER, shared=True),
    Smoke("learning_parity", ("--model_dir", f"{ASSETS}/model", "--data", f"{ASSETS}/arithmetic.jsonl",
                              "--eval_data", f"{ASSETS}/arithmetic_eval.jsonl", "--out_dir", WORK),
          "", ("parity",), CLUSTER, shared=True),
)


def _command(smoke: Smoke, assets: Path, work: Path) -> list[str]:
    args = [a.replace(ASSETS, str(assets)).replace(WORK, str(work)) for a in smoke.args]
    entry = [smoke.script] if smoke.script else ["-m", f"benchmarks.{smoke.module}"]
    return [sys.executable, *entry, "--smoke", "true", *args]


def _summary(stdout: str, smoke: Smoke) -> dict[str, str]:
    """The figures of the last line named smoke.prefix that carries the first promised figure."""
    for line in reversed(stdout.strip().splitlines()):
        name, figures = parse_summary_line(line.strip())
        if name == smoke.prefix and smoke.figures[0] in figures:
            return figures
    raise AssertionError(f"{smoke.module}: no summary line {smoke.prefix!r} with {smoke.figures[0]}:\n{stdout[-2000:]}")


def _params() -> list:
    return [pytest.param(s, id=s.module, marks=[getattr(pytest.mark, m) for m in s.marks]) for s in SMOKES]


@pytest.fixture(scope="module")
def smoke_cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    """The cluster the shared smokes (Smoke.shared) attach to: support.cluster's demo cluster,
    which has the workers each of them would start (generation, logprob and teacher workers on the
    demo model), kept running for the end-to-end module after this one."""
    return demo_cluster(demo_assets, tmp_path_factory.mktemp("smoke-cluster"))


@pytest.mark.parametrize("smoke", _params())
def test_benchmark_smoke_prints_its_summary(smoke: Smoke, demo_assets: Path, tmp_path: Path,
                                            request: pytest.FixtureRequest) -> None:
    command = _command(smoke, demo_assets, tmp_path)
    if smoke.shared:
        command += ["--attach", request.getfixturevalue("smoke_cluster").address]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert result.returncode == 0, f"{smoke.module} smoke failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    figures = _summary(result.stdout, smoke)
    missing = [key for key in smoke.figures if key not in figures]
    assert not missing, f"{smoke.module}: summary line lacks {missing}: {figures}"
    assert all(value for value in figures.values()), figures


@pytest.mark.vllm
def test_attaching_to_a_cluster_without_the_runs_workers_fails_before_any_trainer(
        smoke_cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    """A benchmark given --attach checks the running cluster for the workers its own config asks
    for (here two generation workers: the shared cluster has one) and stops, naming them, before
    it launches anything."""
    probe = ("from benchmarks.clusters import local_cluster\n"
             "from local_cluster import LocalClusterConfig\n"
             f"config = LocalClusterConfig(model_path={str(demo_assets / 'model')!r}, log_dir={str(tmp_path)!r}, "
             "generation_workers=2)\n"
             "try:\n"
             f"    with local_cluster(config, {smoke_cluster.address!r}):\n"
             "        print('ATTACHED')\n"
             "except RuntimeError as error:\n"
             "    print('REFUSED', error)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ATTACHED" not in done.stdout, done.stdout
    assert f"REFUSED the cluster at {smoke_cluster.address} lacks workers this run needs: 1 generation" in done.stdout, \
        done.stdout + done.stderr[-2000:]
