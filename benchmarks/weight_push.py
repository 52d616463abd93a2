"""Weight push time and effective bandwidth of both push modes, against raw memory-copy bandwidth.

    cd /work/main && .venv/bin/python -m benchmarks.weight_push                 # ~134M params fp32, 1 receiver
    .venv/bin/python -m benchmarks.weight_push --num_layers 20 --receivers 2 --repeats 7

One run: a random-init Qwen2 big enough to be bandwidth-bound (default hidden 1024, 12 layers,
MLP 2816: ~134M parameters, ~0.54 GB fp32) is written with tiny_model.write_tiny_model; a private
Ray head (LocalCluster) hosts `--receivers` real LogprobWorkerActors registered in the logprob
registry (each update fetches the shards, assembles full tensors and loads them into its HF
model) and an empty generation registry; `torchrun --nproc_per_node=2` runs this file as the
trainer (FSDP2 on gloo) and pushes with trainer_core.WeightPusher (logprob_role: old_policy, so
it broadcasts to the logprob registry) in both modes, alternating, after one warm-up each:

- gather:  rank 0 all-gathers the full state dict and ray.put's it as one object;
- sharded: every rank ray.put's its own FSDP dim-0 shards; receivers fetch both and concatenate.

push_s is the median of `WeightPusher.push` on rank 0 (publish, broadcast, receivers' load,
final barrier). GB/s = model bytes / push_s: the rate at which a weight version reaches every
receiver. The reference is a plain copy of the same number of bytes into a fresh buffer
(`torch.empty_like(x).copy_(x)`, best of several) measured in this run on this machine;
`fraction_of_memcpy` is the better mode's GB/s over it. A push makes several such copies
(gather: all-gather + CPU copy + object-store put; both: receiver assembly + load), so a
fraction well below 1 is expected.

Breakdown (separate pushes with the same library calls, timed one by one): trainer side
gather_full_state_dict / local_shard_blobs, then ray.put; receiver side (a probe actor holding
the same HF model, doing what LogprobWorker.update_weights does) fetching the objects, assembling
full tensors (worker_loader.assemble_state_dict) and loading them (worker_loader.load_state_dict_into).

LoRA (`--lora_r R`): the policy is wrapped with a rank-R adapter on every linear layer (alpha
2R) and the pushes carry only the adapter, in the three LoRA modes: gather, sharded (LoRA A
cut along dim 1), lora_files (rank 0 writes <work>/run/weights/step_N, receivers read it); every
push also writes the STABLE marker and the receivers (logprob workers, old_policy) check it and
apply the adapter to their base model with PEFT. GB and GB/s then count adapter bytes; the
breakdown is skipped.

    .venv/bin/python -m benchmarks.weight_push --lora_r 16

The LAST line is key=value pairs:
`fraction_of_memcpy=<x> best_mode=<m> gather_s=... sharded_s=... gather_gbps=... sharded_gbps=... memcpy_gbps=... model_gb=...`

Engine transport (`--target engine`): pushes into one vLLM engine, in this process (no torchrun,
no cluster). The update (the model's own tensors, perturbed, as one 'gather' object in a private
Ray store) is pushed by GenerationWorker.update_weights, vLLM's weight-transfer API with our
object-store backend (per bucket an anonymous memory file the engine maps; one layerwise reload
per push). push_s is the median over `--repeats` pushes (after one warm-up), paused generation,
buckets and version label included; fraction_of_memcpy as above.

    .venv/bin/python -m benchmarks.weight_push --target engine --repeats 7

Its LAST line: `fraction_of_memcpy=... new_s=... memcpy_gbps=... model_gb=...`, after a
`path=new fraction_of_memcpy=...` line. (The old file-per-bucket path it was compared with until
issue 58, benchmarks/legacy_weight_reload.py, last ran at commit 54714e4; RESULTS.md keeps its
figures.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from async_grpo.launch.local_processes import free_port
from async_grpo.config.actor_names import GENERATION, LOGPROB, RAY_NAMESPACE, worker_actor_name
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from benchmarks.harness import apply_smoke, load_bench_config, REPO_ROOT
from local_cluster import LocalCluster, LocalClusterConfig
from vllm_registry import get_or_create_registry

logger = logging.getLogger(__name__)

WORLD_SIZE = 2  # FSDP ranks under torchrun, as in the demo
MODES = ("gather", "sharded")
LORA_MODES = ("gather", "sharded", "lora_files")
GB = 1e9  # decimal gigabytes, for bytes and bytes per second alike
PROBE_ACTOR_NAME = "weight-push-receiver-probe"  # the breakdown's receiver, next to the real ones
MEMCPY_REPEATS = 5  # best of: the first copies also pay page faults of the allocator's fresh pages
ENGINE_PATHS = ("new",)  # the old file-per-bucket path was retired (module docstring)
ENGINE_WORKER_NAME = "weight-push-bench-engine"
# The engine only needs room for the canary: the model's bytes are what is measured.
ENGINE_KV_CACHE_BYTES = 64 << 20
ENGINE_MAX_MODEL_LEN = 256
PERTURBATION = 1e-3  # relative noise per push, so every push really changes the weights
# WeightPusher reads no data, but TrainerConfig requires a dataset section; nothing opens this path.
UNUSED_DATA_PATH = "unused-by-weight-push.jsonl"
TRAINER_TIMEOUT_S = 1200.0
RECEIVER_START_TIMEOUT_S = 600.0
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}  # safetensors dtype names -> bytes per element


SMOKE = {"hidden_size": 64, "num_layers": 1, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "repeats": 1,
         "breakdown_repeats": 1}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class PushBenchConfig:
    """The model and how many pushes the trainer role makes: the command line of
    `python -m benchmarks.weight_push` (torchrun runs the same file with `--role trainer`)."""

    hidden_size: int = 1024
    """Model width (the tiny tokenizer's ~100-token vocabulary makes embeddings negligible)."""
    num_layers: int = 12
    """Decoder layers: the knob that sets the model's size."""
    intermediate_size: int = 2816
    """MLP width."""
    num_heads: int = 16
    """Attention heads."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention)."""
    receivers: int = 1
    """LogprobWorkerActors receiving every push."""
    repeats: int = 5
    """Timed WeightPusher.push calls per mode (after one warm-up each)."""
    breakdown_repeats: int = 3
    """Step-by-step timed pushes per mode (0: skip the breakdown)."""
    target: Literal["logprob", "engine"] = "logprob"
    """'logprob': pushes from a torchrun trainer to logprob workers (both push modes); 'engine':
    pushes into one vLLM engine (see the module docstring)."""
    role: Literal["driver", "trainer"] = "driver"
    """'driver' runs the benchmark; 'trainer' is what it starts under torchrun."""
    work_dir: str | None = None
    """Driver: where the model, logs and results go; None: a temporary folder, removed at the end."""
    model_dir: str | None = None
    """Trainer role: the model to shard."""
    out: str | None = None
    """Trainer role: where rank 0 writes its results."""
    lora_r: int = 0
    """Rank of a LoRA adapter on every linear layer; > 0 pushes only the adapter (modes gather,
    sharded, lora_files). 0: full weights (gather, sharded)."""

    smoke: bool = False
    """Smoke mode: a 1-layer, 64-wide model, 1 repeat (SMOKE); checks that the command still runs, its figures
    mean nothing."""

    def __post_init__(self) -> None:
        if self.role == "trainer" and not (self.model_dir and self.out):
            raise ValueError("PushBenchConfig: --role trainer needs --model_dir and --out")
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads", "receivers", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"PushBenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.breakdown_repeats < 0:
            raise ValueError(f"PushBenchConfig.breakdown_repeats must be >= 0, got {self.breakdown_repeats}")
        if self.lora_r < 0:
            raise ValueError(f"PushBenchConfig.lora_r must be >= 0, got {self.lora_r}")

    @property
    def modes(self) -> tuple[str, ...]:
        """The push modes measured: full weights' two, or LoRA's three."""
        return LORA_MODES if self.lora_r else MODES

    def model(self) -> TinyModelConfig:
        return TinyModelConfig(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size)


@dataclass(slots=True)
class ModeResult:
    """What the trainer role measured for one push mode (seconds)."""

    push_s: list[float] = field(default_factory=list)
    """WeightPusher.push on rank 0, one per timed push."""
    collect_s: list[float] = field(default_factory=list)
    """gather_full_state_dict (gather) or local_shard_blobs (sharded), slowest rank."""
    put_s: list[float] = field(default_factory=list)
    """ray.put of the blobs, slowest rank."""
    fetch_s: list[float] = field(default_factory=list)
    """Receiver probe: awaiting every shard object."""
    assemble_s: list[float] = field(default_factory=list)
    """Receiver probe: worker_loader.assemble_state_dict."""
    load_s: list[float] = field(default_factory=list)
    """Receiver probe: worker_loader.load_state_dict_into the HF model."""


# ---------------------------------------------------------------------------------------------
# Driver side: model, memcpy reference, cluster with receivers, torchrun, report.
# ---------------------------------------------------------------------------------------------


def memcpy_gbps(num_bytes: int, threads: int) -> float:
    """Best-of-MEMCPY_REPEATS copy bandwidth of num_bytes into a freshly allocated buffer."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(num_bytes, dtype=torch.uint8)  # ones, not empty: every page really exists
        best = float("inf")
        for _ in range(MEMCPY_REPEATS):
            began = time.perf_counter()
            copy = torch.empty_like(source).copy_(source)
            best = min(best, time.perf_counter() - began)
            del copy
    finally:
        torch.set_num_threads(previous)
    return num_bytes / best / GB


def model_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint (what one push carries)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                total += math.prod(tensor.get_shape()) * _DTYPE_BYTES[tensor.get_dtype()]
    return total


class ReceiverProbe:
    """Breakdown receiver: LogprobWorker.update_weights' three steps, each timed.

    Holds the same HF model as the real receivers. Wrapped with ray.remote by the driver.
    """

    def __init__(self, model_path: str) -> None:
        from setup_model import load_causal_lm

        self.causal_lm = load_causal_lm(model_path)

    async def receive(self, update: Any) -> dict[str, float]:
        from async_grpo.weights.worker_loader import assemble_state_dict

        began = time.perf_counter()
        shards = await asyncio.gather(*update.shard_refs)
        fetched = time.perf_counter()
        state_dict = await asyncio.to_thread(assemble_state_dict, shards)
        assembled = time.perf_counter()
        await asyncio.to_thread(self._load, state_dict)
        loaded = time.perf_counter()
        return {"fetch_s": fetched - began, "assemble_s": assembled - fetched, "load_s": loaded - assembled}

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        from async_grpo.weights.worker_loader import load_state_dict_into

        with torch.no_grad():
            load_state_dict_into(self.causal_lm, state_dict)


def start_receivers(model_dir: Path, count: int, with_probe: bool) -> list[Any]:
    """Real LogprobWorkerActors in the logprob registry, an empty generation registry, the probe."""
    import ray

    from logprob_worker import LogprobWorkerActor, LogprobWorkerConfig

    get_or_create_registry(GENERATION)  # WeightPusher always broadcasts here too; no worker: a no-op
    registry = get_or_create_registry(LOGPROB)
    actors = []
    for _ in range(count):
        name = worker_actor_name(LOGPROB, ray.get(registry.allocate_index.remote()))
        actor = LogprobWorkerActor.options(name=name, namespace=RAY_NAMESPACE).remote(
            name, LogprobWorkerConfig(model_path=str(model_dir)))
        ray.get(actor.start.remote(), timeout=RECEIVER_START_TIMEOUT_S)
        ray.get(registry.register.remote(name))
        actors.append(actor)
        logger.info("receiver %s registered", name)
    if with_probe:
        probe = ray.remote(ReceiverProbe).options(name=PROBE_ACTOR_NAME, namespace=RAY_NAMESPACE).remote(str(model_dir))
        ray.get(probe.__ray_ready__.remote(), timeout=RECEIVER_START_TIMEOUT_S)
        actors.append(probe)
    return actors


def run_trainer_role(cluster: LocalCluster, model_dir: Path, cfg: PushBenchConfig, out: Path,
                     log: Path) -> tuple[dict[str, ModeResult], int]:
    """torchrun this module in --role trainer; returns what rank 0 wrote (per mode, bytes per push)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD_SIZE}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "benchmarks.weight_push",
        "--role", "trainer", "--model_dir", str(model_dir), "--out", str(out),
        "--repeats", str(cfg.repeats), "--breakdown_repeats", str(cfg.breakdown_repeats),
        "--lora_r", str(cfg.lora_r),
    ]
    with log.open("w") as handle:
        code = subprocess.run(command, env=cluster.env(), cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=TRAINER_TIMEOUT_S).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"trainer role exited {code}; last lines of {log}:\n{tail}")
    written = json.loads(out.read_text())
    return {mode: ModeResult(**values) for mode, values in written["modes"].items()}, int(written["push_bytes"])


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: dict[str, ModeResult], num_bytes: int, memcpy_by_threads: dict[int, float], receivers: int,
           lora_r: int = 0, model_num_bytes: int = 0) -> None:
    """Per-mode lines, then the key=value line."""
    model_gb = num_bytes / GB
    copy_gbps = max(memcpy_by_threads.values())
    copies = ", ".join(f"{t} thread(s) {g:.2f} GB/s" for t, g in memcpy_by_threads.items())
    what = (f"LoRA r={lora_r} adapter {num_bytes / 1e6:.2f} MB fp32 ({num_bytes // 4 / 1e6:.2f}M params; full model "
            f"{model_num_bytes / GB:.3f} GB)" if lora_r else f"model {model_gb:.3f} GB fp32 ({num_bytes // 4 / 1e6:.0f}M params)")
    print(f"{what}, {receivers} receiver(s), "
          f"{WORLD_SIZE} FSDP ranks (gloo); load average {_load_average()} on {os.cpu_count()} cores")
    print(f"memcpy into a fresh buffer, best of {MEMCPY_REPEATS}: {copies}; reference {copy_gbps:.2f} GB/s")
    gbps = {}
    for mode, r in results.items():
        push = _median(r.push_s)
        gbps[mode] = model_gb / push
        print(f"{mode:<8} push {push:6.3f} s (median of {len(r.push_s)}, min {min(r.push_s):.3f})  "
              f"{model_gb:.3f} GB -> {gbps[mode]:.3f} GB/s = {gbps[mode] / copy_gbps:.3f} x memcpy")
        if r.load_s:
            collect = "gather_full_state_dict" if mode == "gather" else "local_shard_blobs"
            print(f"{'':<8} breakdown (median of {len(r.load_s)}): trainer {collect} {_median(r.collect_s):.3f} s, "
                  f"ray.put {_median(r.put_s):.3f} s | receiver fetch {_median(r.fetch_s):.3f} s, "
                  f"assemble {_median(r.assemble_s):.3f} s, load {_median(r.load_s):.3f} s")
    best = max(gbps, key=gbps.get)
    fields = {
        "fraction_of_memcpy": f"{gbps[best] / copy_gbps:.3f}", "best_mode": best,
        **{f"{m}_s": f"{_median(results[m].push_s):.3f}" for m in results},
        **{f"{m}_gbps": f"{gbps[m]:.3f}" for m in results},
        "memcpy_gbps": f"{copy_gbps:.3f}", "model_gb": f"{model_gb:.3f}", "receivers": str(receivers),
        "lora_r": str(lora_r),
    }
    print(" ".join(f"{k}={v}" for k, v in fields.items()))


