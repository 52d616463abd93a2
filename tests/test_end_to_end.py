"""The whole system on CPU: real vLLM generation worker, real logprob worker, registries, the
ExperienceBatcher and `torchrun --nproc_per_node=2 trainer_core.py` (FSDP2 on gloo).

One local cluster (workers started through worker_dispatcher.py) serves every run in this module;
each run pushes its own weights at start, so runs do not see each other's weights.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
import torch

from checkpoint import latest_checkpoint
from dataset import InfiniteDistributedSampler
from local_cluster import LocalCluster, LocalClusterConfig, local_engine
from metrics import read_metrics
from ray_env import GENERATION, RAY_NAMESPACE, registry_name

pytestmark = [pytest.mark.vllm, pytest.mark.distributed, pytest.mark.system]

REPO_ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
# Small steps keep each run to tens of seconds on 2 cores: 2 ranks x 4 prompts x 4 rollouts.
FAST_RUN = ["--prompts_per_rank", "4", "--sampling.n", "4", "--sampling.max_tokens", "4",
            "--max_tokens_per_gpu", "256", "--progress_bar", "false", "--tensorboard", "false",
            "--data.max_prompt_tokens", "16", "--eval.every", "0"]
TRAINER_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(demo_assets: Path, tmp_path_factory: pytest.TempPathFactory):
    config = LocalClusterConfig(
        model_path=str(demo_assets / "model"), log_dir=str(tmp_path_factory.mktemp("worker-logs")),
        generation_workers=1, logprob_workers=1, num_cpus=8, global_num_verifiers=1,
        engine=local_engine(kv_cache_memory_bytes=128 * 2**20, max_num_seqs=256, max_model_len=64),
    )
    with LocalCluster(config) as running:
        running.start_workers()
        yield running


def _train(cluster: LocalCluster, demo_assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    log = run_dir.parent / f"{run_dir.name}.trainer.log"
    args = ["--config", str(REPO_ROOT / "configs" / "demo.yaml"), "--run_dir", str(run_dir),
            "--model.model_path", str(demo_assets / "model"), "--data.path", str(demo_assets / "arithmetic.jsonl"),
            *FAST_RUN, *extra]
    code = cluster.run_trainer(args, nproc_per_node=WORLD_SIZE, timeout_s=TRAINER_TIMEOUT_S, log_path=log)
    assert code == 0, f"trainer exited {code}:\n" + "\n".join(log.read_text().splitlines()[-40:])
    return read_metrics(run_dir / "metrics.jsonl")


def _generation_versions() -> list[int]:
    import ray

    registry = ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
    return [status.weight_version for status in ray.get(registry.status.remote())]


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


def test_few_steps_train_push_and_log(cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    # 8 rollouts per prompt: the warmed-up model scores ~7%, so with 4 a whole step often has only
    # equal-reward groups (advantage 0, and at step 0 the KL term's gradient is 0 too).
    from dataset import write_arithmetic_table

    table = write_arithmetic_table(tmp_path / "eval.jsonl", max_operand=2)  # 9 held-out prompts
    # Beside math-verify, a second reward function that raises on every rollout (the arithmetic
    # records carry no `tests`): the failures must reach each step's record, counted by reason.
    records = _train(cluster, demo_assets, tmp_path / "run", "--num_steps", "3", "--max_lag", "1",
                     "--sampling.n", "8", "--eval.every", "2", "--eval.data.path", str(table),
                     "--eval.pass_k", "2", "--sampling.reward.functions", "math_verifier:math_verify_reward",
                     "code_reward:run_tests")
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
    final = _load_weights(latest_checkpoint(tmp_path / "run"))
    base = _load_weights(demo_assets / "model")
    assert any(not torch.equal(final[k], base[k]) for k in base)
    assert _generation_versions() == [3]
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "max_lag: 1" in config and "num_steps: 3" in config


@pytest.mark.parametrize("max_lag", [0, 1])
def test_max_lag_bounds_staleness(cluster: LocalCluster, demo_assets: Path, tmp_path: Path, max_lag: int) -> None:
    records = _train(cluster, demo_assets, tmp_path / "run", "--num_steps", "3", "--max_lag", str(max_lag),
                     "--checkpoint_every", "0")
    assert max(r["staleness/max"] for r in records) <= max_lag
    assert all(r["counts/dropped_stale"] == 0 for r in records)
    if max_lag == 1:
        # Steps 1+ were generated while the previous step trained: one version old.
        assert any(r["staleness/max"] == 1 for r in records[1:])


def test_push_every_two_trains_every_step_on_fresh_rollouts(cluster: LocalCluster, demo_assets: Path,
                                                            tmp_path: Path) -> None:
    """push_every 2 publishes only even weight versions. A step's prompts must wait for a published
    version within max_lag of it: no rollout may be dropped as stale, no step may train on nothing."""
    records = _train(cluster, demo_assets, tmp_path / "run", "--num_steps", "4", "--max_lag", "1",
                     "--push_every", "2", "--checkpoint_every", "0")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records:
        assert record["counts/dropped_stale"] == 0, record
        assert record["counts/samples"] == WORLD_SIZE * 4 * 4, record
        # Versions 0 and 2 are the only ones published before steps 0-3 train: each step's rollouts
        # come from the newest even version not after it, so odd steps lag by 1, even ones by 0.
        assert record["staleness/max"] == record["step"] % 2, record
    assert _generation_versions() == [4]  # the last step always pushes


def _seeded_tokens(demo_assets: Path, seed: int | None) -> list[list[list[int]]]:
    """The generation worker's completions of the first three demo prompts, sampled with `seed`."""
    import ray

    from dataset import DatasetConfig, load_prompts
    from setup_model import load_tokenizer
    from sampling import SamplingConfig

    prompts = load_prompts(DatasetConfig(path=str(demo_assets / "arithmetic.jsonl"), max_prompt_tokens=16),
                           load_tokenizer(demo_assets / "model"))[:3]
    sampling = SamplingConfig(n=8, max_tokens=4, seed=seed)
    registry = ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
    groups = ray.get([registry.submit.remote("generate", p, sampling, cost=sampling.n) for p in prompts])
    return [[r.output_token_ids for r in group] for group in groups]


