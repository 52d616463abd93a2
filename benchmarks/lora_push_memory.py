"""Do LoRA adapter pushes leak? Every process's memory after each of many pushes into one engine.

    .venv/bin/python -m benchmarks.lora_push_memory --pushes 200
    .venv/bin/python -m benchmarks.lora_push_memory --raise_mmap_threshold_mib 32   # as a long-lived process
    .venv/bin/python -m benchmarks.lora_push_memory --trace_python true            # + Python allocation sites
    MALLOC_MMAP_THRESHOLD_=262144 MALLOC_TRIM_THRESHOLD_=262144 .venv/bin/python -m benchmarks.lora_push_memory

(Another `ray start` head on the machine: prefix RAY_ADDRESS=local, or ray.init joins that one.)

The scenario of tests/inference/test_lora_vllm.py's memory loop, longer: a private Ray head as the
tests' fixture starts it, one GenerationWorker in this process (its vLLM engine-core process a
child), two rank-64 PEFT adapters pushed alternately in the 'sharded' mode (two Ray objects per
push), a 2-token greedy request after each. After every push this prints, for each process of this
process tree, RssAnon / RssShmem / RssFile (/proc/<pid>/status), plus the engine's adapter count and
our adapter folders left in shared memory. At the end: per process and for the tree's VmRSS sum
(what the test measured until issue 21), the least-squares slope over pushes [--fit_from, --pushes]
in KiB/push, against a leak of one adapter per push (its safetensors size).

A leak grows linearly without bound; allocator and object-store noise level off. Pass the glibc
variables in the shell (as above) to see their effect: they must be set before this process
starts, since the engine core inherits them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from async_grpo.config.worker_options import EngineConfig
from async_grpo.inference.weight_files import weights_file_dir
from async_grpo.launch.ray_cluster import init_local_ray
from async_grpo.demo_assets.tiny_model import write_random_adapter as write_adapter
from async_grpo.demo_assets.tiny_model import write_tiny_model
from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rollouts.sampling import SamplingConfig
from async_grpo.weights.weight_sync import StableMarker, WeightUpdate, tensor_to_blob, update_parts, write_stable_marker
from benchmarks.harness import apply_smoke, load_bench_config
from sample_processing_utils import Sample
from vllm_worker import GenerationWorker, GenerationWorkerConfig

WORKER_NAME = "lora-memory-probe"
FIELDS = ("VmRSS", "RssAnon", "RssShmem", "RssFile")


SMOKE = {"pushes": 4, "fit_from": 2, "rank": 8}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class LoraPushMemoryConfig:
    """Command line of `python -m benchmarks.lora_push_memory`."""

    pushes: int = 200
    """Adapter pushes into the one engine."""
    fit_from: int = 50
    """First push of the least-squares fit (the earlier ones warm caches and allocators)."""
    rank: int = 64
    """LoRA rank of the two alternating adapters (the test's BIG_RANK)."""
    out: str = ""
    """Optional JSON file for every push's readings."""
    trace_python: bool = False
    """Also trace this process's Python allocations (tracemalloc) and print the lines whose
    allocations grew most from push fit_from to the last one (slows each push down)."""
    raise_mmap_threshold_mib: int = 0
    """>0: before anything else, malloc and free one block of this size in this process, which
    raises glibc's dynamic mmap threshold (and trim threshold, twice it) to that size, as any
    earlier free of a large array does in a long-lived process (e.g. pytest after other tests)."""

    smoke: bool = False
    """Smoke mode: 4 pushes of a rank-8 adapter (SMOKE); checks that the command still runs, its figures mean
    nothing."""

    def __post_init__(self) -> None:
        if self.pushes < 3:
            raise ValueError(f"LoraPushMemoryConfig.pushes must be >= 3, got {self.pushes}")
        if not 0 < self.fit_from < self.pushes - 1:
            raise ValueError(f"LoraPushMemoryConfig.fit_from must be in (0, pushes - 1), got {self.fit_from}")


class _AlwaysRight:
    """The verifier the worker's canary needs; rewards do not matter here."""

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        return [RewardResult(reward=1.0, failed=False, error="") for _ in completions]


def sharded_update(adapter: Path, version: int, marker: Path) -> WeightUpdate:
    """Two 'ranks' of FSDP2-style pieces (A cut on dim 1, B on dim 0), one Ray object each."""
    import ray
    from safetensors.torch import load_file

    shards: list[dict] = [{}, {}]
    for name, tensor in load_file(str(adapter / "adapter_model.safetensors")).items():
        dim = 1 if ".lora_A." in name else 0
        offset = 0
        for rank, piece in enumerate(torch.chunk(tensor, 2, dim=dim)):
            shards[rank][name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)
            offset += piece.shape[dim]
    update = WeightUpdate(version=version, shard_refs=[ray.put(s) for s in shards], mode="sharded",
                          adapter_config=(adapter / "adapter_config.json").read_text(), marker_path=str(marker))
    write_stable_marker(marker, StableMarker(version=version, mode="sharded", shards=update_parts(update)))
    return update


def label(process: psutil.Process) -> str:
    """A short role name: the driver, Ray's daemons, the engine core, Ray workers."""
    if process.pid == os.getpid():
        return "driver"
    try:
        name, cmd = process.name(), " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    for key in ("raylet", "gcs_server", "EngineCore", "log_monitor", "dashboard", "runtime_env"):
        if key in name or key in cmd:
            return key
    return name[:24]


def status_kb(pid: int) -> dict[str, int] | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        key = line.split(":", 1)[0]
        if key in FIELDS:
            found[key] = int(line.split()[1])
    return found


def snapshot() -> dict[str, dict]:
    """pid -> {label, VmRSS, RssAnon, RssShmem, RssFile (kB)} for this process and its descendants."""
    me = psutil.Process()
    out = {}
    for process in [me, *me.children(recursive=True)]:
        memory = status_kb(process.pid)
        if memory is not None:
            out[str(process.pid)] = {"label": label(process), **memory}
    return out


def slope(ys: list[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ..."""
    n = len(ys)
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sum((x - mean_x) ** 2 for x in range(n))


async def run(config: LoraPushMemoryConfig, root: Path) -> list[dict]:
    model_dir = write_tiny_model(root / "model")
    adapters = [write_adapter(model_dir, root / f"big{i}", config.rank, 10 + i) for i in range(2)]
    marker = root / "weights" / "STABLE"
    marker.parent.mkdir(parents=True)
    worker = GenerationWorker(WORKER_NAME, GenerationWorkerConfig(model_path=str(model_dir), engine=EngineConfig(
        max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=256, enforce_eager=True, dtype="float32",
        max_lora_rank=64)), verifier=_AlwaysRight())
    await worker.start()
    worker.mark_ready()
    engine = worker._require_engine()
    sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=2)
    readings = []
    traced = None
    try:
        for i in range(config.pushes):
            if config.trace_python and i + 1 == config.fit_from:
                tracemalloc.start(8)
                traced = tracemalloc.take_snapshot()
            await worker.update_weights(sharded_update(adapters[i % 2], 10 + i, marker))
            await worker.generate(Sample(input_token_ids=[5, 6, 7, 8], gt_answer="0", prompt_id=0), sampling)
            gc.collect()
            readings.append({"push": i + 1, "loras": len(await engine.list_loras()),
                             "adapter_dirs": len(list(weights_file_dir().glob(f"grpo-adapter-{WORKER_NAME}-*"))),
                             "processes": snapshot()})
            tree = sum(p["VmRSS"] for p in readings[-1]["processes"].values())
            print(f"push {i + 1:4d}  tree VmRSS {tree / 1024:8.1f} MiB  loras {readings[-1]['loras']}  "
                  f"dirs {readings[-1]['adapter_dirs']}", flush=True)
        if traced is not None:
            print_python_growth(traced, tracemalloc.take_snapshot(), config.pushes - config.fit_from + 1)
    finally:
        worker.shutdown()
    return readings


def print_python_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, pushes: int) -> None:
    """The allocation sites whose live Python memory grew most between the two snapshots."""
    stats = after.compare_to(before, "traceback")
    total = sum(stat.size_diff for stat in stats)
    print(f"python allocations (tracemalloc): {total / 1024:+.1f} KiB over {pushes} pushes "
          f"({total / 1024 / pushes:+.2f} KiB/push); largest growth:")
    for stat in sorted(stats, key=lambda s: -s.size_diff)[:12]:
        print(f"  {stat.size_diff / 1024:+8.1f} KiB {stat.count_diff:+6d} blocks  "
              + " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in list(stat.traceback)[::-1][:5]))


def summarize(readings: list[dict], config: LoraPushMemoryConfig, adapter_bytes: int) -> None:
    fit = readings[config.fit_from - 1:]
    pids = [pid for pid in fit[-1]["processes"] if all(pid in r["processes"] for r in fit)]
    leak_kib = adapter_bytes / 1024
    print(f"\nslopes over pushes {config.fit_from}-{config.pushes} (KiB/push); one adapter per push "
          f"would be {leak_kib:.0f} KiB/push")
    print(f"{'process':<22}{'pid':>8}" + "".join(f"{f:>12}" for f in FIELDS) + f"{'VmRSS@fit0':>12}{'VmRSS@end':>12}")
    for pid in sorted(pids, key=lambda p: -fit[-1]["processes"][p]["VmRSS"]):
        first, last = fit[0]["processes"][pid], fit[-1]["processes"][pid]
        cells = "".join(f"{slope([r['processes'][pid][f] for r in fit]):12.1f}" for f in FIELDS)
        print(f"{first['label']:<22}{pid:>8}{cells}{first['VmRSS'] / 1024:12.1f}{last['VmRSS'] / 1024:12.1f}")
    tree = [sum(p["VmRSS"] for p in r["processes"].values()) for r in readings]
    late = tree[config.fit_from - 1:]
    print(f"tree VmRSS (the old test's measure): slope {slope(late):.1f} KiB/push over pushes {config.fit_from}-"
          f"{config.pushes}; push 10 -> 50 growth {(tree[49] - tree[9]) / 1024 if len(tree) >= 50 else float('nan'):.1f}"
          f" MiB; min/max after push {config.fit_from}: {min(late) / 1024:.1f}/{max(late) / 1024:.1f} MiB")
    print(f"lora_push_memory: pushes={config.pushes} fit_from={config.fit_from} tree_slope_kib={slope(late):.1f} "
          f"adapter_kib={leak_kib:.0f} ratio={slope(late) / leak_kib:.3f} "
          f"glibc_env={'set' if os.environ.get('MALLOC_MMAP_THRESHOLD_') else 'unset'} "
          f"raise_mmap_threshold_mib={config.raise_mmap_threshold_mib}")


def raise_mmap_threshold(size: int) -> None:
    """glibc raises its mmap threshold to the size of a freed mmapped block (up to 32 MiB on
    64-bit) unless MALLOC_MMAP_THRESHOLD_ fixes it: later blocks below it come from the heap."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(size))


def main(argv: list[str] | None = None) -> int:
    config = load_bench_config(LoraPushMemoryConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    if config.raise_mmap_threshold_mib:
        raise_mmap_threshold(config.raise_mmap_threshold_mib << 20)
    init_local_ray(num_cpus=4, namespace="lora-push-memory", log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="lora-push-memory-") as tmp:
        readings = asyncio.run(run(config, Path(tmp)))
        adapter_bytes = (Path(tmp) / "big0" / "adapter_model.safetensors").stat().st_size
    if config.out:
        Path(config.out).write_text(json.dumps(readings))
    summarize(readings, config, adapter_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
