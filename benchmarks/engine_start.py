"""A generation worker's start with its engine core spawned (vLLM's way) vs forked (ours, on CPU).

    cd /work/main && .venv/bin/python -m benchmarks.engine_start             # 3 rounds x 2 ways, ~3 min on 2 cores
    .venv/bin/python -m benchmarks.engine_start --rounds 5 --steps 5
    .venv/bin/python -m benchmarks.engine_start --smoke true

One local Ray head (loopback) and the cluster's verifier pool, started before anything is timed;
then, per round, one GenerationWorkerActor per way (EngineConfig.fork_engine_core false, then
true; the next round the other way first, so drifts in the machine's load fall on both), each
the demo's tiny model in an eager float32 engine, as the dispatcher starts it:

- start: seconds from the actor's creation to the end of its `start()` (the actor's imports, the
  engine, the worker's self-check), and the CPU seconds of the actor and its engine-core process
  by then (/proc);
- steps: `--steps` demo-shaped generation steps after one warm-up (`--prompts` prompts x `--n`
  rollouts of up to `--max_tokens` tokens, scored by the pool), seconds and engine-core CPU
  seconds per step: a forked engine core must generate as fast as a spawned one;
- seeded rollouts: one seeded request (SEEDED: 8 rollouts of up to 16 tokens), whose tokens and
  sampling logprobs must be the same from every worker, forked or spawned.

Each worker's health note must name the way it started (engine_core=spawn / engine_core=fork);
the script stops with an error otherwise. The LAST line is `engine_start: ` and key=value pairs:
`start_speedup=` (median spawned start / median forked start), `start_cpu_ratio=` (the same
for CPU seconds), `spawn_start_s=`, `fork_start_s=`, `spawn_start_cpu_s=`, `fork_start_cpu_s=`,
`spawn_step_s=`, `fork_step_s=`, `spawn_step_cpu_s=`, `fork_step_cpu_s=` (medians),
`seeded_rollouts_equal=` (true when every worker's seeded rollouts are identical) and `rounds=`.
Every run's figures are printed above it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    apply_smoke, DEFAULT_DEMO_ASSETS, demo_assets, load_bench_config, setup_logging, summary_line,
)

WAYS = ("spawn", "fork")
NAMESPACE = "benchmark-engine-start"
KV_CACHE_BYTES = 128 << 20  # prompts x n sequences of a few dozen tokens
SEEDED = {"n": 8, "max_tokens": 16, "temperature": 1.0, "seed": 1234}
"""The seeded request every worker answers (SamplingConfig fields)."""
SMOKE = {"rounds": 1, "steps": 1, "prompts": 2, "n": 2}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class EngineStartConfig:
    """Command line of `python -m benchmarks.engine_start`."""

    rounds: int = 3
    """Rounds of one start per way, alternating which way goes first."""
    steps: int = 3
    """Timed generation steps per worker (after one warm-up step)."""
    prompts: int = 32
    """Prompts per step (the demo's 16 per rank x 2 ranks)."""
    n: int = 16
    """Rollouts per prompt."""
    max_tokens: int = 4
    """Completion length cap (the demo's)."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's assets (model and data), prepared there if missing (scripts/prepare_demo.py)."""
    smoke: bool = False
    """Smoke mode: one round, one step of 2 prompts x 2 rollouts (SMOKE); its figures mean nothing."""

    def __post_init__(self) -> None:
        for name in ("rounds", "steps", "prompts", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineStartConfig.{name} must be >= 1, got {getattr(self, name)}")


def _family_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + kernel) of root_pid ('actor') and of its descendants ('engine core'), from /proc."""
    import psutil

    root = psutil.Process(root_pid)

    def cpu(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    return {"actor": cpu(root), "engine_core": sum(cpu(child) for child in root.children(recursive=True))}


def _worker_config(model_dir: str, fork: bool, args: EngineStartConfig) -> Any:
    from async_grpo.config.worker_options import EngineConfig, VerificationConfig
    from vllm_worker import GenerationWorkerConfig

    engine = EngineConfig(max_num_seqs=args.prompts * args.n, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=128,
                          enforce_eager=True, dtype="float32", fork_engine_core=fork)
    return GenerationWorkerConfig(model_path=model_dir, engine=engine,
                                  verification=VerificationConfig(global_num_verifiers=1))


def _one_worker(way: str, model_dir: str, prompts: list[Any], args: EngineStartConfig) -> dict[str, Any]:
    """Start one worker the given way, time its steps, stop it; its figures."""
    import ray

    from async_grpo.rollouts.sampling import SamplingConfig
    from vllm_worker import GenerationWorkerActor

    name = f"engine-start-{way}-{time.monotonic_ns()}"
    began = time.perf_counter()
    worker = GenerationWorkerActor.options(name=name).remote(name, _worker_config(model_dir, way == "fork", args))
    ray.get(worker.start.remote())
    start_s = time.perf_counter() - began
    pid = ray.get(worker.__ray_call__.remote(lambda _actor: os.getpid()))
    start_cpu = _family_cpu_s(pid)
    note = ray.get(worker.health.remote()).detail
    if f"engine_core={way}" not in note:
        raise RuntimeError(f"the {way} worker's health note does not say engine_core={way}: {note!r}")
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
    step_s: list[float] = []
    step_cpu_s: list[float] = []
    try:
        for step in range(args.steps + 1):  # step 0 warms up
            cpu_before, step_began = _family_cpu_s(pid)["engine_core"], time.perf_counter()
            ray.get([worker.generate.remote(prompt, sampling) for prompt in prompts])
            if step:
                step_s.append(time.perf_counter() - step_began)
                step_cpu_s.append(_family_cpu_s(pid)["engine_core"] - cpu_before)
        seeded = ray.get(worker.generate.remote(prompts[0], SamplingConfig(**SEEDED)))
    finally:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)
    figures = {"start_s": start_s, "start_cpu_s": start_cpu["actor"] + start_cpu["engine_core"],
               "engine_core_start_cpu_s": start_cpu["engine_core"], "step_s": statistics.median(step_s),
               "step_cpu_s": statistics.median(step_cpu_s)}
    print(f"{way}: " + " ".join(f"{key}={value:.2f}" for key, value in figures.items()), flush=True)
    figures["seeded"] = [(s.output_token_ids, s.sampling_logprobs) for s in seeded]
    return figures


def run(args: EngineStartConfig) -> dict[str, Any]:
    import ray

    from async_grpo.launch.ray_cluster import init_local_ray
    from async_grpo.rewards.math_verify_cluster import connect_verifier_pool
    from sample_processing_utils import Sample
    from setup_model import load_tokenizer

    assets = demo_assets(args.assets_dir)
    model_dir = str(assets.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [Sample(input_token_ids=tokenizer.encode(f"{i % 10}+{(i * 7) % 10}="), gt_answer=str(i % 10 + i * 7 % 10),
                      prompt_id=i) for i in range(args.prompts)]
    init_local_ray(num_cpus=4, namespace=NAMESPACE, log_to_driver=False)
    try:
        connect_verifier_pool(1)  # the pool every worker's self-check and scoring uses, started untimed
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
        for round_index in range(args.rounds):
            for way in WAYS if round_index % 2 == 0 else WAYS[::-1]:
                runs[way].append(_one_worker(way, model_dir, prompts, args))
    finally:
        ray.shutdown()

    def median(way: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[way])

    figures: dict[str, Any] = {
        "start_speedup": round(median("spawn", "start_s") / median("fork", "start_s"), 2),
        "start_cpu_ratio": round(median("spawn", "start_cpu_s") / median("fork", "start_cpu_s"), 2),
    }
    for way in WAYS:
        for key in ("start_s", "start_cpu_s", "step_s", "step_cpu_s"):
            figures[f"{way}_{key}"] = round(median(way, key), 3)
    seeded = [run["seeded"] for way in WAYS for run in runs[way]]
    figures["seeded_rollouts_equal"] = str(all(other == seeded[0] for other in seeded)).lower()
    figures["rounds"] = args.rounds
    return figures


def main(argv: list[str] | None = None) -> None:
    args = apply_smoke(load_bench_config(EngineStartConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    print(summary_line("engine_start", run(args)), flush=True)


if __name__ == "__main__":
    main()