def test_seeded_requests_repeat_exactly_and_steps_differ(cluster: LocalCluster, demo_assets: Path) -> None:
    """The real engine: one request seed gives the same completions again; the seed the batcher
    derives for another step gives other ones (8 samples of a 0-18 answer rarely repeat)."""
    from sampling import derive_seed

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


def test_resume_continues_like_an_uninterrupted_run(cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    """2 steps, then a resume to 4: the data position, the per-step metrics and the final
    checkpoint (weights, AdamW state, lr schedule, sampler, RNG) match an uninterrupted 4-step run."""
    run = tmp_path / "run"
    _train(cluster, demo_assets, run, "--num_steps", "2", "--checkpoint_every", "2")
    assert latest_checkpoint(run).name == "step_000002"
    half_written = run / "checkpoints" / "step_000004.tmp"
    half_written.mkdir()
    (half_written / "trainer_state.json").write_text("{}")  # looks tempting, must be ignored

    records = _train(cluster, demo_assets, run, "--num_steps", "4", "--resume", "true")
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

    # The same 4 steps without the interruption (demo.yaml: max_lag 0, warmup, so lr changes per step).
    whole = tmp_path / "whole"
    reference = _train(cluster, demo_assets, whole, "--num_steps", "4")
    assert [r["step"] for r in reference] == [0, 1, 2, 3]
    worst = {}
    for got, want in zip(records, reference):
        for key in RESUME_METRICS:
            diff = abs(got[key] - want[key]) / max(abs(want[key]), METRIC_FLOOR)
            worst[key] = max(worst.get(key, 0.0), diff)
    print(f"resumed vs uninterrupted metrics, worst relative difference over steps 0-3: {worst}")
    assert max(worst.values()) <= METRIC_RTOL, (worst, records, reference)
    _assert_same_checkpoint(latest_checkpoint(run), latest_checkpoint(whole))


def test_rank0_data_path_trains_like_per_rank(cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    """data_path rank0 (rank 0 reads every rank's minibatches and scatters them over gloo) trains
    the same 3 steps as the per-rank path: data order, per-step metrics and final checkpoint."""
    runs = {kind: tmp_path / kind for kind in ("per_rank", "rank0")}
    records = {kind: _train(cluster, demo_assets, run, "--num_steps", "3", "--data_path", kind)
               for kind, run in runs.items()}
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
    assert drawn["rank0"] == drawn["per_rank"] and len(drawn["per_rank"]) == 3 * WORLD_SIZE
    assert {k: sorted(v) for k, v in trained["rank0"].items()} == {k: sorted(v) for k, v in trained["per_rank"].items()}
    worst = {}
    for got, want in zip(records["rank0"], records["per_rank"], strict=True):
        for key in RESUME_METRICS:
            worst[key] = max(worst.get(key, 0.0), abs(got[key] - want[key]) / max(abs(want[key]), METRIC_FLOOR))
    print(f"rank0 vs per_rank metrics, worst relative difference over steps 0-2: {worst}")
    assert max(worst.values()) <= METRIC_RTOL, worst
    # Where the data went: all of it over Ray on per_rank; on rank0, rank 1's share by scatter.
    assert all(r["data/scatter_bytes"] == 0 and r["data/ray_bytes"] > 0 for r in records["per_rank"])
    for got, want in zip(records["rank0"], records["per_rank"]):
        assert got["data/ray_bytes"] == want["data/ray_bytes"] and 0 < got["data/scatter_bytes"] < got["data/ray_bytes"]
    _assert_same_checkpoint(latest_checkpoint(runs["rank0"]), latest_checkpoint(runs["per_rank"]))


# The easiest demo setting: operands 0-2 (9 prompts), so each prompt gets many rollouts per step.
# In a single-process probe of this setting reward went 0.04 -> 0.27 in 20 steps (from chance,
# since the model was only taught the answer format). The margin below is well inside that.
LEARNING_STEPS = 30
LEARNING_MARGIN = 0.10


def test_reward_rises_on_the_easiest_setting(cluster: LocalCluster, demo_assets: Path, tmp_path: Path) -> None:
    from dataset import write_arithmetic_dataset

    easy = write_arithmetic_dataset(tmp_path / "easy.jsonl", num_samples=300, seed=1, max_operand=2)
    records = _train(cluster, demo_assets, tmp_path / "run", "--num_steps", str(LEARNING_STEPS),
                     "--data.path", str(easy), "--prompts_per_rank", "16", "--sampling.n", "16",
                     "--max_tokens_per_gpu", "4096", "--checkpoint_every", "0")
    rewards = [r["reward/mean"] for r in records]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert end >= start + LEARNING_MARGIN, f"reward did not rise by {LEARNING_MARGIN}: {rewards}"
