"""The whole system on CPU: real vLLM generation worker, real logprob worker, registries, the
ExperienceBatcher and `torchrun --nproc_per_node=2 trainer_core.py` (FSDP2 on gloo).

One local cluster (workers started through worker_dispatcher.py: a generation worker, an
old-policy logprob worker, a reference-pool worker and a teacher worker; support.cluster's demo
cluster, shared with the benchmarks' attaching smokes) serves every run in this module; each run
pushes its own weights at start, so runs do not see each other's weights. Runs
that several tests read are made once (module fixtures): the 3-step run with every tracker on
serves the training, staleness and tracker tests; the plain 3-step run the max_lag 0 and
`metrics.py compare` tests; the uninterrupted 4-step run the resume and rank-0 data-path tests.
The algorithm options that need the extra services run last (the end of this file).

    .venv/bin/python -m pytest tests/system/test_end_to_end.py -x -q
"""

from __future__ import annotations

import ipaddress
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, registry_name
from async_grpo.telemetry.metrics import moving_average, read_metrics
from async_grpo.telemetry.run_report import ENDED_BELOW_BEST
from async_grpo.telemetry.trackers import flatten_config, mlflow_key
from async_grpo.trainer.checkpoint import latest_checkpoint
from async_grpo.trainer.distributed_sampler import InfiniteDistributedSampler
from local_cluster import LocalCluster
from support.cluster import FAST_RUN, WORLD_SIZE, demo_cluster, generation_versions, run_forked_trainer, train
from support.paths import REPO_ROOT
from support.tracker_readers import trackio_run, wandb_offline_runs

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]



@pytest.fixture(scope="module")
def cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    """Every service a run can use: the reference and teacher workers for the algorithm options.
    The demo cluster, which the benchmarks' attaching smokes may have started already (each start
    costs a Ray head and four workers, ~45 CPU-s)."""
    return demo_cluster(demo_assets, tmp_path_factory.mktemp("worker-logs"))


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _is_loopback(ip: str) -> bool:
    """127.0.0.1, ::1, or 127.0.0.1 as an IPv6 socket sees it (::ffff:127.0.0.1); not ::, 0.0.0.0."""
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_cluster_listens_on_loopback_only(cluster: LocalCluster) -> None:
    """Every socket the local cluster's processes listen on (GCS, raylet, agents, workers, the
    vLLM engine) is on 127.0.0.1: Ray would otherwise listen on all interfaces."""
    import psutil  # a vLLM dependency
    import ray

    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    me = psutil.Process()
    pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 3, f"expected the GCS, raylet and workers among {listening}"
    exposed = [(ip, port, psutil.Process(pid).name()) for ip, port, pid in listening if not _is_loopback(ip)]
    assert not exposed, f"listening beyond loopback: {exposed}"


@dataclass(frozen=True)
class FinishedRun:
    """A run a module fixture made once, for every test that reads it."""

    run_dir: Path
    records: list[dict]
    generation_versions: list[int]
    """The generation workers' weight versions right after the run (later runs push their own)."""


def _finished(cluster: LocalCluster, demo_assets: Path, run_dir: Path, *extra: str) -> FinishedRun:
    records = train(cluster, demo_assets, run_dir, *extra)
    return FinishedRun(run_dir, records, generation_versions())


