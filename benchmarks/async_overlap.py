"""Step time with generation overlapped with training (max_lag=1) vs synchronous (max_lag=0).

    cd /work/main && .venv/bin/python -m benchmarks.async_overlap                 # all three modes
    .venv/bin/python -m benchmarks.async_overlap --modes simulated                # simulated engine only, ~4-6 min
    .venv/bin/python -m benchmarks.async_overlap --modes split --cpu_generation_cores 1  # real engine, own cores
    .venv/bin/python -m benchmarks.async_overlap --assets_dir runs/demo-assets    # reuse prepared demo assets
    .venv/bin/python -m benchmarks.async_overlap ... --attach 127.0.0.1:PORT       # real mode on a running cluster

Each mode, in the order given, is a preset of the A/B runner (benchmarks/ab_parts.py): the demo
(`torchrun --nproc_per_node=2 trainer_core.py`, FSDP2 on gloo) with this benchmark's step shape
(`--prompts_per_rank`, `--n`, the mode's completion length), A = max_lag 0 and B = max_lag 1,
alternating for `--rounds` pairs of `--num_steps`-step runs in one local cluster, each from step 0
with settings otherwise identical (runs in <work_dir>/<mode>/). Per setting, medians over the
steady-state steps of its runs: each run's first `--skip_steps` (start-up, and the two steps
max_lag=1 submits before training starts) and its last step (max_lag=1 has no next step to
generate during it) are left out. `speedup = t(max_lag=0) / t(max_lag=1)` of the median
`timing/step_s`. The runner prints each run's own median and the machine's load average: other
processes on the same cores make single steps noisy.

- real: the real vLLM generation worker and the real logprob worker (reference logprobs) on the
  demo model (scripts/prepare_demo.py, short format warm-up), launched by LocalCluster. On a
  2-core machine generation, logprobs and both trainer ranks compete for the same cores, so
  overlapping them cannot shorten a step much: expect a speedup near 1.
- split: the same real workers with generation and training on cores of their own (the launcher's
  `--cpu_split split`, launch/cpu_plan.py: `--cpu_generation_cores` for generation, engine and
  logprob worker with Ray and the batcher; the rest for both trainer ranks), in a cluster of its
  own. Its max_lag=0 runs measure G, the trainer's wait per step (generation, logprobs and
  batching: the demo's step fills one minibatch per rank, trained once it is full) and T, the
  rest of its step (`timing/busy_s` = `timing/step_s - timing/wait_s`); the ideal speedup is
  (G + T) / max(G, T) (ab_parts.overlap_ideal).
- simulated: the generation engine is SIMULATED: a small Ray actor registered in the generation
  registry that sleeps a fixed latency G per request (all of a step's requests sleep
  concurrently, like one engine batch on hardware of its own), then returns uniformly random
  tokens of length `sampling.max_tokens`, random 0/1 rewards and group advantages, and that
  fetches and assembles every weight push like a real worker. The trainer runs with
  `logprob_role: none`. Unless `--sim_latency_s` gives G, a first calibration run (max_lag=0
  alone, G tiny) measures T, the trainer's busy time per step (forward/backward, optimizer, weight
  push, bookkeeping), then G is set to T, where overlap helps most. The ideal speedup is
  (G + T) / max(G, T) (2 at G = T), with T re-measured in the comparison's own max_lag=0 runs;
  overlap_efficiency = measured / ideal.

Reference points: one-step-off async GRPO reports 1.2-1.4x (verl), fully async 2.3-2.8x at
scale (AReaL, many generation GPUs per trainer GPU); with one pipeline stage each the ceiling
is 2x, reached when generation and training take equal time.

The LAST line is key=value pairs: `speedup=<real> split_speedup=... split_ideal=...
split_efficiency=... split_G_s=... split_T_s=... simulated_speedup=<x> simulated_ideal=<y>
overlap_efficiency=<z> G_s=... T_s=...` (the simulated mode's G and T), each for the modes run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Literal

from async_grpo.algo.advantages import group_advantages  # the batcher's default, grpo
from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import VerificationConfig
from async_grpo.launch.cpu_plan import CpuPlanConfig
from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, worker_actor_name
from async_grpo.config.sampling import SamplingConfig
from async_grpo.routing.batch_calls import Bundle, serve_many
from async_grpo.weights.update import WeightUpdate
from async_grpo.weights.worker_loader import assemble_state_dict
from benchmarks.ab_parts import AbPlan, overlap_ideal, pooled, print_table, ratio, run_ab, Side, Spread, summarise
from benchmarks.clusters import AttachConfig
from benchmarks.harness import (
    apply_smoke, demo_assets, DemoAssets, load_bench_config, run_engine, setup_logging, summary_line,
)
from local_cluster import LocalCluster, LocalClusterConfig
from sample_processing_utils import Sample
from vllm_registry import RegistryConfig, WorkerHealth, get_or_create_registry

logger = logging.getLogger(__name__)

SYNC = Side("max_lag0", ("--max_lag", "0"))
OVERLAP = Side("max_lag1", ("--max_lag", "1"))
KEYS = ("timing/step_s", "timing/wait_s", "timing/train_s", "timing/push_s", "timing/busy_s", "staleness/max")
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

    def __post_init__(self) -> None:
        for name in ("num_steps", "rounds", "prompts_per_rank", "n", "max_tokens", "sim_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AsyncOverlapConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.skip_steps <= self.num_steps - 2:
            raise ValueError(f"AsyncOverlapConfig.skip_steps must leave >= 1 step besides the last, got "
                             f"{self.skip_steps} of {self.num_steps}")
        if self.sim_latency_s is None and self.calibration_steps < 2:
            raise ValueError(f"AsyncOverlapConfig.calibration_steps must be >= 2, got {self.calibration_steps}")


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


def real_cluster_config(assets: Path, log_dir: Path, smoke: bool, cpu: CpuPlanConfig) -> LocalClusterConfig:
    """Real vLLM generation worker + real logprob worker (reference logprobs), uncompiled in smoke
    mode, on the cores `cpu` plans."""
    return LocalClusterConfig(
        model_path=str(assets / "model"), log_dir=str(log_dir), generation_workers=1, logprob_workers=1,
        engine=run_engine(smoke, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN),
        verification=VerificationConfig(global_num_verifiers=1), cpu=cpu,
    )


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


def plan_for(config: AsyncOverlapConfig, assets: Path, out_dir: Path, max_tokens: int, extra: tuple[str, ...] = (),
             **changes) -> AbPlan:
    """A mode's comparison: max_lag 0 against 1 on the demo with this benchmark's step shape."""
    return AbPlan(a=SYNC, b=OVERLAP, rounds=config.rounds, num_steps=config.num_steps, skip=config.skip_steps,
                  tail=1, out_dir=str(out_dir), smoke=config.smoke, assets_dir=str(assets),
                  flags=("--prompts_per_rank", str(config.prompts_per_rank), "--sampling.n", str(config.n),
                         "--sampling.max_tokens", str(max_tokens), *extra),
                  timeout_s=config.trainer_timeout_s, **changes)


def compare(mode: str, plan: AbPlan, cluster: LocalCluster | None = None) -> dict[str, dict[str, Spread]]:
    """A mode's runs (ab_parts.run_ab), its table, and its medians per side."""
    summaries = {name: summarise(records, KEYS) for name, records in pooled(run_ab(plan, cluster)).items()}
    print(f"\n{mode}: median [min-max] over each side's steady-state steps")
    print_table(summaries, KEYS, label=mode)
    return summaries


