"""Step time with generation overlapped with training (max_lag=1) vs synchronous (max_lag=0).

    cd /work/main && .venv/bin/python -m benchmarks.async_overlap                 # all three modes
    .venv/bin/python -m benchmarks.async_overlap --modes simulated                # simulated engine only, ~4-6 min
    .venv/bin/python -m benchmarks.async_overlap --modes split --cpu_generation_cores 1  # real engine, own cores
    .venv/bin/python -m benchmarks.async_overlap --assets_dir runs/demo-assets    # reuse prepared demo assets
    .venv/bin/python -m benchmarks.async_overlap ... --attach 127.0.0.1:PORT       # real mode on a running cluster

Every mode runs `torchrun --nproc_per_node=2 trainer_core.py` (FSDP2 on gloo) in one local
cluster, alternating max_lag=0 and max_lag=1 runs of `--num_steps` steps (`--rounds` pairs),
each from step 0 with settings otherwise identical. Alternating spreads slow drifts in the
machine's load over both settings. Per setting, the median `timing/step_s` is taken over the
steady-state steps of its runs: each run's first `--skip_steps` (start-up, and the two steps
max_lag=1 submits before training starts) and its last step (max_lag=1 has no next step to
generate during it) are left out. `speedup = t(max_lag=0) / t(max_lag=1)`. Each run's own median
and the machine's load average are printed too: other processes on the same cores make single
steps noisy.

- real: the real vLLM generation worker and the real logprob worker (reference logprobs) on the
  demo model (scripts/prepare_demo.py, short format warm-up), launched by LocalCluster. On a
  2-core machine generation, logprobs and both trainer ranks compete for the same cores, so
  overlapping them cannot shorten a step much: expect a speedup near 1.
- split: the same real workers with generation and training on cores of their own (the launcher's
  `--cpu_split split`, launch/cpu_plan.py: `--cpu_generation_cores` for generation, engine and
  logprob worker with Ray and the batcher; the rest for both trainer ranks), in a cluster of its
  own. Its max_lag=0 runs measure G, the trainer's wait per step (generation, logprobs and
  batching: the demo's step fills one minibatch per rank, trained once it is full) and T, the
  rest of its step (`timing/step_s - timing/wait_s`); the ideal speedup is (G + T) / max(G, T).
- simulated: the generation engine is SIMULATED: a small Ray actor registered in the generation
  registry that sleeps a fixed latency G per request (all of a step's requests sleep
  concurrently, like one engine batch on hardware of its own), then returns uniformly random
  tokens of length `sampling.max_tokens`, random 0/1 rewards and group advantages, and that
  fetches and assembles every weight push like a real worker. The trainer runs with
  `logprob_role: none`. Unless `--sim_latency_s` gives G, a first calibration run (max_lag=0, G
  tiny) measures T, the trainer's busy time per step (`timing/step_s - timing/wait_s`:
  forward/backward, optimizer, weight push, bookkeeping), then G is set to T, where overlap helps
  most. The ideal speedup is (G + T) / max(G, T) (2 at G = T), with T re-measured in the
  comparison's own max_lag=0 runs; overlap_efficiency = measured / ideal.

Reference points: one-step-off async GRPO reports 1.2-1.4x (verl), fully async 2.3-2.8x at
scale (AReaL, many generation GPUs per trainer GPU); with one pipeline stage each the ceiling
is 2x, reached when generation and training take equal time.

The LAST line is key=value pairs: `speedup=<real> split_speedup=... split_ideal=...
split_efficiency=... split_G_s=... split_T_s=... simulated_speedup=<x> simulated_ideal=<y>
overlap_efficiency=<z> G_s=... T_s=...` (the simulated mode's G and T), each for the modes run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Literal

from async_grpo.algo.advantages import group_advantages  # the batcher's default, grpo
from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import VerificationConfig
from async_grpo.launch.cpu_plan import CpuPlanConfig
from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, worker_actor_name
from async_grpo.config.sampling import SamplingConfig
from async_grpo.routing.batch_calls import Bundle, serve_many
from async_grpo.weights.update import WeightUpdate
from async_grpo.weights.worker_loader import assemble_state_dict
from benchmarks.clusters import AttachConfig, local_cluster
from benchmarks.harness import (
    apply_smoke, demo_assets, DEMO_CONFIG, DemoAssets, load_bench_config, run_engine, run_trainer, setup_logging,
    summary_line,
)
from local_cluster import LocalCluster, LocalClusterConfig
from sample_processing_utils import Sample
from vllm_registry import RegistryConfig, WorkerHealth, get_or_create_registry

logger = logging.getLogger(__name__)

WORLD_SIZE = 2  # trainer ranks, as in the demo and the end-to-end tests
LAGS = (0, 1)  # synchronous, then one-step-off
# Short warm-up: the benchmark needs a model that emits answer-shaped completions, not a good one.
WARMUP_STEPS = 50
NUM_PROMPTS = 500
MAX_MODEL_LEN = 64  # demo prompts are <= 16 tokens; completions are a few tokens
KV_CACHE_BYTES = 128 * 2**20  # plenty for 64-token sequences; small enough on a busy machine
# The simulated engine is a single worker that takes every request at once: lift the registry's
# per-worker cap so that max_lag + 1 steps of requests are never throttled by routing.
SIM_REGISTRY_CAP = 1_000_000
SIM_ACTOR_MAX_CONCURRENCY = 10_000  # every in-flight request holds one actor slot while it sleeps
SIM_CALIBRATION_LATENCY_S = 0.05  # G during calibration: small, so T is measured nearly alone
SIM_REWARD_PROBABILITY = 0.5  # coin-flip rewards: most groups have a spread, so most advantages are non-zero


# The smoke's G is fixed, so it skips the calibration run (one trainer launch fewer); its figures mean nothing.
SMOKE = {"num_steps": 3, "rounds": 1, "skip_steps": 1, "prompts_per_rank": 2, "n": 2,
         "sim_latency_s": SIM_CALIBRATION_LATENCY_S}


@dataclass(kw_only=True, frozen=True)
class AsyncOverlapConfig:
    """Command line of `python -m benchmarks.async_overlap`."""

    modes: list[Literal["real", "split", "simulated"]] = field(default_factory=lambda: ["real", "split", "simulated"])
    """Which engines to measure: the real vLLM worker on shared cores, the real one with generation and
    training on cores of their own, the SIMULATED one; any of them."""
    assets_dir: str | None = None
    """Existing scripts/prepare_demo.py output; None: prepare one in the work dir."""
    work_dir: str | None = None
    """Where runs and logs go; None: a fresh temp dir."""
    num_steps: int = 8
    """Optimizer steps per trainer run."""
    rounds: int = 2
    """Alternating (max_lag 0, max_lag 1) pairs of runs."""
    skip_steps: int = 2
    """Leading steps of each run left out of the median."""
    prompts_per_rank: int = 16
    """Prompts each rank submits per step."""
    n: int = 8
    """Rollouts per prompt."""
    max_tokens: int = 4
    """Real mode's completion cap (the demo's: 4)."""
    sim_max_tokens: int = 16
    """Simulated mode's completion length (the simulated engine always emits exactly this many)."""
    sim_latency_s: float | None = None
    """Simulated G, seconds per request; None: T measured by the calibration run."""
    cpu_generation_cores: int | None = None
    """Split mode: the cores generation gets (local_cluster.py's --cpu_generation_cores); None: half."""
    calibration_steps: int = 6
    """Steps of the simulated mode's calibration run (max_lag=0, tiny G; only when sim_latency_s is None)."""
    trainer_timeout_s: float = 600.0
    """Kill a trainer run that takes longer than this."""
    cluster: AttachConfig = flattened(AttachConfig())
    """`--attach` (benchmarks/clusters.py), for the real mode's runs: the split and simulated modes always
    start their own cluster (their cores are planned at start; the simulated engine is the only worker)."""
    smoke: bool = False
    """Smoke mode: every mode, one round of 3-step runs of 2 prompts x 2 rollouts, a fixed simulated G (no
    calibration run), the real engine uncompiled (SMOKE); checks that the command runs, its figures mean nothing."""

    def bench(self, max_tokens: int) -> BenchConfig:
        """One mode's run shape, with that mode's completion length."""
        return BenchConfig(num_steps=self.num_steps, rounds=self.rounds, skip_steps=self.skip_steps,
                           prompts_per_rank=self.prompts_per_rank, n=self.n, max_tokens=max_tokens,
                           trainer_timeout_s=self.trainer_timeout_s)