def drive(cfg: PushBenchConfig, work: Path) -> None:
    model_dir = write_tiny_model(work / "model", cfg.model())
    num_bytes = model_bytes(model_dir)
    logger.info("model: %.3f GB in %s", num_bytes / GB, model_dir)
    # Push copies run one thread per process (torchrun and Ray set OMP_NUM_THREADS=1); the
    # reference is the better of one thread and all of torch's threads, so it is not flattered.
    by_threads = {threads: memcpy_gbps(num_bytes, threads) for threads in sorted({1, torch.get_num_threads()})}
    logger.info("memcpy GB/s by threads: %s", by_threads)
    cluster_config = LocalClusterConfig(model_path=str(model_dir), log_dir=str(work / "logs"), logprob_workers=cfg.receivers)
    if cfg.lora_r and cfg.breakdown_repeats:
        logger.info("LoRA: the step-by-step breakdown covers full-weight pushes only; skipped")
        cfg = dataclasses.replace(cfg, breakdown_repeats=0)
    with LocalCluster(cluster_config) as cluster:
        # Keep the handles: an actor whose last handle goes out of scope is stopped, named or not.
        receivers = start_receivers(model_dir, cfg.receivers, with_probe=cfg.breakdown_repeats > 0)
        results, push_bytes = run_trainer_role(cluster, model_dir, cfg, work / "trainer_results.json",
                                               work / "trainer.log")
        del receivers
    if cfg.lora_r:  # the memcpy reference for the bytes a push carries
        by_threads = {threads: memcpy_gbps(push_bytes, threads) for threads in sorted({1, torch.get_num_threads()})}
    report(results, push_bytes, by_threads, cfg.receivers, lora_r=cfg.lora_r, model_num_bytes=num_bytes)


