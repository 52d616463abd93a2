"""Exactly-once data over a crash: SIGKILL the trainer mid-run, after a background checkpoint,
then `--resume`; every prompt of the data order is trained exactly once.

The real system (vLLM generation worker, registries, batcher, `torchrun --nproc_per_node=2
trainer_core.py` with FSDP2 on gloo; the resumed run's two ranks are forked instead, as
support.cluster.run_forked_trainer says why) on the demo's model: the rewards do not matter here,
only which prompts train. The runs use the demo cluster the end-to-end module leaves running
(support.cluster, SHARED_CLUSTER_MODULES: scripts/test.sh runs this module right after it), and
no logprob worker of it (logprob_role: none). max_lag 1, so at the kill the next step's prompts
are in flight (submitted, generating, not trained): the crashed run's batcher dies with its rank
0, and the resumed run must generate them again. The crashed run has also logged a step after its checkpoint, which the resumed run trains
again: metrics.jsonl and data_rank*.jsonl must hold it once.

    .venv/bin/python -m pytest tests/system/test_crash_resume.py -x -q -s
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset
from async_grpo.launch.local_processes import free_port
from async_grpo.config.actor_names import BATCHER_ACTOR_NAME, RAY_NAMESPACE
from async_grpo.trainer.checkpoint import checkpoints_root, latest_checkpoint
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from local_cluster import LocalCluster
from support.cluster import WORLD_SIZE, demo_cluster, run_forked_trainer
from support.paths import REPO_ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

PROMPTS_PER_RANK = 4
ROLLOUTS = 4
NUM_PROMPTS = 200  # more than the run draws (8 steps x 8 prompts): no prompt repeats across steps
NUM_STEPS = 8
CHECKPOINT_EVERY = 3  # checkpoints step_000003 (after step 2), step_000006, step_000008
RESUME_STEP = 3
RUN_ARGS = ["--num_steps", str(NUM_STEPS), "--prompts_per_rank", str(PROMPTS_PER_RANK), "--max_lag", "1",
            "--sampling.n", str(ROLLOUTS), "--sampling.max_tokens", "4", "--data.max_prompt_tokens", "16",
            "--max_tokens_per_gpu", "256", "--logprob_role", "none", "--loss.kl_coef", "0",
            "--checkpoint_every", str(CHECKPOINT_EVERY), "--checkpoint_async", "true",
            "--progress_bar", "false", "--tensorboard", "false", "--seed", "0"]
TRAINER_TIMEOUT_S = 600
POLL_S = 0.05


@pytest.fixture(scope="module")
def cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    return demo_cluster(demo_assets, tmp_path_factory.mktemp("worker-logs"))


def _start_trainer(cluster: LocalCluster, args: list[str], log: Path) -> subprocess.Popen:
    """torchrun trainer_core.py in its own process group, as LocalCluster.run_trainer starts it,
    but without waiting, so the test can kill it."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD_SIZE}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(REPO_ROOT / "trainer_core.py"),
               "--ray_address", cluster.address, *args]
    return subprocess.Popen(command, env=cluster.trainer_env(WORLD_SIZE), cwd=REPO_ROOT, start_new_session=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _resume(cluster: LocalCluster, args: list[str], tmp_path: Path) -> list[Path]:
    """The crashed run again with --resume, to its end (its ranks forked: support.cluster's
    run_forked_trainer); returns the ranks' logs."""
    logs = [tmp_path / f"resumed.rank{rank}.log" for rank in range(WORLD_SIZE)]
    run_forked_trainer(cluster, [*args, "--resume", "true"], logs)
    return logs


def _raw_records(path: Path, *, torn_last_line_ok: bool = False) -> list[dict]:
    """Every line of a JSONL file, duplicates included (read_metrics would hide them). With
    torn_last_line_ok, a last line cut off by a kill (or read while being written) is skipped."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if not (torn_last_line_ok and index == len(lines) - 1):
                raise
    return records


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it, as a machine failure would. torchrun starts
    each rank in a session of its own (torch's SubprocessHandler), so killing torchrun's process
    group would leave the ranks running: they are found through /proc and killed by pid."""
    import psutil  # a vLLM dependency

    ranks = psutil.Process(process.pid).children(recursive=True)
    assert len(ranks) >= WORLD_SIZE, f"expected torchrun's {WORLD_SIZE} ranks, found {ranks}"
    process.kill()  # torchrun first, so that it cannot react to its ranks' deaths
    for child in ranks:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(ranks, timeout=30)
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "a rank survived SIGKILL"


def _kill_after_checkpoint_and_a_later_step(process: subprocess.Popen, run: Path, log: Path) -> None:
    """SIGKILL torchrun and both ranks once step_000003 is on disk and step 3 has been logged."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + TRAINER_TIMEOUT_S
    while True:
        assert process.poll() is None, f"trainer exited {process.returncode} before the kill:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the trainer never reached the kill point"
        checkpoint = latest_checkpoint(run)
        if checkpoint is not None and metrics.is_file():
            steps = [r["step"] for r in _raw_records(metrics, torn_last_line_ok=True)]
            if steps and max(steps) >= RESUME_STEP:
                break
        time.sleep(POLL_S)
    _kill_tree(process)
    assert latest_checkpoint(run) == checkpoints_root(run) / f"step_{RESUME_STEP:06d}", (
        "the run got past its next checkpoint before the kill; the test needs a crash between checkpoints")


def _wait_for_batcher_gone() -> None:
    """The crashed rank 0 owned the batcher: Ray removes it once it sees the driver dead. A
    restart by hand takes longer than that; the test waits for it explicitly."""
    import ray

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get_actor(BATCHER_ACTOR_NAME, namespace=RAY_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    pytest.fail("the crashed run's batcher is still alive 60 s after the kill")


def test_kill_and_resume_trains_every_prompt_exactly_once(cluster: LocalCluster, demo_assets: Path,
                                                          tmp_path: Path) -> None:
    data = write_arithmetic_dataset(tmp_path / "prompts.jsonl", num_samples=NUM_PROMPTS, seed=3)
    run = tmp_path / "run"
    args = [*RUN_ARGS, "--run_dir", str(run), "--model.model_path", str(demo_assets / "model"), "--data.path", str(data)]

    crashed_log = tmp_path / "crashed.log"
    _kill_after_checkpoint_and_a_later_step(_start_trainer(cluster, args, crashed_log), run, crashed_log)
    crashed_metrics = _raw_records(run / "metrics.jsonl", torn_last_line_ok=True)
    crashed_steps = [r["step"] for r in crashed_metrics]
    print(f"killed after steps {crashed_steps}; resuming at step {RESUME_STEP}")
    assert max(crashed_steps) >= RESUME_STEP  # a step the resumed run trains again (it must not be doubled)
    assert max(crashed_steps) < NUM_STEPS - 1
    _wait_for_batcher_gone()

    resumed_logs = _resume(cluster, args, tmp_path)
    assert f"resumed from {checkpoints_root(run) / f'step_{RESUME_STEP:06d}'}" in resumed_logs[0].read_text()

    records = _raw_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(NUM_STEPS))  # each step once, in order
    # Steps before the checkpoint are the crashed run's own records, untouched; time_s goes on.
    assert records[:RESUME_STEP] == crashed_metrics[:RESUME_STEP]
    times = [r["time_s"] for r in records]
    assert times == sorted(times), times
    for record in records:
        assert record["counts/dropped_stale"] == 0 and record["counts/timed_out_prompts"] == 0, record
        assert record["counts/samples"] == WORLD_SIZE * PROMPTS_PER_RANK * ROLLOUTS, record
        assert record["timing/checkpoint_s"] >= 0.0
    assert all(records[s]["timing/checkpoint_s"] > 0 for s in (2, 5, 7))  # the steps that checkpointed

    # The data order: an independent sampler per rank, from the same seed.
    expected = {}
    for rank in range(WORLD_SIZE):
        sampler = InfiniteDistributedSampler(NUM_PROMPTS, rank, WORLD_SIZE, seed=0)
        expected[rank] = [sampler.next_batch(PROMPTS_PER_RANK) for _ in range(NUM_STEPS)]
    trained: collections.Counter[int] = collections.Counter()
    for step in range(NUM_STEPS):
        step_trained: collections.Counter[int] = collections.Counter()
        for rank in range(WORLD_SIZE):
            entries = [e for e in _raw_records(run / f"data_rank{rank}.jsonl") if e["step"] == step]
            assert len(entries) == 1, (rank, step, entries)  # one record per step and rank
            assert entries[0]["prompt_ids"] == expected[rank][step], (rank, step)
            step_trained.update(entries[0]["trained_prompt_ids"])
        drawn = expected[0][step] + expected[1][step]
        # Each of the step's prompts trained with all its rollouts, nothing else in the step.
        assert step_trained == collections.Counter({p: ROLLOUTS for p in drawn}), step
        trained.update(step_trained)
    order = [p for step in range(NUM_STEPS) for rank in range(WORLD_SIZE) for p in expected[rank][step]]
    assert len(set(order)) == len(order)
    # Over the whole run (crash included): every prompt of the data order exactly once, none else.
    assert trained == collections.Counter({p: ROLLOUTS for p in order})
    assert latest_checkpoint(run) == checkpoints_root(run) / f"step_{NUM_STEPS:06d}"
    assert not list(checkpoints_root(run).glob("*.tmp"))


def test_kill_and_resume_with_dynamic_sampling_draws_every_prompt_once(cluster: LocalCluster, demo_assets: Path,
                                                                       tmp_path: Path) -> None:
    """Dynamic sampling draws extra prompts for a step while ranks train the step before it, so
    under max_lag 1 a step's extras come after the next step's prompts in the data order. The
    demo's model scores few rollouts, so most groups score all 0: steps resample (2 rounds at most).
    Over the crash and the resume, each rank's drawn prompts are exactly a prefix of its data
    order, each once, and every drawn prompt was trained or counted as a zero-variance drop."""
    data = write_arithmetic_dataset(tmp_path / "prompts.jsonl", num_samples=NUM_PROMPTS, seed=3)
    run = tmp_path / "run"
    args = [*RUN_ARGS, "--run_dir", str(run), "--model.model_path", str(demo_assets / "model"), "--data.path", str(data),
            "--sampling.drop_zero_variance_groups", "true", "--sampling.max_resample_rounds", "2"]
    crashed_log = tmp_path / "crashed.log"
    _kill_after_checkpoint_and_a_later_step(_start_trainer(cluster, args, crashed_log), run, crashed_log)
    _wait_for_batcher_gone()
    _resume(cluster, args, tmp_path)

    records = _raw_records(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    assert sum(r["counts/resampled_prompts"] for r in records) > 0, "the test needs steps that resample"
    drawn_in_step: dict[int, set[int]] = collections.defaultdict(set)
    trained_in_step: dict[int, set[int]] = collections.defaultdict(set)
    for rank in range(WORLD_SIZE):
        entries = _raw_records(run / f"data_rank{rank}.jsonl")
        assert [e["step"] for e in entries] == list(range(NUM_STEPS))
        drawn = [p for e in entries for p in e["prompt_ids"]]
        sampler = InfiniteDistributedSampler(NUM_PROMPTS, rank, WORLD_SIZE, seed=0)
        assert len(drawn) <= sampler.per_rank, "the test needs the run to stay within one epoch"
        assert sorted(drawn) == sorted(sampler.next_batch(len(drawn))), rank  # a prefix of the order, each once
        for entry in entries:
            drawn_in_step[entry["step"]].update(entry["prompt_ids"])
            trained_in_step[entry["step"]].update(entry["trained_prompt_ids"])
    # A step trains only prompts drawn for it; which rank trains one is the packer's choice (the
    # test above), so the sets are compared over both ranks.
    for step in range(NUM_STEPS):
        assert trained_in_step[step] <= drawn_in_step[step], (step, trained_in_step[step] - drawn_in_step[step])
    for record in records:
        # every drawn prompt trained with all its rollouts or was dropped as a zero-variance group
        prompts = record["batcher/num_prompts"]
        assert record["counts/samples"] + ROLLOUTS * record["counts/dropped_zero_variance_groups"] == ROLLOUTS * prompts