@dataclass(kw_only=True, frozen=True)
class BenchConfig:
    """What each trainer run looks like; both max_lag runs of a mode share it."""

    num_steps: int
    """Optimizer steps per trainer run."""
    rounds: int
    """How many times the pair of runs (max_lag 0, then 1) is repeated, alternating."""
    skip_steps: int
    """Leading steps left out of the median (start-up; max_lag=1 pre-submits steps 0 and 1)."""
    prompts_per_rank: int
    """Prompts each rank submits per step."""
    n: int
    """Rollouts per prompt."""
    max_tokens: int
    """Completion length cap (the simulated engine always emits exactly this many tokens)."""
    trainer_timeout_s: float
    """Kill a trainer run that takes longer than this."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "rounds", "prompts_per_rank", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.skip_steps <= self.num_steps - 2:
            raise ValueError(
                f"BenchConfig.skip_steps must leave >= 1 step besides the last, got {self.skip_steps} of {self.num_steps}"
            )


@dataclass(slots=True)
class RunTimes:
    """Medians over steady-state steps (one run's, or all runs' of one max_lag), in seconds."""

    step_s: float
    wait_s: float
    train_s: float
    push_s: float
    busy_s: float
    """Median of step_s - wait_s: trainer time not spent waiting for rollouts (what generation
    can hide behind)."""
    steps: int
    """Steps the medians are taken over."""
    max_staleness: int


class SimulatedGenerationEngine:
    """SIMULATED generation worker: fixed latency, random tokens and rewards, real weight fetches.

    Implements the generation worker's actor interface (generate, call_many, update_weights, health), so
    the registry and the batcher treat it like a vLLM worker. Wrapped with ray.remote at start.
    """

    def __init__(self, name: str, latency_s: float, vocab_size: int, seed: int) -> None:
        self.name = name
        self.latency_s = latency_s
        self.vocab_size = vocab_size
        self.weight_version = -1
        self.inflight = 0
        self.weight_bytes = 0
        self._rng = random.Random(seed)

    async def set_latency(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def generate(self, sample: Sample, sampling: SamplingConfig) -> list[Sample]:
        """n completions of sampling.max_tokens uniform random tokens after latency_s."""
        version = self.weight_version  # like vLLM: the version at request start
        self.inflight += 1
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.inflight -= 1
        rewards = [float(self._rng.random() < SIM_REWARD_PROBABILITY) for _ in range(sampling.n)]
        advantages = group_advantages(rewards, scale_by_std=True, eps=1e-4)
        uniform_logprob = -math.log(self.vocab_size)  # tokens are drawn uniformly: exact sampler logprob
        return [self._completion(sample, sampling.max_tokens, reward, advantage, version, uniform_logprob)
                for reward, advantage in zip(rewards, advantages)]

    def _completion(self, sample: Sample, length: int, reward: float, advantage: float, version: int,
                    logprob: float) -> Sample:
        tokens = [self._rng.randrange(self.vocab_size) for _ in range(length)]
        return Sample(
            input_token_ids=list(sample.input_token_ids), gt_answer=sample.gt_answer, prompt_id=sample.prompt_id,
            output_token_ids=tokens, sampling_logprobs=[logprob] * length, finish_reason="length",
            truncated=True, reward=reward, advantage=advantage, weight_version=version,
        )

    async def update_weights(self, update: WeightUpdate) -> int:
        """Fetch and assemble the pushed weights as a real worker does, then serve the version."""
        shards = await asyncio.gather(*update.shard_refs)
        state_dict = await asyncio.to_thread(assemble_state_dict, shards)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        self.weight_version = update.version
        return self.weight_version

    async def call_many(self, method: str, calls: Bundle) -> AsyncIterator[Bundle]:
        """The batched entry the registry's clients use (batch_calls.BATCH_METHOD), as a worker has it."""
        async for chunk in serve_many(self, ("generate",), method, calls):
            yield chunk

    async def mark_ready(self) -> None:
        """The registry's last registration step (a real worker's INIT -> READY); nothing to do here."""

    async def health(self) -> WorkerHealth:
        import ray

        return WorkerHealth(
            name=self.name, kind=GENERATION, node_id=ray.get_runtime_context().get_node_id(),
            weight_version=self.weight_version, inflight_requests=self.inflight, healthy=True,
            detail=f"SIMULATED engine, latency {self.latency_s:.3f} s, last update {self.weight_bytes} bytes",
        )


