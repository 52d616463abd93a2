"""The generation engines' settings that the local launcher picks per device: what an unset
dtype, KV cache and max_model_len become on a CPU host and on a CUDA host, each choice returned
as a line for the launcher's log.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from async_grpo.config.worker_options import EngineConfig
from async_grpo.launch.placement import Placement

# The engine on one CPU machine shared with the trainer:
# - dtype float32, as the CPU trainer computes: vLLM's 'auto' would serve an fp32 checkpoint in
#   bf16, which CPUs without bf16 instructions emulate slowly, whose sampling logprobs then
#   differ from the trainer's (~6e-3 per token on the demo), and which crashes vLLM 0.32's CPU
#   build on AMX CPUs. The logprob workers get it too.
# - a 256 MiB KV cache, set explicitly: the CPU build otherwise reserves a fraction of one NUMA
#   node's RAM minus what the process already uses, which fails on a busy machine.
# - max_model_len 512: the launcher's size for the tiny demo model since it was written (the
#   demo's prompt + completion budget is far below 512 tokens); no measurement behind it.
CPU_ENGINE: dict[str, Any] = dict(dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=512)
# On CUDA: bf16, the trainer's compute dtype under mixed precision (vLLM's own 'auto' picks bf16
# for an fp32 checkpoint on Ampere and newer, but a float16 checkpoint's own dtype); the KV cache
# and max_num_seqs sized to the run (launch/kv_cache_plan.py) within the plan's share of the GPU;
# max_model_len the run's longest sample.
CUDA_ENGINE_DTYPE = "bfloat16"
# The launcher's max_num_seqs: on CUDA it follows the KV cache sized to the run; a user's other
# value is kept.
LAUNCHER_MAX_NUM_SEQS = 256


def resolve_engine(engine: EngineConfig, placement: Placement, cuda: bool,
                   longest_sample: int | None) -> tuple[EngineConfig, list[str]]:
    """`engine` with its unset fields chosen for this device (CPU_ENGINE on CPU; on CUDA bf16, the
    plan's memory share, the run's longest sample as max_model_len), and the line that says so
    (none when nothing was unset)."""
    chosen: dict[str, tuple[Any, str]] = {}
    memory_unset = engine.kv_cache_memory_bytes is None and engine.gpu_memory_utilization is None
    if not cuda:
        if engine.dtype == "auto":
            chosen["dtype"] = (CPU_ENGINE["dtype"], "the CPU trainer's dtype")
        if memory_unset:
            chosen["kv_cache_memory_bytes"] = (CPU_ENGINE["kv_cache_memory_bytes"], "256 MiB")
        if engine.max_model_len is None:
            chosen["max_model_len"] = (CPU_ENGINE["max_model_len"], "the launcher's CPU size")
    else:
        if engine.dtype == "auto":
            chosen["dtype"] = (CUDA_ENGINE_DTYPE, "the trainer's compute dtype")
        chosen.update(_cuda_memory(engine, placement))
        if engine.max_model_len is None and longest_sample is not None:
            chosen["max_model_len"] = (longest_sample, "the run's longest sample")
    if not chosen:
        return engine, []
    device = "CUDA" if cuda else "CPU"
    line = (f"engine settings for {device} (flags of the same name change them): "
            + ", ".join(f"{name} {value} ({why})" for name, (value, why) in chosen.items()))
    return dataclasses.replace(engine, **{name: value for name, (value, _) in chosen.items()}), [line]


def _cuda_memory(engine: EngineConfig, placement: Placement) -> dict[str, tuple[Any, str]]:
    """A CUDA engine's memory settings left unset: the KV cache and max_num_seqs sized to the run
    with the share that implies, else the plan's share; a KV size given alone gets the share too,
    so that vLLM's start-up check asks for what the plan gave, not its 0.92 default."""
    chosen: dict[str, tuple[Any, str]] = {}
    sizing, fraction = placement.engine_sizing, placement.engine_memory_fraction
    if engine.gpu_memory_utilization is None and fraction is not None:
        chosen["gpu_memory_utilization"] = (fraction, "the plan's share of the GPU")
    if engine.kv_cache_memory_bytes is None and engine.gpu_memory_utilization is None and sizing is not None:
        # A share too small for the run: vLLM sizes the cache within it from its own profile,
        # which knows the engine's activations better than the plan's estimate does.
        if not sizing.capped:
            chosen["kv_cache_memory_bytes"] = (sizing.kv_cache_bytes, "the run's sequences in flight")
        if engine.max_num_seqs == LAUNCHER_MAX_NUM_SEQS:
            chosen["max_num_seqs"] = (sizing.max_num_seqs, "what the KV cache holds")
    return chosen


def judge_engine(given: EngineConfig, resolved: EngineConfig, placement: Placement, cuda: bool) -> EngineConfig:
    """A generative judge's engine: the generation engines' device choices (`resolved`: dtype, the
    CPU sizes), but on CUDA none of what the plan sized to the policy's run: its KV cache,
    max_num_seqs and max_model_len stay as `given` (vLLM's defaults when unset), since a judge's
    prompt holds a rubric, the question and the answer, longer than the run's longest sample; and
    the plan's memory share only where the judge shares a GPU (a whole GPU: vLLM's own default)."""
    if not cuda:
        return resolved
    share = resolved.gpu_memory_utilization if placement.worker_gpu_share < 1 else given.gpu_memory_utilization
    return dataclasses.replace(resolved, kv_cache_memory_bytes=given.kv_cache_memory_bytes, max_num_seqs=given.max_num_seqs,
                               max_model_len=given.max_model_len, gpu_memory_utilization=share)
