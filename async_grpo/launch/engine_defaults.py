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
# sized by vLLM within the plan's share of the GPU; max_model_len the run's longest sample.
CUDA_ENGINE_DTYPE = "bfloat16"


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
        if memory_unset and placement.engine_memory_fraction is not None:
            chosen["gpu_memory_utilization"] = (placement.engine_memory_fraction, "the plan's share of the GPU")
        if engine.max_model_len is None and longest_sample is not None:
            chosen["max_model_len"] = (longest_sample, "the run's longest sample")
    if not chosen:
        return engine, []
    device = "CUDA" if cuda else "CPU"
    line = (f"engine settings for {device} (flags of the same name change them): "
            + ", ".join(f"{name} {value} ({why})" for name, (value, why) in chosen.items()))
    return dataclasses.replace(engine, **{name: value for name, (value, _) in chosen.items()}), [line]