def overlap_figures(summaries: dict[str, dict[str, Spread]], generation_s: float) -> tuple[float, float, float]:
    """(speedup, T, ideal) of a mode whose generation takes generation_s (G) per step; T: the
    trainer's busy time per step in the max_lag 0 runs."""
    busy_s = summaries[SYNC.name]["timing/busy_s"].median
    return ratio(summaries, "timing/step_s", SYNC.name, OVERLAP.name), busy_s, overlap_ideal(generation_s, busy_s)


def run_real(config: AsyncOverlapConfig, mode: str, assets: Path, work: Path) -> dict[str, str]:
    """The real workers on shared cores (on the cluster at --attach when given), or on cores of
    their own (split, a cluster of its own); G: the trainer's wait at max_lag 0."""
    split = mode == "split"
    cpu = CpuPlanConfig(cpu_split="split", cpu_generation_cores=config.cpu_generation_cores) if split else None
    workers = real_cluster_config(assets, work / f"{mode}-workers", config.smoke, cpu or CpuPlanConfig())
    summaries = compare(mode, plan_for(config, assets, work / mode, config.max_tokens, cluster=workers,
                                       attach="" if split else config.cluster.attach))
    generation_s = summaries[SYNC.name]["timing/wait_s"].median
    speedup, busy_s, ideal = overlap_figures(summaries, generation_s)
    if not split:
        print("real: vLLM generation, the logprob worker and both trainer ranks share "
              f"{os.cpu_count()} cores, so overlap can only fill time when the cores would otherwise idle")
        return {"speedup": f"{speedup:.3f}"}
    print(f"split: G = {generation_s:.3f} s (trainer wait, max_lag=0), T = {busy_s:.3f} s (the rest of its step); "
          f"speedup {speedup:.3f}, ideal (G + T) / max(G, T) = {ideal:.3f}")
    return {"split_speedup": f"{speedup:.3f}", "split_ideal": f"{ideal:.3f}",
            "split_efficiency": f"{speedup / ideal:.3f}", "split_G_s": f"{generation_s:.3f}",
            "split_T_s": f"{busy_s:.3f}"}