# ---------------------------------------------------------------------------------------------
# Engine target: pushes into one vLLM engine, in this process.
# ---------------------------------------------------------------------------------------------


class _CanaryVerifier:
    """The worker's start-up canary verifies '2' against '2'; nothing else is scored here."""

    async def score(self, completions: list[str], gt_answer: str) -> list[Any]:
        from async_grpo.rewards.math_verifier import RewardResult

        return [RewardResult(reward=float(c == gt_answer), failed=False, error="") for c in completions]


def _perturbed_update(base: dict[str, torch.Tensor], version: int) -> Any:
    """The model's own tensors with noise of their own, as one 'gather' object in the store."""
    import ray

    from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs

    noise = torch.Generator().manual_seed(version)
    state = {k: v + PERTURBATION * torch.randn(v.shape, generator=noise, dtype=v.dtype) for k, v in base.items()}
    return WeightUpdate(version=version, shard_refs=[ray.put(state_dict_to_blobs(state))])


async def _engine_pushes(model_dir: Path, repeats: int) -> dict[str, list[float]]:
    """One engine, pushed `repeats` times (after a warm-up) through the generation worker's update path."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.inference.engine_start import engine_args
    from vllm_worker import GenerationWorker, GenerationWorkerConfig

    config = GenerationWorkerConfig(model_path=str(model_dir), engine=EngineConfig(
        max_num_seqs=8, kv_cache_memory_bytes=ENGINE_KV_CACHE_BYTES, max_model_len=ENGINE_MAX_MODEL_LEN,
        enforce_eager=True, dtype="float32"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process executor, as GenerationWorker.start sets it
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(config, in_process=True)))
    await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
    # The worker's own update path over this engine (no start(): its canary and registry are not timed).
    worker = GenerationWorker(ENGINE_WORKER_NAME, config, verifier=_CanaryVerifier())
    worker._engine = engine
    from safetensors.torch import load_file

    base = load_file(str(next(model_dir.glob("*.safetensors"))))
    timings: dict[str, list[float]] = {path: [] for path in ENGINE_PATHS}
    version = 0
    try:
        for round_index in range(repeats + 1):
            for path in ENGINE_PATHS:
                version += 1
                # Made before the clock starts, one at a time: the store holds one update.
                update = await asyncio.to_thread(_perturbed_update, base, version)
                began = time.perf_counter()
                await worker.update_weights(update)
                if round_index:  # the first round is the warm-up
                    timings[path].append(time.perf_counter() - began)
        if await engine.get_weight_version() != str(update.version):
            raise RuntimeError(f"engine serves {await engine.get_weight_version()}, expected v{update.version}")
    finally:
        engine.shutdown()
    return timings


def report_engine(timings: dict[str, list[float]], num_bytes: int, memcpy_by_threads: dict[int, float]) -> None:
    model_gb = num_bytes / GB
    copy_gbps = max(memcpy_by_threads.values())
    copies = ", ".join(f"{t} thread(s) {g:.2f} GB/s" for t, g in memcpy_by_threads.items())
    print(f"model {model_gb:.3f} GB fp32 ({num_bytes // 4 / 1e6:.0f}M params) into one vLLM engine (CPU, in-process); "
          f"load average {_load_average()} on {os.cpu_count()} cores")
    print(f"memcpy into a fresh buffer, best of {MEMCPY_REPEATS}: {copies}; reference {copy_gbps:.2f} GB/s")
    fraction = {}
    for path, values in timings.items():
        push = _median(values)
        fraction[path] = model_gb / push / copy_gbps
        print(f"path={path} fraction_of_memcpy={fraction[path]:.3f} push_s={push:.3f} min_s={min(values):.3f} "
              f"max_s={max(values):.3f} pushes={len(values)} gbps={model_gb / push:.3f}")
    fields = {
        "fraction_of_memcpy": f"{fraction['new']:.3f}",
        **{f"{p}_s": f"{_median(timings[p]):.3f}" for p in ENGINE_PATHS},
        "memcpy_gbps": f"{copy_gbps:.3f}", "model_gb": f"{model_gb:.3f}",
    }
    print(" ".join(f"{k}={v}" for k, v in fields.items()))


def drive_engine(cfg: PushBenchConfig, work: Path) -> None:
    import ray

    from async_grpo.launch.ray_cluster import init_local_ray

    model_dir = write_tiny_model(work / "model", cfg.model())
    num_bytes = model_bytes(model_dir)
    by_threads = {threads: memcpy_gbps(num_bytes, threads) for threads in sorted({1, torch.get_num_threads()})}
    init_local_ray(num_cpus=2, namespace=RAY_NAMESPACE, log_to_driver=False)
    try:
        timings = asyncio.run(_engine_pushes(model_dir, cfg.repeats))
    finally:
        ray.shutdown()
    report_engine(timings, num_bytes, by_threads)


# ---------------------------------------------------------------------------------------------
# Trainer role (under torchrun): FSDP2 model, WeightPusher in both modes, step-by-step pushes.
# ---------------------------------------------------------------------------------------------


class TrainerRole:
    """One FSDP rank: the model, a WeightPusher per mode, and the breakdown's manual pushes."""

    def __init__(self, model_dir: Path, with_probe: bool, lora_r: int, run_dir: Path) -> None:
        import ray

        from async_grpo.batching.batcher_config import ExperienceConfig
        from async_grpo.data.dataset import DatasetConfig
        from async_grpo.runtime.ray_access import join_cluster
        from async_grpo.trainer.config import TrainerConfig
        from async_grpo.trainer.fsdp_setup import build_training_model, init_distributed
        from async_grpo.weights.trainer_adapter import adapter_named_tensors
        from async_grpo.weights.trainer_object_store import get_or_create_shard_stager
        from setup_model import LoraConfig, ModelConfig
        from trainer_core import make_weight_pusher

        self.dist = init_distributed()
        join_cluster(os.environ["RAY_ADDRESS"], namespace=RAY_NAMESPACE, timeout_s=30.0, log_to_driver=False)
        lora = LoraConfig(r=lora_r, alpha=2.0 * lora_r) if lora_r else LoraConfig()
        model_config = ModelConfig(model_path=str(model_dir), lora=lora)
        self.model = build_training_model(model_config, self.dist)
        self.push_bytes = (sum(t.numel() * t.element_size() for t in adapter_named_tensors(self.model).values())
                           if lora_r else model_bytes(model_dir))
        self.pushers = {
            mode: make_weight_pusher(TrainerConfig(run_dir=str(run_dir), model=model_config,
                                                   data=DatasetConfig(path=UNUSED_DATA_PATH),
                                                   experience=ExperienceConfig(logprob_role="old_policy"),
                                                   weight_push_mode=mode), self.dist)
            for mode in (LORA_MODES if lora_r else MODES)
        }
        self.stager = get_or_create_shard_stager()
        with_probe = with_probe and self.dist.rank == 0
        self.probe = ray.get_actor(PROBE_ACTOR_NAME, namespace=RAY_NAMESPACE) if with_probe else None
        self.version = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version

    def timed_push(self, mode: str) -> float:
        return self.pushers[mode].push(self.model, self.next_version())

    def slowest(self, seconds: float) -> float:
        """Max over ranks (collective)."""
        import torch.distributed as torch_dist

        value = torch.tensor([seconds], dtype=torch.float64)
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX)
        return float(value.item())

    def breakdown_push(self, mode: str) -> dict[str, float]:
        """One push with each step timed; rank 0 returns the receiver probe's timings too."""
        import ray
        import torch.distributed as torch_dist

        from async_grpo.weights.trainer_gather import gather_full_state_dict, local_shard_blobs
        from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs

        version = self.next_version()
        began = time.perf_counter()
        if mode == "gather":
            state = gather_full_state_dict(self.model)
            collected = time.perf_counter()
            own_ref = ray.put(state_dict_to_blobs(state)) if self.dist.rank == 0 else None
        else:
            blobs = local_shard_blobs(self.model)
            collected = time.perf_counter()
            own_ref = ray.put(blobs)
        put = time.perf_counter()
        timings = {"collect_s": self.slowest(collected - began), "put_s": self.slowest(put - collected)}
        if mode == "gather":
            refs = [own_ref]
        else:
            ray.get(self.stager.stage.remote(version, self.dist.rank, [own_ref]))
            refs = ray.get(self.stager.collect.remote(version, self.dist.world_size, TRAINER_TIMEOUT_S)) if self.dist.rank == 0 else []
        if self.dist.rank == 0:
            timings.update(ray.get(self.probe.receive.remote(WeightUpdate(version=version, shard_refs=refs, mode=mode))))
        torch_dist.barrier()  # the probe fetched from every rank's objects: release them only now
        del own_ref
        return timings