def prepare_assets(out_dir: Path) -> DemoAssets:
    """The demo model (short format warm-up), prompts and evaluation table (scripts/prepare_demo.py)."""
    logger.info("preparing demo assets in %s (%d warm-up steps)", out_dir, WARMUP_STEPS)
    return demo_assets(out_dir, ("--warmup_steps", str(WARMUP_STEPS), "--num_prompts", str(NUM_PROMPTS)))


def trainer_args(assets: Path, run_dir: Path, cfg: BenchConfig, num_steps: int, max_lag: int,
                 extra: list[str]) -> list[str]:
    """trainer_core.py flags: the demo config with this benchmark's step shape."""
    return [
        "--config", str(DEMO_CONFIG), "--run_dir", str(run_dir),
        "--model.model_path", str(assets / "model"), "--data.path", str(assets / "arithmetic.jsonl"),
        "--num_steps", str(num_steps), "--max_lag", str(max_lag),
        "--prompts_per_rank", str(cfg.prompts_per_rank), "--sampling.n", str(cfg.n),
        "--sampling.max_tokens", str(cfg.max_tokens), "--checkpoint_every", "0",
        # No evaluation: it is not what this benchmark times (the table is named all the same, so the
        # demo's config stays complete if a trainer flag turns evaluation back on).
        "--eval.data.path", str(DemoAssets(root=assets).eval_table), "--eval.every", "0",
        "--progress_bar", "false", "--tensorboard", "false", *extra,
    ]


