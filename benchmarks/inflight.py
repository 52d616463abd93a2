"""Weight pushes with in-flight requests kept (`keep`) vs drained first (`wait`): steps/s and staleness.

    cd /work/main && .venv/bin/python -m benchmarks.inflight          # 3 rounds x 2 modes, ~5-8 min on 2 cores
    .venv/bin/python -m benchmarks.inflight --rounds 5 --num_steps 10
    .venv/bin/python -m benchmarks.inflight --smoke true

One generation worker (vllm_worker.GenerationWorker, the real vLLM engine, in this process; Ray
only for the object store that carries pushed weights; a real verifier pool scores) runs the same
job once per mode, with `GenerationWorkerConfig.weight_update_pause_mode` switched between runs
on the same engine. Runs alternate keep/wait (wait/keep in the next round: the A/B runner's order,
benchmarks/ab_parts.py, which also makes the table and the ratio) so slow drifts in the machine's
load fall on both modes.

The job is the trainer's loop at max_lag 1 without the trainer: step s's prompts are submitted
once version s - max_lag is served; step s waits for its groups, "trains" for `--train_s`
seconds (a sleep: the cores stay with generation), then pushes version s + 1 (alternating two
full state dicts of the model, so every push is a real reload). Step s + 1's requests are in
flight during that push. Under `wait` the push first waits for all of them, so the long tail of
response lengths (the bundled tiny Qwen2 with random weights, `--max_tokens` 256, often does not
stop) holds every step back; under `keep` they are frozen, the weights swapped, and they finish
on the new weights. An untimed 2-step job warms the engine up first.

Printed per run, then per mode as median [min-max] over its runs: steps/s over the whole job, the
mean per-token staleness (over every sampled token of every step: the step's version minus the
version that sampled the token) and the fraction of completions straddling a push. Per-token
versions come from Sample.token_versions once the generation worker fills them
(token_versions.TokenVersionTracker); until then samples carry only weight_version (the version
when the request started) and the summary says `staleness_source=weight_version`: under keep the
figure is then an upper bound.

The LAST line is `inflight: ` and key=value pairs: `speedup=` (median steps/s keep over wait),
`keep_steps_per_s=`, `wait_steps_per_s=`, `keep_token_staleness=`, `wait_token_staleness=` (over
every token of a mode's runs), `keep_straddled_frac=` (completions with tokens from two versions)
and `staleness_source=`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from async_grpo.config.worker_options import VerificationConfig
from async_grpo.config.sampling import SamplingConfig
from benchmarks.ab_parts import print_table, ratio, schedule, summarise
from benchmarks.harness import apply_smoke, load_bench_config, setup_logging, SMOKE_ENGINE, summary_line
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

PauseMode = Literal["keep", "wait"]
MODES: tuple[PauseMode, PauseMode] = ("keep", "wait")
MAX_LAG = 1  # the trainer's default: step s's prompts wait for version s - 1
PROMPT_TOKENS = 8  # random prompt ids; the random model's continuation does not depend on meaning
# Noise on the second pushed state dict: enough that the two versions differ, small enough that
# the random model keeps its long tail of lengths.
PUSH_NOISE = 0.01
KV_CACHE_BYTES = 256 << 20  # (max_lag + 1) steps x prompts x n sequences of up to max_model_len
NAMESPACE = "benchmark-inflight"
KEYS = ("steps_per_s", "token_staleness", "straddled_frac")  # a run's figures in the table
WARMUP_STEPS = 2  # an untimed job before the first round

SMOKE = {"rounds": 1, "num_steps": 2, "prompts_per_step": 2, "n": 2, "max_tokens": 16, "train_s": 0.0}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class InflightConfig:
    """Command line of `python -m benchmarks.inflight`."""

    rounds: int = 3
    """Pairs of runs (one per pause mode), alternating which mode goes first."""
    num_steps: int = 8
    """Steps per run (each ends with a weight push)."""
    prompts_per_step: int = 8
    """Prompts submitted per step."""
    n: int = 4
    """Completions per prompt."""
    max_tokens: int = 256
    """Completion length cap: the random model often runs into it, which makes the long tail."""
    train_s: float = 0.5
    """Seconds the simulated trainer spends per step before its push (generation runs meanwhile)."""
    work_dir: str = ""
    """Where the model goes ('' = a new temporary folder)."""
    seed: int = 0
    """Prompt and sampling seed (each run of a round samples the same prompts)."""
    smoke: bool = False
    """Run the SMOKE sizes with the engine uncompiled: checks that the command works; its figures
    mean nothing."""

    def __post_init__(self) -> None:
        for name in ("rounds", "num_steps", "prompts_per_step", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"InflightConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.train_s < 0:
            raise ValueError(f"InflightConfig.train_s must be >= 0, got {self.train_s}")


def write_models(work: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """The bundled tiny Qwen2 and the two state dicts the pushes alternate between."""
    from async_grpo.demo_assets.tiny_model import write_tiny_model
    from setup_model import load_causal_lm

    model_dir = write_tiny_model(work / "model")
    model = load_causal_lm(model_dir)
    first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    second = {k: v + PUSH_NOISE * torch.randn(v.shape, generator=generator) for k, v in first.items()}
    return model_dir, [first, second]


def prompts(step: int, cfg: InflightConfig, vocab_size: int, seed: int) -> list[Sample]:
    rng = random.Random(seed * 1_000_003 + step)
    return [Sample(input_token_ids=[rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS)], gt_answer="7",
                   prompt_id=step * cfg.prompts_per_step + i) for i in range(cfg.prompts_per_step)]


async def run_job(worker: Any, refs: list[Any], mode: PauseMode, cfg: InflightConfig, vocab_size: int,
                  seed: int) -> dict[str, Any]:
    """The trainer's loop at max_lag 1 without the trainer (module docstring); its figures (KEYS)
    and the counts they come from (count)."""
    from async_grpo.weights.update import WeightUpdate

    worker.config = dataclasses.replace(worker.config, weight_update_pause_mode=mode)
    worker.reloader.pause_mode = mode  # what an object-store push pauses with (ObjectStoreReloader)
    sampling = SamplingConfig(n=cfg.n, temperature=1.0, max_tokens=cfg.max_tokens, seed=seed)
    base = worker.weight_version
    tasks: dict[int, list[asyncio.Task]] = {}
    counts = {"token_lag_sum": 0, "tokens": 0, "completions": 0, "straddled": 0, "token_versions": False}
    started = time.monotonic()
    submitted = -1
    for step in range(cfg.num_steps):
        # Version base + step is served: steps up to step + MAX_LAG may start generating.
        while submitted < min(step + MAX_LAG, cfg.num_steps - 1):
            submitted += 1
            tasks[submitted] = [asyncio.create_task(worker.generate(p, sampling))
                                for p in prompts(submitted, cfg, vocab_size, seed)]
        groups = await asyncio.gather(*tasks.pop(step))
        count(counts, [s for group in groups for s in group], base + step)
        await asyncio.sleep(cfg.train_s)
        version = base + step + 1
        await worker.update_weights(WeightUpdate(version=version, shard_refs=[refs[version % len(refs)]]))
    return {"steps_per_s": cfg.num_steps / (time.monotonic() - started),
            "token_staleness": counts["token_lag_sum"] / max(counts["tokens"], 1),
            "straddled_frac": counts["straddled"] / max(counts["completions"], 1), **counts}


def count(counts: dict[str, Any], samples: list[Sample], current_version: int) -> None:
    """Adds the samples' token staleness (summed lag and sampled tokens), completions, those
    straddling a push (tokens from more than one version), and whether any carried token_versions."""
    for sample in samples:
        lag_sum, tokens = sample.token_staleness(current_version)
        counts["token_lag_sum"] += lag_sum
        counts["tokens"] += tokens
        counts["completions"] += 1
        counts["straddled"] += len(sample.token_versions or ()) > 1
        counts["token_versions"] |= sample.token_versions is not None


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


async def run_all(cfg: InflightConfig, work: Path) -> dict[str, list[dict[str, Any]]]:
    """Each mode's runs (run_job's figures), in the runner's order after an untimed warm-up job."""
    import ray

    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.rewards.math_verify_pool import VerifierPool
    from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
    from vllm_worker import GenerationWorker, GenerationWorkerConfig

    model_dir, state_dicts = write_models(work)
    vocab_size = int(state_dicts[0]["model.embed_tokens.weight"].shape[0])
    refs = [ray.put(state_dict_to_blobs(sd)) for sd in state_dicts]
    engine = EngineConfig(max_num_seqs=(MAX_LAG + 1) * cfg.prompts_per_step * cfg.n, kv_cache_memory_bytes=KV_CACHE_BYTES,
                          max_model_len=PROMPT_TOKENS + cfg.max_tokens, dtype="float32",
                          **(SMOKE_ENGINE if cfg.smoke else {}))
    config = GenerationWorkerConfig(model_path=str(model_dir), engine=engine, verification=VerificationConfig(global_num_verifiers=1))
    pool = VerifierPool(num_processes=1)
    worker = GenerationWorker("inflight-generation", config, verifier=pool)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        await worker.start()
        worker.mark_ready()
        await worker.update_weights(WeightUpdate(version=0, shard_refs=[refs[0]], initial=True))
        # Untimed: the engine's first requests allocate and warm up what later ones reuse.
        await run_job(worker, refs, "keep", dataclasses.replace(cfg, num_steps=WARMUP_STEPS), vocab_size, cfg.seed)
        for round_index, mode in schedule(MODES, cfg.rounds, swap=True):
            result = await run_job(worker, refs, mode, cfg, vocab_size, cfg.seed + round_index)
            runs[mode].append(result)
            print(f"round {round_index} {mode:<4}  {result['steps_per_s']:6.3f} steps/s  token staleness "
                  f"{result['token_staleness']:5.3f} over {result['tokens']} tokens  straddled "
                  f"{result['straddled']}/{result['completions']}  (load average {_load()})", flush=True)
    finally:
        worker.shutdown()
        pool.close()
    return runs


def figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """The summary line's: medians of steps/s and their ratio; staleness and straddling over every
    token and completion of a mode's runs."""
    summaries = {mode: summarise(records, KEYS) for mode, records in runs.items()}
    print_table(summaries, KEYS, label="mode")

    def pooled(mode: str, part: str, whole: str) -> float:
        return sum(r[part] for r in runs[mode]) / max(sum(r[whole] for r in runs[mode]), 1)

    carried = any(r["token_versions"] for records in runs.values() for r in records)
    return {
        "speedup": f"{ratio(summaries, 'steps_per_s', 'keep', 'wait'):.3f}",
        "keep_steps_per_s": f"{summaries['keep']['steps_per_s'].median:.3f}",
        "wait_steps_per_s": f"{summaries['wait']['steps_per_s'].median:.3f}",
        "keep_token_staleness": f"{pooled('keep', 'token_lag_sum', 'tokens'):.3f}",
        "wait_token_staleness": f"{pooled('wait', 'token_lag_sum', 'tokens'):.3f}",
        "keep_straddled_frac": f"{pooled('keep', 'straddled', 'completions'):.3f}",
        "staleness_source": "token_versions" if carried else "weight_version",
    }


def main(argv: list[str] | None = None) -> None:
    cfg = apply_smoke(load_bench_config(InflightConfig, argv, description=__doc__), SMOKE)
    setup_logging()
    from async_grpo.launch.ray_cluster import init_local_ray

    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="inflight-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = _load()
    init_local_ray(num_cpus=2, namespace=NAMESPACE, log_to_driver=True)
    try:
        runs = asyncio.run(run_all(cfg, work))
    finally:
        import ray

        ray.shutdown()
    summary = figures(runs)
    if summary["staleness_source"] == "weight_version":
        print("samples carried no token_versions (the generation worker's hook is not in): staleness counts every "
              "token at its request's start version, an upper bound under keep")
    print(f"load average at start {load_before}, at end {_load()} on {os.cpu_count()} cores (shared machine)")
    print(summary_line("inflight", summary))


if __name__ == "__main__":
    main()