@pytest.fixture(scope="module")
def eval_table(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from async_grpo.demo_assets.arithmetic_data import write_arithmetic_table

    return write_arithmetic_table(tmp_path_factory.mktemp("eval") / "eval.jsonl", max_operand=2)  # 9 prompts


# Both 3-step runs: 8 rollouts per prompt (the warmed-up model scores ~7%, so with 4 a whole step
# often has only equal-reward groups: advantage 0, and at step 0 the KL term's gradient is 0 too),
# evaluated after step 1 (every 2) and after the last step.
THREE_STEPS = ["--num_steps", "3", "--sampling.n", "8", "--eval.every", "2", "--eval.pass_k", "2"]


@pytest.fixture(scope="module")
def tracked_run(cluster: LocalCluster, demo_assets: Path, eval_table: Path,
                tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """3 steps with max_lag 1, every tracker on (TensorBoard, W&B offline, MLflow, trackio) and,
    beside math-verify, a second reward function that raises on every rollout (the arithmetic
    records carry no `tests`): its failures must reach each step's record, counted by reason."""
    root = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_DATA_DIR", str(root / "wandb-data"))  # W&B's artifact staging, not ~/.local
        env.setenv("TRACKIO_DIR", str(root / "trackio"))  # trackio's database, not ~/.cache
        return _finished(cluster, demo_assets, root / "trackers", *THREE_STEPS, "--max_lag", "1",
                         "--eval.data.path", str(eval_table),
                         "--sampling.reward.functions", "async_grpo.rewards.math_verifier:math_verify_reward", "async_grpo.rewards.code_reward:run_tests",
                         "--tensorboard", "true",
                         "--metrics.report_to", "jsonl", "tensorboard", "wandb", "mlflow", "trackio")


@pytest.fixture(scope="module")
def plain_run(cluster: LocalCluster, demo_assets: Path, eval_table: Path,
              tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """3 steps as demo.yaml sets them (max_lag 0), metrics.jsonl only."""
    return _finished(cluster, demo_assets, tmp_path_factory.mktemp("plain") / "plain", *THREE_STEPS,
                     "--eval.data.path", str(eval_table), "--metrics.report_to", "jsonl", "--checkpoint_every", "0")


@pytest.fixture(scope="module")
def four_steps(cluster: LocalCluster, demo_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """4 uninterrupted steps on the per-rank data path (demo.yaml: max_lag 0, warmup, so the lr
    changes per step): the reference of the resume and rank-0 data-path tests."""
    return _finished(cluster, demo_assets, tmp_path_factory.mktemp("whole") / "whole", "--num_steps", "4",
                     "--data_path", "per_rank")


def test_few_steps_train_push_and_log(tracked_run: FinishedRun, demo_assets: Path) -> None:
    records = tracked_run.records
    assert [r["step"] for r in records] == [0, 1, 2]
    # Evaluated after step 1 (every 2) and after the last step, on the weights pushed by then.
    assert ["eval/accuracy" in r for r in records] == [False, True, True]
    for record in records[1:]:
        assert record["eval/num_prompts"] == 9
        assert 0.0 <= record["eval/accuracy"] <= 1.0 and 0.0 <= record["eval/pass@2"] <= 1.0
        assert record["eval/weight_version"] == record["step"] + 1
    for record in records:
        assert record["counts/samples"] == WORLD_SIZE * 4 * 8 - record["counts/dropped_stale"]
        assert 0 <= record["counts/zero_advantage_samples"] <= record["counts/samples"]
        if record["counts/zero_advantage_samples"] < record["counts/samples"]:
            assert record["optim/grad_norm"] > 0, record
        assert 0.0 <= record["reward/mean"] <= 1.0
        # Every rollout failed run_tests ("raised"); nothing is dropped after scoring, so the
        # batcher's per-reason count equals the trainer's count of flagged trained samples.
        assert record["counts/reward_failures/run_tests/raised"] == record["counts/reward_failures"]
        assert record["counts/reward_failures"] == record["counts/reward_failed"] == record["counts/samples"]
        assert record["reward/run_tests"] == 0.0
    assert any(r["counts/zero_advantage_samples"] < r["counts/samples"] for r in records), "no step had a signal"
    # Weights changed, and the generation worker reports the final version.
    final = _load_weights(latest_checkpoint(tracked_run.run_dir))
    base = _load_weights(demo_assets / "model")
    assert any(not torch.equal(final[k], base[k]) for k in base)
    assert tracked_run.generation_versions == [3]
    config = (tracked_run.run_dir / "config.yaml").read_text()
    assert "max_lag: 1" in config and "num_steps: 3" in config


def _assert_staleness_within(records: list[dict], max_lag: int) -> None:
    assert max(r["staleness/max"] for r in records) <= max_lag
    assert all(r["counts/dropped_stale"] == 0 for r in records)
    if max_lag == 1:
        # Steps 1+ were generated while the previous step trained: one version old.
        assert any(r["staleness/max"] == 1 for r in records[1:])


def test_max_lag_0_trains_on_policy(plain_run: FinishedRun, four_steps: FinishedRun) -> None:
    for run in (plain_run, four_steps):
        assert "max_lag: 0" in (run.run_dir / "config.yaml").read_text()
        _assert_staleness_within(run.records, 0)


def test_max_lag_1_overlaps_generation_with_training(tracked_run: FinishedRun) -> None:
    _assert_staleness_within(tracked_run.records, 1)


def test_push_every_two_trains_every_step_on_fresh_rollouts(cluster: LocalCluster, demo_assets: Path,
                                                            tmp_path: Path) -> None:
    """push_every 2 publishes only even weight versions. A step's prompts must wait for a published
    version within max_lag of it: no rollout may be dropped as stale, no step may train on nothing."""
    records = train(cluster, demo_assets, tmp_path / "run", "--num_steps", "4", "--max_lag", "1",
                    "--push_every", "2", "--checkpoint_every", "0")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records:
        assert record["counts/dropped_stale"] == 0, record
        assert record["counts/samples"] == WORLD_SIZE * 4 * 4, record
        # Versions 0 and 2 are the only ones published before steps 0-3 train: each step's rollouts
        # come from the newest even version not after it, so odd steps lag by 1, even ones by 0.
        assert record["staleness/max"] == record["step"] % 2, record
    assert generation_versions() == [4]  # the last step always pushes


def _seeded_tokens(demo_assets: Path, seed: int | None) -> list[list[list[int]]]:
    """The generation worker's completions of the first three demo prompts, sampled with `seed`."""
    import ray

    from async_grpo.data.dataset import DatasetConfig, load_prompts
    from async_grpo.config.sampling import SamplingConfig
    from setup_model import load_tokenizer

    prompts = load_prompts(DatasetConfig(path=str(demo_assets / "arithmetic.jsonl"), max_prompt_tokens=16),
                           load_tokenizer(demo_assets / "model"))[:3]
    sampling = SamplingConfig(n=8, max_tokens=4, seed=seed)
    registry = ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
    groups = ray.get([registry.submit.remote("generate", p, sampling, cost=sampling.n) for p in prompts])
    return [[r.output_token_ids for r in group] for group in groups]


def test_seeded_requests_repeat_exactly_and_steps_differ(cluster: LocalCluster, demo_assets: Path) -> None:
    """The real engine: one request seed gives the same completions again; the seed the batcher
    derives for another step gives other ones (8 samples of a 0-18 answer rarely repeat)."""
    from async_grpo.config.sampling import derive_seed

    step0, step1 = derive_seed(0, 0), derive_seed(0, 1)
    first = _seeded_tokens(demo_assets, step0)
    assert _seeded_tokens(demo_assets, step0) == first
    assert _seeded_tokens(demo_assets, step1) != first


# A resumed run against an uninterrupted one (max_lag 0, seeded sampling, so both sample the same
# rollouts from the same weights). They still differ by float noise: minibatches are packed in
# the order rollouts arrive, which changes summation order, and Adam turns noise in near-zero
# gradients into visible update differences. Measured on the 2-core machine (2026-11-23), worst
# over steps 0-3 and over tensors: two uninterrupted runs differed by 5.6e-6 in the metrics below
# (relative), 6.9e-4 in weights and 2.3e-4 in AdamW moments (relative norm); resumed vs
# uninterrupted, in two sessions, by up to 3.7e-6, 1.4e-3 and 5.6e-4. A resume that lost the
# optimizer state differed by 0.9 (loss), 0.13 (weights) and 2.5 (exp_avg).
METRIC_RTOL = 1e-4
METRIC_FLOOR = 1e-3  # metrics smaller than this (the KL of step 0 is ~0) are compared absolutely
CHECKPOINT_RTOL = 1e-2
RESUME_METRICS = ("reward/mean", "loss/total", "loss/kl", "entropy/mean", "optim/grad_norm", "optim/lr",
                  "counts/samples", "counts/zero_advantage_samples", "response/length_mean")


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero): robust to elementwise noise in tiny entries."""
    a, b = a.double(), b.double()
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def _assert_same_checkpoint(resumed: Path, whole: Path) -> None:
    """Weights, AdamW moments and step counts, lr schedule, sampler and RNG of two checkpoints."""
    worst: dict[str, float] = {}
    got_weights = _load_weights(resumed)
    for name, tensor in _load_weights(whole).items():
        worst["weights"] = max(worst.get("weights", 0.0), _relative_diff(got_weights[name], tensor))
    got, want = (torch.load(p / "optimizer.pt", weights_only=True) for p in (resumed, whole))
    assert got["state"].keys() == want["state"].keys() and got["state"]
    for name, state in want["state"].items():
        assert torch.equal(got["state"][name]["step"], state["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            worst[key] = max(worst.get(key, 0.0), _relative_diff(got["state"][name][key], state[key]))
    assert [g["lr"] for g in got["param_groups"]] == pytest.approx([g["lr"] for g in want["param_groups"]], rel=1e-12)
    print(f"resumed vs uninterrupted checkpoint, relative norm differences: {worst}")
    assert max(worst.values()) <= CHECKPOINT_RTOL, worst
    got_state, want_state = (json.loads((p / "trainer_state.json").read_text()) for p in (resumed, whole))
    assert got_state == want_state  # step, sampler position, scheduler (last_epoch, _last_lr, ...)
    for rank in range(WORLD_SIZE):
        rng = [torch.load(p / f"rng_rank{rank}.pt", weights_only=True) for p in (resumed, whole)]
        assert rng[0].keys() == rng[1].keys() and all(torch.equal(rng[0][k], rng[1][k]) for k in rng[0])


def test_resume_continues_like_an_uninterrupted_run(cluster: LocalCluster, demo_assets: Path, tmp_path: Path,
                                                    four_steps: FinishedRun) -> None:
    """2 steps, then a resume to 4: the data position, the per-step metrics and the final
    checkpoint (weights, AdamW state, lr schedule, sampler, RNG) match an uninterrupted 4-step run."""
    run = tmp_path / "run"
    train(cluster, demo_assets, run, "--num_steps", "2", "--checkpoint_every", "2")
    assert latest_checkpoint(run).name == "step_000002"
    half_written = run / "checkpoints" / "step_000004.tmp"
    half_written.mkdir()
    (half_written / "trainer_state.json").write_text("{}")  # looks tempting, must be ignored

    records = train(cluster, demo_assets, run, "--num_steps", "4", "--resume", "true")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    num_prompts = sum(1 for line in (demo_assets / "arithmetic.jsonl").read_text().splitlines() if line.strip())
    for rank in range(WORLD_SIZE):
        # An independent sampler from the same seed says which prompts steps 0-3 must use.
        sampler = InfiniteDistributedSampler(num_prompts, rank, WORLD_SIZE, seed=0)
        expected = {step: sampler.next_batch(4) for step in range(4)}
        logged = {}
        for line in (run / f"data_rank{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            logged[entry["step"]] = entry["prompt_ids"]  # the resumed run re-submits steps 2+
        assert {s: logged[s] for s in range(4)} == expected

    # The same 4 steps without the interruption.
    reference = four_steps.records
    assert [r["step"] for r in reference] == [0, 1, 2, 3]
    worst = {}
    for got, want in zip(records, reference):
        for key in RESUME_METRICS:
            diff = abs(got[key] - want[key]) / max(abs(want[key]), METRIC_FLOOR)
            worst[key] = max(worst.get(key, 0.0), diff)
    print(f"resumed vs uninterrupted metrics, worst relative difference over steps 0-3: {worst}")
    assert max(worst.values()) <= METRIC_RTOL, (worst, records, reference)
    _assert_same_checkpoint(latest_checkpoint(run), latest_checkpoint(four_steps.run_dir))


def test_rank0_data_path_trains_like_per_rank(cluster: LocalCluster, demo_assets: Path, tmp_path: Path,
                                              four_steps: FinishedRun) -> None:
    """data_path rank0 (rank 0 reads every rank's minibatches and scatters them over gloo) trains
    the same 4 steps as the per-rank path: data order, per-step metrics and final checkpoint."""
    runs = {"per_rank": four_steps.run_dir, "rank0": tmp_path / "rank0"}
    records = {"per_rank": four_steps.records,
               "rank0": train(cluster, demo_assets, runs["rank0"], "--num_steps", "4", "--data_path", "rank0")}
    # Each rank's data order is the same; which rank trains a sample depends on when its rollout
    # arrived (the packer balances tokens as samples come in), so the trained prompts are
    # compared as the step's union over ranks.
    drawn: dict[str, list] = {kind: [] for kind in runs}
    trained: dict[str, dict[int, list[int]]] = {kind: {} for kind in runs}
    for kind, run in runs.items():
        for rank in range(WORLD_SIZE):
            for line in (run / f"data_rank{rank}.jsonl").read_text().splitlines():
                entry = json.loads(line)
                drawn[kind].append((rank, entry["step"], entry["prompt_ids"]))
                trained[kind].setdefault(entry["step"], []).extend(entry["trained_prompt_ids"])
    assert drawn["rank0"] == drawn["per_rank"] and len(drawn["per_rank"]) == 4 * WORLD_SIZE
    assert {k: sorted(v) for k, v in trained["rank0"].items()} == {k: sorted(v) for k, v in trained["per_rank"].items()}
    worst = {}
    for got, want in zip(records["rank0"], records["per_rank"], strict=True):
        for key in RESUME_METRICS:
            worst[key] = max(worst.get(key, 0.0), abs(got[key] - want[key]) / max(abs(want[key]), METRIC_FLOOR))
    print(f"rank0 vs per_rank metrics, worst relative difference over steps 0-3: {worst}")
    assert max(worst.values()) <= METRIC_RTOL, worst
    # Where the data went: all of it over Ray on per_rank; on rank0, rank 1's share by scatter.
    assert all(r["data/scatter_bytes"] == 0 and r["data/ray_bytes"] > 0 for r in records["per_rank"])
    for got, want in zip(records["rank0"], records["per_rank"]):
        assert got["data/ray_bytes"] == want["data/ray_bytes"] and 0 < got["data/scatter_bytes"] < got["data/ray_bytes"]
    _assert_same_checkpoint(latest_checkpoint(runs["rank0"]), latest_checkpoint(runs["per_rank"]))


# Context parallelism: the two ranks as one group (model.context_parallel 2) against one rank
# without it, on the same prompts (one data shard of 8 per step) and the same seeded rollouts. The
# group's per-rank budget, 12 tokens, is below the longest sample (16 + 4): only the group's 24
# holds it; the single rank gets those 24 itself, so both pack the same minibatches.
CP_RUN = ["--num_steps", "2", "--prompts_per_rank", "8", "--model.share_prompts", "false", "--epochs_per_step", "2",
          "--checkpoint_every", "0"]
CP_COUNTS = ("counts/samples", "counts/tokens", "counts/oversized_samples", "batcher/num_prompts")


@pytest.mark.skipif(WORLD_SIZE != 2, reason="the host's plan gives the trainer no two ranks to group")
def test_context_parallel_group_trains_like_one_rank(cluster: LocalCluster, demo_assets: Path,
                                                     tmp_path: Path) -> None:
    split_dir, single_dir = tmp_path / "cp2", tmp_path / "cp1"
    split = train(cluster, demo_assets, split_dir, *CP_RUN, "--model.context_parallel", "2",
                  "--max_tokens_per_gpu", "12")
    run_forked_trainer(cluster, ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(single_dir),
                                 "--model.model_path", str(demo_assets / "model"),
                                 "--data.path", str(demo_assets / "arithmetic.jsonl"), *FAST_RUN, *CP_RUN,
                                 "--max_tokens_per_gpu", "24", "--checkpoint_at_end", "false"],
                       [tmp_path / "cp1.rank0.log"])
    single = read_metrics(single_dir / "metrics.jsonl")
    assert [r["step"] for r in split] == [r["step"] for r in single] == [0, 1]
    # One data log, the group's first rank's; every drawn prompt's rollouts trained once.
    assert not (split_dir / "data_rank1.jsonl").exists()
    logs = [[json.loads(line) for line in (run / "data_rank0.jsonl").read_text().splitlines()]
            for run in (split_dir, single_dir)]
    assert logs[0] == logs[1]
    for entry in logs[0]:
        assert entry["trained_prompt_ids"] == sorted(entry["prompt_ids"] * 4)  # FAST_RUN's 4 rollouts
    worst = {}
    for got, want in zip(split, single, strict=True):
        assert {k: got[k] for k in CP_COUNTS} == {k: want[k] for k in CP_COUNTS}
        assert got["counts/samples"] == 8 * 4 and got["counts/oversized_samples"] == 0
        assert got["counts/tokens"] == got["batcher/num_tokens"]  # each sample counted once, not per rank
        for key in RESUME_METRICS:
            worst[key] = max(worst.get(key, 0.0), abs(got[key] - want[key]) / max(abs(want[key]), METRIC_FLOOR))
    print(f"context_parallel 2 vs 1 metrics, worst relative difference over steps 0-1: {worst}")
    assert max(worst.values()) <= METRIC_RTOL, worst
    assert latest_checkpoint(split_dir) is not None  # the end-of-run checkpoint saves under the split


# The easiest demo setting: operands 0-2 (9 prompts), so each prompt gets many rollouts per step.
# In a single-process probe of this setting reward went 0.04 -> 0.27 in 20 steps (from chance,
# since the model was only taught the answer format). The margin below is well inside that.
LEARNING_STEPS = 30
LEARNING_MARGIN = 0.10


def test_reward_rises_on_the_easiest_setting(cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset

    easy = write_arithmetic_dataset(tmp_path / "easy.jsonl", num_samples=300, seed=1, max_operand=2)
    records = train(cluster, demo_assets, tmp_path / "run", "--num_steps", str(LEARNING_STEPS),
                    "--data.path", str(easy), "--prompts_per_rank", "16", "--sampling.n", "16",
                    "--max_tokens_per_gpu", "4096", "--checkpoint_every", "0")
    rewards = [r["reward/mean"] for r in records]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end >= start + LEARNING_MARGIN, f"reward did not rise by {LEARNING_MARGIN}: {rewards}"


def _metrics_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time_s", "unix_time")}
            for r in read_metrics(run_dir / "metrics.jsonl")}


def test_the_trackers_hold_what_metrics_jsonl_holds(tracked_run: FinishedRun, plain_run: FinishedRun) -> None:
    from mlflow.tracking import MlflowClient

    tracked, plain = tracked_run.run_dir, plain_run.run_dir
    expected = _metrics_by_step(tracked)
    assert sorted(expected) == [0, 1, 2] and "eval/pass@2" in expected[2]
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


COMPARE_WINDOW = 2


def _reached(records: list[dict], threshold: float) -> str:
    """`metrics.py compare`'s cell, computed here from the records (trainer clock: no command marks)."""
    smoothed = moving_average([r["reward/mean"] for r in records], COMPARE_WINDOW)
    for i in range(COMPARE_WINDOW - 1, len(records)):
        if smoothed[i] >= threshold:
            return f"step {records[i]['step']} ({records[i]['time_s'] / 60:.1f} min)"
    return "not reached"


def _best_and_final(records: list[dict]) -> tuple[str, str]:
    """compare's 'last-N reward' and 'best N-step mean (step)' cells, computed here: the best full
    window (the earliest on a tie), and the final mean with the warning when it ended below it."""
    rewards = [r["reward/mean"] for r in records]
    windows = [(statistics.mean(rewards[i - COMPARE_WINDOW + 1:i + 1]), -i)
               for i in range(COMPARE_WINDOW - 1, len(rewards))]
    best, minus_index = max(windows)
    final = statistics.mean(rewards[-COMPARE_WINDOW:])
    warning = f" (ENDED {best - final:.2f} BELOW ITS BEST)" if best - final > ENDED_BELOW_BEST else ""
    return f"{final:.3f}{warning}", f"{best:.3f} ({records[-minus_index]['step']})"


def test_compare_the_two_runs(tracked_run: FinishedRun, plain_run: FinishedRun, tmp_path: Path) -> None:
    """`python -m async_grpo.telemetry.metrics compare` and the demo's report on two finished runs, checked against the
    same figures computed here from their metrics.jsonl files."""
    two_runs = (tracked_run.run_dir, plain_run.run_dir)
    out = tmp_path / "compare.png"
    # 0.0: reached by the first full window; 1.01: above any reward.
    command = [sys.executable, "-m", "async_grpo.telemetry.metrics", "compare", *map(str, two_runs), "--out", str(out),
               "--window", str(COMPARE_WINDOW), "--thresholds", "0.0", "1.01"]
    printed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in printed.splitlines() if line.startswith("| ")}
    for run_dir in two_runs:
        records = read_metrics(run_dir / "metrics.jsonl")
        evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
        assert len(evals) == 2  # after step 1 (every 2) and after the last step
        cells = [run_dir.name, "0", str(len(records)), _reached(records, 0.0), _reached(records, 1.01),
                 *_best_and_final(records), f"{evals[-1]:.3f}",
                 f"{statistics.median(r['timing/step_s'] for r in records):.2f}", "-"]
        assert rows[run_dir.name] == "| " + " | ".join(cells) + " |"
    assert out.read_bytes()[:4] == b"\x89PNG"

    # The demo's report is the same code: its table rows are compare's (window 10, its levels).
    report = tmp_path / "report.md"
    subprocess.run([sys.executable, "scripts/demo_report.py", "--runs", *map(str, two_runs), "--out_md", str(report)],
                   cwd=REPO_ROOT, check=True, capture_output=True)
    default = subprocess.run([sys.executable, "-m", "async_grpo.telemetry.metrics", "compare", *map(str, two_runs), "--out", str(out)],
                             cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    table = [line for line in default.splitlines() if line.startswith("|")]
    assert table and all(line in report.read_text().splitlines() for line in table)


# ---- the algorithm options on every service at once ----------------------------------------------
# One run turns on what needs the extra services together: KL in the reward with the adaptive
# controller and the old-policy side of the KL (reference logprobs from the reference pool),
# on-policy distillation from a teacher pool (the teacher is the student's starting model, so the
# reverse KL starts near 0), the token-mean aggregation and GSPO's ratio (dynamic sampling's real
# path is tests/system/test_crash_resume.py's). It checkpoints, and a resumed run continues with
# the controller's beta computed here by hand.

KL_COEF, TARGET_KL, HORIZON = 0.05, 0.01, 100
# On top of support.cluster.FAST_RUN's small steps (2 ranks x 4 prompts x 4 rollouts):
ALGORITHMS_RUN = ["--max_lag", "1", "--epochs_per_step", "2", "--optim.schedule", "constant", "--optim.warmup_steps", "0",
       "--logprob_role", "old_policy", "--reference_pool", "true",
       "--loss.kl_coef", str(KL_COEF), "--loss.kl_in_reward", "true", "--loss.kl_controller", "adaptive",
       "--loss.target_kl", str(TARGET_KL), "--loss.kl_horizon", str(HORIZON), "--loss.kl_policy_logprobs", "old_policy",
       "--algorithm.estimator", "dr_grpo", "--loss.aggregation", "token_mean", "--loss.ratio_level", "sequence",
       "--distill.teacher", "true", "--distill.coef", "0.5"]
SAMPLES_PER_STEP = 2 * 4 * 4  # ranks x prompts x rollouts


def _train_algorithms(cluster: LocalCluster, demo_assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    return train(cluster, demo_assets, run_dir, *ALGORITHMS_RUN, *extra)


def test_every_service_at_once_then_resume_with_the_controllers_beta(cluster: LocalCluster, demo_assets: Path,
                                                                     tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train_algorithms(cluster, demo_assets, run, "--num_steps", "2", "--checkpoint_at_end", "true")
    assert [r["step"] for r in first] == [0, 1]
    step0 = first[0]
    # The teacher is the student's starting model: at step 0 the reverse KL is only the sampler's
    # float-level difference from the teacher's forward.
    assert abs(step0["distill/reverse_kl"]) < 1e-3, step0["distill/reverse_kl"]
    assert step0["timing/teacher_s"] > 0 and step0["kl/beta"] == pytest.approx(KL_COEF)
    for record in first:
        assert record["counts/samples"] == SAMPLES_PER_STEP
        assert record["kl/in_reward_mean"] >= -1e-3  # old policy vs reference: a KL, ~0 before training
        assert record["loss/ratio_mean"] > 0 and "mismatch/kl" in record

    resumed = _train_algorithms(cluster, demo_assets, run, "--num_steps", "3", "--resume", "true")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    # max_lag 1: step 2 uses beta after step 0's update, by hand from step 0's logged KL and samples.
    error = min(max(step0["kl/in_reward_mean"] / TARGET_KL - 1.0, -0.2), 0.2)
    expected = KL_COEF * (1.0 + error * step0["counts/samples"] / HORIZON)
    assert resumed[2]["kl/beta"] == pytest.approx(expected, rel=1e-9)
    assert resumed[2]["kl/beta"] != KL_COEF