def run_simulated(config: AsyncOverlapConfig, assets: Path, work: Path) -> dict[str, str]:
    """Unless G is given: calibrate T with a near-zero G (max_lag 0 alone), and set G = T. Then max_lag 0 vs 1."""
    import ray

    vocab_size = json.loads((assets / "model" / "config.json").read_text())["vocab_size"]
    plan = plan_for(config, assets, work / "simulated", config.sim_max_tokens,
                    ("--logprob_role", "none", "--loss.kl_coef", "0"))
    # No dispatchers: the simulated engine, registered below, is the cluster's only worker.
    with LocalCluster(LocalClusterConfig(model_path=str(assets / "model"), log_dir=str(work / "simulated-workers"),
                                         logprob_workers=0)) as cluster:
        engine = start_simulated_engine(vocab_size, SIM_CALIBRATION_LATENCY_S)
        latency_s = config.sim_latency_s
        if latency_s is None:
            calibration = dataclasses.replace(plan, b=None, num_steps=config.calibration_steps,
                                              skip=min(config.skip_steps, config.calibration_steps - 2),
                                              out_dir=str(work / "simulated-calibration"))
            records = pooled(run_ab(calibration, cluster))[SYNC.name]
            latency_s = summarise(records, ("timing/busy_s",))["timing/busy_s"].median
            logger.info("calibration: T = %.3f s per step", latency_s)
        logger.info("SIMULATED G = %.3f s", latency_s)
        ray.get(engine.set_latency.remote(latency_s))
        summaries = compare("simulated", plan, cluster)
    speedup, busy_s, ideal = overlap_figures(summaries, latency_s)
    print(f"SIMULATED generation engine: G = {latency_s:.3f} s per request (fixed sleep; "
          f"{'given' if config.sim_latency_s is not None else 'the calibration run T'}); T = {busy_s:.3f} s trainer "
          "busy time per step (step - wait, max_lag=0 runs)")
    return {"simulated_speedup": f"{speedup:.3f}", "simulated_ideal": f"{ideal:.3f}",
            "overlap_efficiency": f"{speedup / ideal:.3f}", "G_s": f"{latency_s:.3f}", "T_s": f"{busy_s:.3f}"}


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    config = apply_smoke(load_bench_config(AsyncOverlapConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="async-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = Path(config.assets_dir) if config.assets_dir else prepare_assets(work / "assets").root
    summary: dict[str, str] = {}
    load_before = _load_average()
    for mode in dict.fromkeys(config.modes):
        summary.update(run_simulated(config, assets, work) if mode == "simulated"
                       else run_real(config, mode, assets, work))
    print(f"runs and logs: {work}; load average at start {load_before}, at end {_load_average()} "
          f"on {os.cpu_count()} cores")
    print(summary_line("async_overlap", summary))


if __name__ == "__main__":
    main()