def train_run(cluster: LocalCluster, args: list[str], run_dir: Path, num_steps: int,
              timeout_s: float) -> list[dict[str, Any]]:
    """One trainer run of num_steps steps from step 0; returns its metrics records.

    A run that exits non-zero is an error, with the tail of its log.
    """
    run = run_trainer(cluster, args, run_dir, nproc_per_node=WORLD_SIZE, timeout_s=timeout_s,
                      log=run_dir.parent / f"{run_dir.name}.trainer.log")
    records = run.require(num_steps)
    logger.info("%s (%d steps) finished in %.0f s", run_dir.name, num_steps, run.wall_s)
    return records


def steady(records: list[dict[str, Any]], skip_steps: int) -> list[dict[str, Any]]:
    """A run's steps without its first skip_steps and its last (no next step to overlap with)."""
    kept = records[skip_steps:-1]
    if not kept:
        raise ValueError(f"no steady-state steps among {len(records)} records (skip {skip_steps})")
    return kept


def summarise(records: list[dict[str, Any]]) -> RunTimes:
    """Medians of steady-state step records."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in records)

    return RunTimes(
        step_s=median("timing/step_s"), wait_s=median("timing/wait_s"), train_s=median("timing/train_s"),
        push_s=median("timing/push_s"),
        busy_s=statistics.median(r["timing/step_s"] - r["timing/wait_s"] for r in records), steps=len(records),
        max_staleness=int(max(r["staleness/max"] for r in records)),
    )


def run_schedule(cluster: LocalCluster, assets: Path, work: Path, prefix: str, cfg: BenchConfig,
                 extra: list[str]) -> dict[int, RunTimes]:
    """Alternate max_lag 0 and 1 for cfg.rounds rounds; every run starts afresh at step 0.

    Alternating spreads slow drifts in the machine's load over both settings.
    """
    pooled: dict[int, list[dict[str, Any]]] = {lag: [] for lag in LAGS}
    for round_index in range(cfg.rounds):
        for lag in LAGS:
            run_dir = work / f"{prefix}-r{round_index}-lag{lag}"
            records = train_run(cluster, trainer_args(assets, run_dir, cfg, cfg.num_steps, lag, extra), run_dir,
                                cfg.num_steps, cfg.trainer_timeout_s)
            kept = steady(records, cfg.skip_steps)
            pooled[lag].extend(kept)
            print(f"{run_dir.name:<22} median step {summarise(kept).step_s:6.3f} s over {len(kept)} steps "
                  f"(load average now {_load_average()})")
    return {lag: summarise(records) for lag, records in pooled.items()}


def real_cluster_config(assets: Path, log_dir: Path, smoke: bool, cpu: CpuPlanConfig) -> LocalClusterConfig:
    """Real vLLM generation worker + real logprob worker (reference logprobs), uncompiled in smoke
    mode, on the cores `cpu` plans."""
    return LocalClusterConfig(
        model_path=str(assets / "model"), log_dir=str(log_dir), generation_workers=1, logprob_workers=1,
        engine=run_engine(smoke, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN),
        verification=VerificationConfig(global_num_verifiers=1), cpu=cpu,
    )


def run_real(assets: Path, work: Path, cfg: BenchConfig, smoke: bool, attach: str) -> dict[int, RunTimes]:
    """The real workers on shared cores; on the running cluster at `attach` when given."""
    with local_cluster(real_cluster_config(assets, work / "real-workers", smoke, CpuPlanConfig()), attach) as cluster:
        return run_schedule(cluster, assets, work, "real", cfg, [])


@dataclass(slots=True)
class SplitResult:
    times: dict[int, RunTimes]

    @property
    def generation_s(self) -> float:
        """G: what the trainer waits per step at max_lag 0 (generation, logprobs, batching)."""
        return self.times[0].wait_s

    @property
    def trainer_s(self) -> float:
        """T: the rest of the max_lag 0 step (the trainer's busy time)."""
        return self.times[0].busy_s

    @property
    def ideal(self) -> float:
        return (self.generation_s + self.trainer_s) / max(self.generation_s, self.trainer_s)

    @property
    def speedup(self) -> float:
        return self.times[0].step_s / self.times[1].step_s


def run_split(assets: Path, work: Path, cfg: BenchConfig, smoke: bool, generation_cores: int | None) -> SplitResult:
    """The real workers and the trainer on cores of their own (the launcher's split CPU plan)."""
    cpu = CpuPlanConfig(cpu_split="split", cpu_generation_cores=generation_cores)
    with local_cluster(real_cluster_config(assets, work / "split-workers", smoke, cpu)) as cluster:
        for line in cluster.cpu_plan.lines():
            print(line)
        return SplitResult(times=run_schedule(cluster, assets, work, "split", cfg, []))


def start_simulated_engine(vocab_size: int, latency_s: float):
    """Create the SIMULATED engine actor and register it with the generation registry."""
    import ray

    registry = get_or_create_registry(GENERATION, RegistryConfig(max_inflight_cost_per_worker=SIM_REGISTRY_CAP))
    name = worker_actor_name(GENERATION, ray.get(registry.allocate_index.remote()))
    engine = ray.remote(SimulatedGenerationEngine).options(
        name=name, namespace=RAY_NAMESPACE, num_cpus=0, max_concurrency=SIM_ACTOR_MAX_CONCURRENCY,
    ).remote(name, latency_s, vocab_size, 0)
    ray.get(registry.register.remote(name))
    logger.info("SIMULATED generation engine %s registered (latency %.3f s)", name, latency_s)
    return engine


@dataclass(slots=True)
class SimulatedResult:
    latency_s: float
    """G: the simulated engine's per-request latency."""
    calibration: RunTimes | None
    """max_lag=0 run at a tiny G, which measures T (None: G was given)."""
    times: dict[int, RunTimes]

    @property
    def trainer_s(self) -> float:
        """T: the trainer's busy time per step in the max_lag=0 runs (measured beside the comparison;
        the calibration run's estimate only chose G)."""
        return self.times[0].busy_s

    @property
    def ideal(self) -> float:
        return (self.latency_s + self.trainer_s) / max(self.latency_s, self.trainer_s)


def run_simulated(assets: Path, work: Path, cfg: BenchConfig, latency_s: float | None,
                  calibration_steps: int) -> SimulatedResult:
    """Unless G is given: calibrate T with a near-zero G and set G = T. Then max_lag 0 vs 1."""
    import ray

    vocab_size = json.loads((assets / "model" / "config.json").read_text())["vocab_size"]
    cluster_config = LocalClusterConfig(model_path=str(assets / "model"), log_dir=str(work / "sim-workers"),
                                        logprob_workers=0)
    extra = ["--logprob_role", "none", "--loss.kl_coef", "0"]
    with LocalCluster(cluster_config) as cluster:
        engine = start_simulated_engine(vocab_size, SIM_CALIBRATION_LATENCY_S)
        calibration = None
        if latency_s is None:
            run_dir = work / "sim-calibration"
            records = train_run(cluster, trainer_args(assets, run_dir, cfg, calibration_steps, 0, extra), run_dir,
                                calibration_steps, cfg.trainer_timeout_s)
            calibration = summarise(steady(records, min(cfg.skip_steps, calibration_steps - 2)))
            logger.info("calibration: T = %.3f s per step", calibration.busy_s)
        chosen = latency_s if latency_s is not None else calibration.busy_s
        logger.info("SIMULATED G = %.3f s", chosen)
        ray.get(engine.set_latency.remote(chosen))
        times = run_schedule(cluster, assets, work, "sim", cfg, extra)
    return SimulatedResult(latency_s=chosen, calibration=calibration, times=times)


def describe(label: str, times: dict[int, RunTimes]) -> None:
    for lag, t in times.items():
        print(f"{label:<10} max_lag={lag}  step {t.step_s:6.3f} s  wait {t.wait_s:6.3f} s  "
              f"train {t.train_s:6.3f} s  push {t.push_s:6.3f} s  busy {t.busy_s:6.3f} s  "
              f"(median of {t.steps} steps, max staleness {t.max_staleness})")


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    args = load_bench_config(AsyncOverlapConfig, argv, description=__doc__)
    args = apply_smoke(args, SMOKE)
    setup_logging()

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="async-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = Path(args.assets_dir) if args.assets_dir else prepare_assets(work / "assets").root
    summary: dict[str, str] = {}
    load_before = _load_average()
    if "real" in args.modes:
        real = run_real(assets, work, args.bench(args.max_tokens), args.smoke, args.cluster.attach)
        describe("real", real)
        print("real: vLLM generation, the logprob worker and both trainer ranks share "
              f"{os.cpu_count()} cores, so overlap can only fill time when the cores would otherwise idle")
        summary["speedup"] = f"{real[0].step_s / real[1].step_s:.3f}"
    if "split" in args.modes:
        split = run_split(assets, work, args.bench(args.max_tokens), args.smoke, args.cpu_generation_cores)
        describe("split", split.times)
        print(f"split: G = {split.generation_s:.3f} s (trainer wait, max_lag=0), T = {split.trainer_s:.3f} s "
              f"(the rest of its step); speedup {split.speedup:.3f}, ideal (G + T) / max(G, T) = {split.ideal:.3f}")
        summary.update(split_speedup=f"{split.speedup:.3f}", split_ideal=f"{split.ideal:.3f}",
                       split_efficiency=f"{split.speedup / split.ideal:.3f}", split_G_s=f"{split.generation_s:.3f}",
                       split_T_s=f"{split.trainer_s:.3f}")
    if "simulated" in args.modes:
        sim = run_simulated(assets, work, args.bench(args.sim_max_tokens), args.sim_latency_s,
                            args.calibration_steps)
        calibrated = "given" if sim.calibration is None else f"calibration T was {sim.calibration.busy_s:.3f} s"
        print(f"SIMULATED generation engine: G = {sim.latency_s:.3f} s per request (fixed sleep; {calibrated}); "
              f"T = {sim.trainer_s:.3f} s trainer busy time per step (step - wait, max_lag=0 runs)")
        describe("simulated", sim.times)
        measured = sim.times[0].step_s / sim.times[1].step_s
        summary.update(simulated_speedup=f"{measured:.3f}", simulated_ideal=f"{sim.ideal:.3f}",
                       overlap_efficiency=f"{measured / sim.ideal:.3f}", G_s=f"{sim.latency_s:.3f}",
                       T_s=f"{sim.trainer_s:.3f}")
    print(f"runs and logs: {work}; load average at start {load_before}, at end {_load_average()} "
          f"on {os.cpu_count()} cores")
    print(summary_line("async_overlap", summary))


if __name__ == "__main__":
    main()