def trainer_main(model_dir: Path, out: Path, repeats: int, breakdown_repeats: int, lora_r: int) -> None:
    modes = LORA_MODES if lora_r else MODES
    role = TrainerRole(model_dir, with_probe=breakdown_repeats > 0, lora_r=lora_r, run_dir=out.parent / "run")
    results = {mode: ModeResult() for mode in modes}
    for mode in modes:
        role.timed_push(mode)  # warm-up: first allocation of object-store and receiver buffers
    for _ in range(repeats):
        for mode in modes:  # alternating, so load from other processes hits every mode alike
            results[mode].push_s.append(role.timed_push(mode))
    for _ in range(breakdown_repeats):
        for mode in modes:
            timings = role.breakdown_push(mode)
            for key, value in timings.items():
                getattr(results[mode], key).append(value)
    if role.dist.rank == 0:
        out.write_text(json.dumps({"modes": {mode: asdict(r) for mode, r in results.items()},
                                   "push_bytes": role.push_bytes}))
        logger.info("trainer results written to %s", out)
    import torch.distributed as torch_dist

    torch_dist.barrier()
    torch_dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    cfg = load_bench_config(PushBenchConfig, argv, description=__doc__)
    cfg = apply_smoke(cfg, SMOKE)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.role == "trainer":
        trainer_main(Path(cfg.model_dir), Path(cfg.out), cfg.repeats, cfg.breakdown_repeats, cfg.lora_r)
        return
    with contextlib.ExitStack() as stack:
        # Without --work_dir the model, logs and results go to a temporary folder, removed at the end.
        work = Path(cfg.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="weight-push-")))
        work.mkdir(parents=True, exist_ok=True)
        drive_engine(cfg, work) if cfg.target == "engine" else drive(cfg, work)


if __name__ == "__main__":
    main()
