"""Scale by simulation: how many rollout requests one registry routes per second, and how many
samples the experience batcher delivers, with N stand-in workers over two Ray nodes.

    .venv/bin/python -m benchmarks.scale                       # N = 8, 32, 128; 3 repeats each
    .venv/bin/python -m benchmarks.scale --workers 8 --repeats 1
    .venv/bin/python -m benchmarks.scale --smoke true          # 4 workers, a few requests, < 60 s

No vLLM: each stand-in worker is a Ray actor with a generation worker's methods (`health`,
`mark_ready`, `update_weights`, `generate`, `call_many`) whose `generate` answers `n` rollouts
after a fixed delay. They register with the real generation registry exactly as real workers do
(health, weight catch-up, mark_ready) and are dealt alternately to the two nodes of a loopback
`ray.cluster_utils.Cluster`.

For each N, alternating the two paths in each repeat:
- routing: `requests` generate requests (cost 1) go through the registry and back. Baseline
  (`per_request`): one `submit` actor call each, all in flight at once, as the batcher sent them
  before issue 21. Batched: `BatchedRegistryClient`, `batch` requests per `lease_many` call (a
  rank's prompts of a step), every batch in flight at once. `routed_per_s` = requests / wall
  seconds; `registry_cpu_us` = the registry process's CPU seconds per request (utime + stime from
  /proc); `routing_cpu_us` = the same less the registry's background rate (sampled idle for
  `idle_s` just before) times the run's wall time: the steadier figure on a shared machine, and
  1e6 / it is what one registry could route with a core of its own.
- batcher: an ExperienceBatcher (the real class, in an actor of its own) with `ranks` ranks runs
  `steps` steps of `prompts_per_rank` prompts x `rollouts` rollouts, no logprob pool; each step's
  prompts are submitted, then every rank drains its minibatches to EndOfStep.
  `batcher_samples_per_s` = samples delivered in minibatches / wall seconds, with the batcher's
  generation client per request (baseline, RayRegistryClient) or batched (BatchedRegistryClient,
  what ExperienceBatcherActor uses).

Prints one line per path and repeat, then per N the medians with [min-max] and the load average
beside them, and last `scale: N=<>:routed_per_s=<>,...` key=value pairs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from async_grpo.runtime.ray_access import use_loopback_only_ray
from benchmarks.harness import load_bench_config

_TARGET_ROUTED_PER_S = 20_000  # issue 21: routing must not limit a 64-GPU job
_PROMPT_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # a short prompt: payload size is not what is measured
_OUTPUT_TOKENS = 16  # tokens of each stand-in rollout
_NODES = 2
_WORKER_PREFIX = "scale-generation-worker"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_WARM_UP_REQUESTS = 100
_RAY_ADDRESS_FILE = Path("/tmp/ray/ray_current_cluster")  # Ray's default temp dir


@dataclass(kw_only=True, frozen=True)
class ScaleConfig:
    """Command line of `python -m benchmarks.scale`."""

    workers: list[int] = dataclasses.field(default_factory=lambda: [8, 32, 128])
    """Numbers of stand-in generation workers to measure, each on a fresh registry."""
    repeats: int = 3
    """Runs of each path per N (median and spread are reported)."""
    delay_s: float = 0.05
    """How long a stand-in worker takes to answer one generate request."""
    requests: int = 20_000
    """Generate requests per batched routing run."""
    baseline_requests: int = 2_000
    """Generate requests per per-request routing run (the baseline is ~30x slower)."""
    batch: int = 256
    """Requests per lease_many call in the batched routing run."""
    ranks: int = 8
    """Trainer ranks of the batcher run."""
    prompts_per_rank: int = 64
    """Prompts each rank submits per step in the batcher run."""
    rollouts: int = 8
    """Rollouts per prompt (sampling n) in the batcher run."""
    steps: int = 3
    """Steps per batcher run."""
    idle_s: float = 3.0
    """Seconds the registry's CPU is sampled with no request in flight before each routing run:
    its background rate (Ray's threads, health checks) times the run's wall time is taken out of
    `routing_cpu_us`, which a slow client would otherwise inflate."""
    smoke: bool = False
    """Tiny sizes (4 workers, 1 repeat, a few hundred requests): checks the script runs, < 60 s."""

    def __post_init__(self) -> None:
        if not self.workers or min(self.workers) < _NODES:
            raise ValueError(f"ScaleConfig.workers must list numbers >= {_NODES}, got {self.workers}")
        for name in ("repeats", "requests", "baseline_requests", "batch", "ranks", "prompts_per_rank", "rollouts",
                     "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaleConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.delay_s > 0:
            raise ValueError(f"ScaleConfig.delay_s must be > 0, got {self.delay_s}")
        if not self.idle_s > 0:
            raise ValueError(f"ScaleConfig.idle_s must be > 0, got {self.idle_s}")

    def resolved(self) -> "ScaleConfig":
        if not self.smoke:
            return self
        return dataclasses.replace(self, workers=[4], repeats=1, requests=400, baseline_requests=100, batch=50,
                                   ranks=2, prompts_per_rank=8, rollouts=4, steps=2, idle_s=0.5)


def _stand_in_worker_class() -> Any:
    """The stand-in generation worker actor (built after `import ray`, which must follow
    use_loopback_only_ray)."""
    import ray

    from async_grpo.config.actor_names import GENERATION
    from vllm_registry import Bundle, WorkerHealth, WorkerState, serve_many

    @ray.remote(num_cpus=0, max_concurrency=10_000)
    class StandInGenerationWorker:
        """Answers `generate` with `sampling.n` rollouts after `delay_s`; registers like a real worker."""

        def __init__(self, name: str, delay_s: float) -> None:
            # A stand-in never touches a tensor, but unpickling the Samples it is sent imports
            # sample_processing_utils, which imports torch: ~300 instead of ~90 MB per process,
            # and 128 of them ran this 24 GiB machine out of memory. An empty module stands in.
            sys.modules.setdefault("torch", types.ModuleType("torch"))
            self._name = name
            self._delay_s = delay_s
            self._state = WorkerState.INIT
            self._inflight = 0
            self._served = 0

        async def health(self) -> WorkerHealth:
            return WorkerHealth(name=self._name, kind=GENERATION, node_id=ray.get_runtime_context().get_node_id(),
                                weight_version=-1, inflight_requests=self._inflight, healthy=True, state=self._state,
                                requests_served=self._served)

        async def mark_ready(self) -> None:
            self._state = WorkerState.READY

        async def update_weights(self, update: Any) -> int:
            return update.version

        async def generate(self, sample: Any, sampling: Any) -> list[Any]:
            """Sample and SamplingConfig in, `sampling.n` rollouts out (the worker's signature)."""
            self._inflight += 1
            try:
                await asyncio.sleep(self._delay_s)
            finally:
                self._inflight -= 1
            self._served += 1
            return [dataclasses.replace(sample, output_token_ids=[9] * _OUTPUT_TOKENS,
                                        sampling_logprobs=[-0.5] * _OUTPUT_TOKENS, finish_reason="stop",
                                        reward=float(k % 2), weight_version=-1)
                    for k in range(sampling.n)]

        async def call_many(self, method: str, calls: Bundle) -> AsyncIterator[Bundle]:
            async for chunk in serve_many(self, ("generate",), method, calls):
                yield chunk

    return StandInGenerationWorker


def _batcher_host_class() -> Any:
    """An actor holding a real ExperienceBatcher with a chosen generation client."""
    import ray

    from async_grpo.batching.batcher_config import BatcherConfig
    from sample_processing_utils import Sample
    from vllm_experience_batcher import (
        BatchedRegistryClient, EndOfStep, ExperienceBatcher, Minibatch, RayRegistryClient,
    )

    @ray.remote(num_cpus=0, max_concurrency=1024)
    class BatcherHost:
        def __init__(self, config: BatcherConfig, registry: Any, batched: bool) -> None:
            client = BatchedRegistryClient(registry) if batched else RayRegistryClient(registry)
            self._batcher = ExperienceBatcher(config, client, None)
            self._config = config

        async def run(self, steps: int, prompts_per_rank: int) -> tuple[int, float]:
            """Run the steps; (samples delivered in loss-carrying minibatches, wall seconds)."""
            started = time.perf_counter()
            delivered = 0
            for step in range(steps):
                for rank in range(self._config.world_size):
                    first = (step * self._config.world_size + rank) * prompts_per_rank
                    prompts = [Sample(input_token_ids=list(_PROMPT_TOKENS), gt_answer="1", prompt_id=first + i)
                               for i in range(prompts_per_rank)]
                    await self._batcher.submit_prompts(rank, step, prompts)
                counts = await asyncio.gather(*(self._drain(rank, step) for rank in range(self._config.world_size)))
                delivered += sum(counts)
            return delivered, time.perf_counter() - started

        async def _drain(self, rank: int, step: int) -> int:
            samples = 0
            while not isinstance(message := await self._batcher.next_message(rank, step), EndOfStep):
                assert isinstance(message, Minibatch)
                samples += len(message.samples) if message.loss_weight > 0 else 0
            return samples

    return BatcherHost


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class Bench:
    """One cluster, one registry at a time, N stand-in workers per measurement."""

    def __init__(self, config: ScaleConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.config = config
        self._ray = ray
        self._affinity = NodeAffinitySchedulingStrategy
        self._worker_class = _stand_in_worker_class()
        self._host_class = _batcher_host_class()
        self.nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]

    def start_pool(self, count: int) -> tuple[Any, list[Any]]:
        """A fresh generation registry with `count` stand-in workers registered, dealt over the nodes."""
        from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE
        from vllm_registry import RegistryConfig, get_or_create_registry

        ray = self._ray
        registry = get_or_create_registry(GENERATION, RegistryConfig())
        workers = []
        for index in range(count):
            name = f"{_WORKER_PREFIX}-{index}"
            strategy = self._affinity(node_id=self.nodes[index % len(self.nodes)], soft=False)
            workers.append(self._worker_class.options(name=name, namespace=RAY_NAMESPACE,
                                                      scheduling_strategy=strategy).remote(name, self.config.delay_s))
        ray.get([w.health.remote() for w in workers])
        ray.get([registry.register.remote(f"{_WORKER_PREFIX}-{i}") for i in range(count)])
        placed = {h.node_id for h in ray.get([w.health.remote() for w in workers])}
        assert len(placed) == len(self.nodes), f"workers on {len(placed)} of {len(self.nodes)} nodes"
        return registry, workers

    def stop_pool(self, registry: Any, workers: list[Any]) -> None:
        ray = self._ray
        for worker in workers:
            ray.kill(worker)
        ray.kill(registry)
        from async_grpo.config.actor_names import GENERATION, RAY_NAMESPACE, registry_name

        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:  # the name is released asynchronously
            try:
                ray.get_actor(registry_name(GENERATION), namespace=RAY_NAMESPACE)
            except ValueError:
                return
            time.sleep(0.1)
        raise RuntimeError("the killed registry's name was not released")

    def registry_pid(self, registry: Any) -> int:
        return self._ray.get(registry.__ray_call__.remote(lambda _actor: os.getpid()))

    def route(self, registry: Any, batched: bool, count: int | None = None) -> dict[str, float]:
        """One routing run of `count` requests (default: the config's for the path); routed_per_s
        and the registry's CPU microseconds per request."""
        from async_grpo.config.sampling import SamplingConfig
        from sample_processing_utils import Sample
        from vllm_experience_batcher import BatchedRegistryClient

        ray = self._ray
        if count is None:
            count = self.config.requests if batched else self.config.baseline_requests
        sampling = SamplingConfig(n=1, max_tokens=_OUTPUT_TOKENS)
        prompts = [Sample(input_token_ids=list(_PROMPT_TOKENS), gt_answer="1", prompt_id=i) for i in range(count)]
        pid = self.registry_pid(registry)
        idle_started, idle_cpu_before = time.perf_counter(), _cpu_s(pid)
        time.sleep(self.config.idle_s)
        idle_rate = (_cpu_s(pid) - idle_cpu_before) / (time.perf_counter() - idle_started)
        cpu_before = _cpu_s(pid)
        started = time.perf_counter()
        if batched:
            async def run() -> list[Any]:
                client = BatchedRegistryClient(registry)
                tasks = []
                for first in range(0, count, self.config.batch):
                    tasks += [asyncio.create_task(client.submit("generate", p, sampling, cost=1))
                              for p in prompts[first:first + self.config.batch]]
                    await asyncio.sleep(0)  # the next batch leaves in its own lease_many call
                return await asyncio.gather(*tasks)

            results = asyncio.run(run())
        else:
            results = ray.get([registry.submit.remote("generate", p, sampling, cost=1) for p in prompts])
        elapsed = time.perf_counter() - started
        cpu = _cpu_s(pid) - cpu_before
        assert [r[0].prompt_id for r in results] == list(range(count)), "a request got another one's answer"
        return {"routed_per_s": count / elapsed, "registry_cpu_us": 1e6 * cpu / count,
                "routing_cpu_us": 1e6 * max(0.0, cpu - idle_rate * elapsed) / count}

    def batcher(self, registry: Any, batched: bool) -> dict[str, float]:
        """One batcher run; batcher_samples_per_s."""
        from async_grpo.batching.batcher_config import BatcherConfig, ExperienceConfig
        from async_grpo.config.sampling import SamplingConfig

        config = self.config
        experience = ExperienceConfig(
            max_tokens_per_gpu=64 * (len(_PROMPT_TOKENS) + _OUTPUT_TOKENS), prompt_deadline_s=600.0,
            sampling=SamplingConfig(n=config.rollouts, max_tokens=_OUTPUT_TOKENS),
            logprob_role="none", max_lag=config.steps + 1,  # stand-in rollouts carry version -1
        )
        batcher_config = BatcherConfig(world_size=config.ranks, experience=experience)
        host = self._host_class.remote(batcher_config, registry, batched)
        try:
            delivered, elapsed = self._ray.get(host.run.remote(config.steps, config.prompts_per_rank))
        finally:
            self._ray.kill(host)
        expected = config.steps * config.ranks * config.prompts_per_rank * config.rollouts
        assert delivered == expected, f"batcher delivered {delivered} samples, expected {expected}"
        return {"batcher_samples_per_s": delivered / elapsed}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"


def measure(bench: Bench, count: int) -> dict[str, dict[str, list[float]]]:
    """Every repeat of both paths for `count` workers: path -> metric -> values."""
    config = bench.config
    runs: dict[str, dict[str, list[float]]] = {"per_request": {}, "batched": {}}
    registry, workers = bench.start_pool(count)
    try:
        for batched in (False, True):  # first calls import modules in every process: not measured
            bench.route(registry, batched, _WARM_UP_REQUESTS)
        for repeat in range(config.repeats):
            for path in ("per_request", "batched"):
                figures = {**bench.route(registry, path == "batched"), **bench.batcher(registry, path == "batched")}
                for key, value in figures.items():
                    runs[path].setdefault(key, []).append(value)
                print(f"N={count} repeat={repeat} path={path} " + " ".join(f"{k}={v:.1f}" for k, v in figures.items())
                      + f" load={_load()}", flush=True)
    finally:
        bench.stop_pool(registry, workers)
    return runs


def _forget_address_file(address: str) -> None:
    """Cluster writes its head's address to Ray's address file, where every `ray.init()` without
    an address on this machine then joins it: other engineers' test runs joined this benchmark's
    cluster. Take it back (only if it is still ours)."""
    if _RAY_ADDRESS_FILE.exists() and _RAY_ADDRESS_FILE.read_text().strip() == address:
        _RAY_ADDRESS_FILE.unlink()


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(ScaleConfig, argv, description=__doc__).resolved()
    use_loopback_only_ray()
    import ray
    from ray.cluster_utils import Cluster

    from async_grpo.config.actor_names import RAY_NAMESPACE
    from async_grpo.launch.ray_env import actor_runtime_env

    node_args = {"num_cpus": 1, "include_dashboard": False,
                 "_system_config": {"enable_metrics_collection": False, "task_events_report_interval_ms": 0}}
    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    _forget_address_file(cluster.address)
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace=RAY_NAMESPACE, runtime_env=actor_runtime_env(),
                 log_to_driver=False)
        cluster.wait_for_nodes()
        bench = Bench(config)
        print(f"scale: {len(bench.nodes)} nodes, delay_s={config.delay_s}, {os.cpu_count()} cores, "
              f"load {_load()} at start", flush=True)
        final: list[str] = []
        for count in config.workers:
            runs = measure(bench, count)
            base, new = runs["per_request"], runs["batched"]
            ratio = statistics.median(new["routed_per_s"]) / statistics.median(base["routed_per_s"])
            capacity = 1e6 / statistics.median(new["routing_cpu_us"])
            print(f"N={count}: routed_per_s batched {_summary(new['routed_per_s'])} vs per_request "
                  f"{_summary(base['routed_per_s'])} (x{ratio:.1f}); registry_cpu_us batched "
                  f"{statistics.median(new['registry_cpu_us']):.0f} vs per_request "
                  f"{statistics.median(base['registry_cpu_us']):.0f}; routing_cpu_us batched "
                  f"{statistics.median(new['routing_cpu_us']):.0f} (one core: {capacity:,.0f} requests/s, target "
                  f"{_TARGET_ROUTED_PER_S:,}); batcher_samples_per_s batched {_summary(new['batcher_samples_per_s'])} "
                  f"vs per_request {_summary(base['batcher_samples_per_s'])}; load {_load()}", flush=True)
            final.append(f"N={count}:routed_per_s={statistics.median(new['routed_per_s']):.0f},"
                         f"routed_ratio={ratio:.2f},registry_cpu_us={statistics.median(new['registry_cpu_us']):.1f},"
                         f"routing_cpu_us={statistics.median(new['routing_cpu_us']):.1f},"
                         f"batcher_samples_per_s={statistics.median(new['batcher_samples_per_s']):.0f},"
                         f"baseline_batcher_samples_per_s={statistics.median(base['batcher_samples_per_s']):.0f}")
        print("scale: " + " ".join(final), flush=True)
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
