"""Logprob worker: scores rollouts with the trainer's exact logprob function, many samples per forward.

Callers (the logprob registry, on behalf of the experience batcher) send one sample per
`compute_logprobs` call, or a whole GRPO group per `compute_group_logprobs` call: the batcher uses
the latter, because a Ray call through the registry costs more CPU than scoring a short sample
(512 per-sample calls per demo step took ~1.5 core-seconds across registry, worker and batcher).
Either way every sample is queued on its own. Scoring one sample per forward leaves an
accelerator mostly idle, so the worker packs queued samples (padding-free,
`get_input_for_logprobs`; with `share_prompts` the answers of one prompt share it, as in the
trainer) into one forward of at most `max_tokens_per_forward` tokens, as
token_budget_queue.TokenBudgetQueue hands them out:

    caller -> compute_logprobs(sample) -> queue -> batch (<= token budget, or max_wait_ms after
    the first queued request) -> forward in a thread -> split_per_sample -> each caller's slice

The forward runs in a thread, so the event loop keeps accepting requests for the next batch while
one is scored. Weight updates wait for the running batch and hold the next one back, so a batch
is always scored by one weight version. An error in a batch fails only that batch's callers.

Throughput of batched vs one-at-a-time scoring: `python -m benchmarks.logprob_batching`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Sequence

import ray
import torch

from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import LogprobBatchingConfig, PromptSharingConfig
from async_grpo.inference.token_budget_queue import QueuedRequest, TokenBudgetQueue, fail_requests
from async_grpo.config.actor_names import FROZEN_KINDS, LOGPROB, LOGPROB_SERVICE_KINDS
from async_grpo.model.packed_attention import PACKED_SDPA
from async_grpo.routing.worker_lifecycle import WorkerHealth, WorkerLifecycle
from async_grpo.weights.adapter_files import check_stable, read_adapter_folder
from async_grpo.weights.update import TensorBlob, WeightUpdate
from async_grpo.weights.worker_loader import (
    assemble_state_dict, fetch_shards, iter_assembled, iter_checkpoint_tensors, load_state_dict_into,
    load_streamed_into, update_shapes,
)
from sample_processing_utils import (
    INITIAL_WEIGHT_VERSION, Sample, TokenLogprobs, get_input_for_logprobs, split_per_sample,
)
from setup_model import (
    FLASH_ATTENTION_2, LORA_ADAPTER_NAME, MODEL_DTYPES, TokenLogprobModel, check_attn_dtype, check_prompt_sharing,
    default_attn_implementation, load_causal_lm, training_compute_dtype,
)
from vllm_registry import Bundle, serve_many

logger = logging.getLogger(__name__)

# Every caller awaits inside the actor until its batch is scored, so the actor must accept far
# more concurrent calls than one batch holds, or callers would be serialised before batching.
ACTOR_MAX_CONCURRENCY = 4096
_DEVICES = ("auto", "cpu", "cuda")
AUTO_DTYPE = "auto"
_ATTN_FIELD = "LogprobWorkerConfig.attn_implementation"


@dataclass(kw_only=True, frozen=True)
class LogprobWorkerConfig:
    """How one logprob worker loads its model and batches requests."""

    model_path: str
    """Hugging Face checkpoint folder (safetensors) loaded with from_pretrained."""
    batching: LogprobBatchingConfig = flattened(LogprobBatchingConfig())
    """How queued requests are packed into forwards (worker_options.LogprobBatchingConfig;
    top-level flags and keys)."""
    sharing: PromptSharingConfig = flattened(PromptSharingConfig())
    """Whether a forward lays a prompt out once before its answers: the trainer's own
    model.share_prompts (worker_options.PromptSharingConfig; the flag --share_prompts)."""
    logprob_chunk_size: int = 1024
    """Output positions per lm_head chunk (bounds the [chunk, vocab] fp32 logits held at once)."""
    device: str = "auto"
    """'cuda', 'cpu', or 'auto' (cuda when available)."""
    dtype: str = AUTO_DTYPE
    """Parameter dtype: 'auto', 'float32', 'bfloat16' or 'float16'. 'auto' is what the trainer
    computes in with its default ModelConfig.mixed_precision: bfloat16 on CUDA, float32 on CPU,
    so reference logprobs match the trainer's (pass 'float32' on CUDA when the trainer runs with
    model.mixed_precision: false). The log-softmax always runs in fp32."""
    kind: str = LOGPROB
    """Which service the worker serves: 'logprob' (reference or old-policy logprobs, as the trainer's
    logprob_role says; receives weight pushes in the old-policy role), 'reference' (the frozen
    reference model beside old-policy logprob workers) or 'teacher' (a teacher model for
    distillation). Reference and teacher workers refuse weight updates."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained; None: the trainer's default for the device
    (setup_model.default_attn_implementation: flash_attention_2 on CUDA when flash-attn imports,
    else packed_sdpa), except that a float32 model takes packed_sdpa, since flash-attn runs only
    fp16/bf16. An explicit flash_attention_2 with a float32 dtype is refused."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("LogprobWorkerConfig.model_path must be a checkpoint folder, got ''")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"LogprobWorkerConfig.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if self.device not in _DEVICES:
            raise ValueError(f"LogprobWorkerConfig.device must be one of {_DEVICES}, got {self.device!r}")
        if self.dtype != AUTO_DTYPE and self.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"LogprobWorkerConfig.dtype must be one of {(AUTO_DTYPE, *MODEL_DTYPES)}, got {self.dtype!r}"
            )
        if self.attn_implementation is not None and not self.attn_implementation:
            raise ValueError("LogprobWorkerConfig.attn_implementation must be None or a non-empty name")
        if self.sharing.share_prompts and self.attn_implementation is not None:
            check_prompt_sharing(self.attn_implementation, _ATTN_FIELD)
        if self.kind not in LOGPROB_SERVICE_KINDS:
            raise ValueError(f"LogprobWorkerConfig.kind must be one of {LOGPROB_SERVICE_KINDS}, got {self.kind!r}")
        # dtype 'auto' on device 'auto' resolves only on the worker, where resolve_model_settings
        # repeats this check; every other combination is known here already.
        if self.dtype != AUTO_DTYPE:
            check_attn_dtype(self.attn_implementation, MODEL_DTYPES[self.dtype], _ATTN_FIELD)
        elif self.device != "auto":
            check_attn_dtype(self.attn_implementation, resolve_dtype(self.dtype, torch.device(self.device)), _ATTN_FIELD)


@dataclass(slots=True)
class LogprobWorkerStats:
    """Counters since the worker started (successful batches only, unless named otherwise)."""

    batches: int
    """Forwards that completed."""
    samples: int
    """Samples scored by those forwards."""
    tokens: int
    """Packed tokens (prompt + output) in those forwards."""
    output_tokens: int
    """Output tokens scored (logprobs returned)."""
    mean_batch_fill: float
    """tokens / (batches * max_tokens_per_forward): average share of the token budget a forward used
    (an oversized single-sample batch counts above 1)."""
    max_batch_tokens: int
    """Largest packed forward, in tokens."""
    max_batch_samples: int
    """Most samples packed into one forward."""
    oversized_samples: int
    """Samples longer than max_tokens_per_forward, each run alone."""
    failed_batches: int
    """Forwards that raised; their callers got the error."""
    rejected_samples: int
    """Requests refused before queueing (empty prompt, token id outside the vocabulary)."""
    forward_s: float
    """Wall seconds spent in forwards (successful or not)."""
    weight_version: int
    """Weight version served now."""


@dataclass(slots=True)
class _Counters:
    """Mutable totals behind LogprobWorkerStats, updated on the event loop only."""

    batches: int = 0
    samples: int = 0
    tokens: int = 0
    output_tokens: int = 0
    max_batch_tokens: int = 0
    max_batch_samples: int = 0
    oversized_samples: int = 0
    failed_batches: int = 0
    rejected_samples: int = 0
    forward_s: float = 0.0
    last_error: str = ""
    """repr of the most recent batch error, '' if none."""


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model dtype: 'auto' -> bfloat16 on CUDA, float32 elsewhere (what the trainer computes
    in: fsdp_setup.build_training_model casts to bf16 on CUDA under ModelConfig.mixed_precision,
    its default, and stays fp32 on CPU); any other name as given."""
    if dtype == AUTO_DTYPE:  # the trainer's default, ModelConfig.mixed_precision on
        return training_compute_dtype(device, mixed_precision=True)
    return MODEL_DTYPES[dtype]


def resolve_model_settings(config: LogprobWorkerConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """(dtype, attention implementation) the worker loads its model with on `device`.

    Both default to the trainer's choice for the device (resolve_dtype,
    setup_model.default_attn_implementation); a float32 model never gets flash_attention_2 by
    default (packed_sdpa instead, with a warning), and an explicit one raises ValueError.
    """
    dtype = resolve_dtype(config.dtype, device)
    check_attn_dtype(config.attn_implementation, dtype, _ATTN_FIELD)
    attn = config.attn_implementation or default_attn_implementation(device, share_prompts=config.sharing.share_prompts)
    if attn == FLASH_ATTENTION_2 and dtype == torch.float32:
        logger.warning("flash-attn does not run float32 models; the float32 logprob worker uses %s", PACKED_SDPA)
        attn = PACKED_SDPA
    return dtype, attn


def check_sample(sample: Sample, vocab_size: int) -> None:
    """Raise ValueError if the sample cannot be scored: empty prompt or a token id outside the vocab.

    Checked before queueing so one bad sample fails only its own caller; on CUDA an out-of-range
    embedding index is a device-side assert that would poison the whole process.
    """
    if not sample.input_token_ids:
        raise ValueError(f"sample prompt_id={sample.prompt_id} has an empty prompt")
    ids = list(sample.input_token_ids) + list(sample.output_token_ids)
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"sample prompt_id={sample.prompt_id} has token id {bad} outside the model's vocabulary [0, {vocab_size})"
        )


def _current_node_id() -> str:
    """Ray node id (hex) of this process, or '' outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class LogprobWorker:
    """Queues compute_logprobs requests and scores them in token-budgeted packed forwards.

    Use it from one asyncio event loop (the Ray actor's, or a test's): the batching task is bound
    to the loop of the first call.
    """

    def __init__(self, worker_name: str, config: LogprobWorkerConfig) -> None:
        self.name = worker_name
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype, self.attn_implementation = resolve_model_settings(config, self.device)
        causal_lm = load_causal_lm(
            config.model_path, device=self.device, dtype=self.dtype, attn_implementation=self.attn_implementation
        )
        self.model = TokenLogprobModel(causal_lm, logprob_chunk_size=config.logprob_chunk_size).eval()
        self.vocab_size = int(causal_lm.get_input_embeddings().num_embeddings)
        self.weight_version = INITIAL_WEIGHT_VERSION
        self._holds_pushed_weights = False
        """True once a full-weight push replaced the checkpoint's weights (see _load_adapter)."""
        self._node_id = _current_node_id()
        self._queue = TokenBudgetQueue(config.batching.max_tokens_per_forward, config.batching.max_wait_ms / 1000.0)
        self._running_batch = 0
        # Held by every forward and by every weight load: a batch never sees two weight versions.
        self._model_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batcher: asyncio.Task | None = None
        self._closed = False
        self._counters = _Counters()
        self.life = WorkerLifecycle(worker_name)
        logger.info(
            "logprob worker %s: %s on %s (%s, %s), budget %d tokens, max wait %.1f ms",
            worker_name, config.model_path, self.device, self.dtype, self.attn_implementation,
            config.batching.max_tokens_per_forward, config.batching.max_wait_ms,
        )

    async def start(self) -> WorkerHealth:
        """Start the batching task on the running event loop and run the self-check (one packed
        forward of a canary sample, whose logprobs must be finite); report health. Idempotent."""
        self._ensure_batcher()
        if not self.life.self_checked:
            canary = Sample(input_token_ids=[0], gt_answer="", output_token_ids=[0, 0])
            try:
                async with self._model_lock:  # outside the queue: the batching counters stay the callers'
                    (values,) = await asyncio.to_thread(self._score, [canary])
                if len(values) != 2 or not all(v == v and v <= 0.0 for v in values):  # v == v: not NaN
                    raise RuntimeError(f"canary logprobs {values} are not 2 finite values <= 0")
            except Exception as exc:
                raise self.life.fail(f"self-check failed: {type(exc).__name__}: {exc}") from exc
            self.life.passed_self_check()
            logger.info("logprob worker %s: self-check passed", self.name)
        return self.health()

    def mark_ready(self) -> None:
        """INIT -> READY; the registry calls it once this worker holds the latest published weights."""
        self.life.mark_ready()

    async def compute_logprobs(self, sample: Sample) -> list[float]:
        """Logprob of each of the sample's output tokens under the current weights (length O)."""
        return (await self.compute_group_logprobs([sample]))[0].values

    def _enqueue(self, sample: Sample) -> asyncio.Future:
        """Queue an already checked sample for the next batches (now, not at the caller's next
        await); the future resolves to its TokenLogprobs once scored."""
        if not sample.output_token_ids:
            future = asyncio.get_running_loop().create_future()
            future.set_result(TokenLogprobs(weight_version=self.weight_version, values=[]))
            return future
        return self._queue.put(sample, sample.num_tokens)

    def _check(self, sample: Sample) -> None:
        """check_sample, counting refusals in stats().rejected_samples."""
        try:
            check_sample(sample, self.vocab_size)
        except ValueError:
            self._counters.rejected_samples += 1
            raise

    async def compute_group_logprobs(self, samples: Sequence[Sample]) -> list[TokenLogprobs]:
        """compute_logprobs of each sample, in order, from one call (one Ray round trip per group),
        each with the weight version that computed it.

        Each sample is still its own queued request, so a group may be split across batches and
        packed with other callers' samples (and a weight load may fall between two of them). An
        invalid sample fails the call before any is queued.
        """
        self.life.require_alive()
        self._ensure_batcher()
        for sample in samples:
            self._check(sample)
        try:
            values = list(await asyncio.gather(*[self._enqueue(s) for s in samples]))
        except Exception:
            self.life.request_failed()
            raise
        self.life.served()
        return values

    async def update_weights(self, update: WeightUpdate) -> int:
        """Load full weights from a WeightUpdate between two batches; returns the version now served.

        A LoRA update (update.is_adapter) is loaded only while the STABLE marker names it
        (adapter_files.UnstableVersionError otherwise), as an adapter on this worker's base model.

        Fetching fails cleanly (the model is untouched); a load that fails part-way leaves a mix
        of versions, so the worker enters FAILED (WorkerFailedError) and is replaced.
        """
        self.life.require_alive()
        if self.config.kind in FROZEN_KINDS:
            raise ValueError(f"{self.name} serves a frozen {self.config.kind} model and never loads pushed weights "
                             f"(v{update.version} offered)")
        self._ensure_batcher()
        if update.is_adapter:  # a LoRA policy's old-policy logprobs: its adapter on our base
            await asyncio.to_thread(check_stable, update)
        # The object-store loader the generation workers use (worker_loader.fetch_shards); full
        # weights are then assembled one tensor at a time as they are copied in (_load_weights),
        # never as a whole second copy of the model.
        if update.mode == "lora_files":
            adapter = await asyncio.to_thread(read_adapter_folder, update.adapter_path)
            load = partial(self._load_adapter, update.adapter_config, adapter)
        else:
            shards = await fetch_shards(update)
            load = (partial(self._load_adapter_shards, update.adapter_config, shards) if update.is_adapter
                    else partial(self._load_weights, shards))
        async with self._model_lock:
            try:
                await asyncio.to_thread(load)
            except Exception as exc:
                raise self.life.fail(f"weight update to v{update.version} failed: {type(exc).__name__}: {exc}") from exc
            self.weight_version = update.version
        logger.info("logprob worker %s now serves weight version %d", self.name, update.version)
        return self.weight_version

    def model_info(self) -> dict[str, str]:
        """The model this worker scores with and its tokenizer's fingerprint (the trainer checks a
        teacher's against the student's at start-up)."""
        from setup_model import load_tokenizer, tokenizer_fingerprint

        return {"model_path": self.config.model_path,
                "tokenizer_fingerprint": tokenizer_fingerprint(load_tokenizer(self.config.model_path))}

    def health(self) -> WorkerHealth:
        """Lifecycle state, weight version and load, in the record every worker returns."""
        note, problem = f"device={self.device} queued={len(self._queue)}", ""
        if self._closed:
            problem = "shut down"
        elif self._batcher is not None and self._batcher.done():
            problem = f"batching task stopped: {self._batcher_failure()}"
            self.life.fail(problem)
        elif self._counters.last_error:
            note += f" last batch error: {self._counters.last_error}"
        return WorkerHealth.of(self.life, kind=self.config.kind, node_id=self._node_id, weight_version=self.weight_version,
                               inflight_requests=len(self._queue) + self._running_batch, problem=problem, note=note)

    def stats(self) -> LogprobWorkerStats:
        """A snapshot of the batching counters."""
        c = self._counters
        budget_tokens = c.batches * self.config.batching.max_tokens_per_forward
        return LogprobWorkerStats(
            batches=c.batches,
            samples=c.samples,
            tokens=c.tokens,
            output_tokens=c.output_tokens,
            mean_batch_fill=c.tokens / budget_tokens if budget_tokens else 0.0,
            max_batch_tokens=c.max_batch_tokens,
            max_batch_samples=c.max_batch_samples,
            oversized_samples=c.oversized_samples,
            failed_batches=c.failed_batches,
            rejected_samples=c.rejected_samples,
            forward_s=c.forward_s,
            weight_version=self.weight_version,
        )

    async def shutdown(self) -> None:
        """Finish the running batch, fail the queued requests, and stop the batching task."""
        if self._closed:
            return
        self._closed = True
        self.life.finish()
        self._queue.close()
        if self._batcher is not None and self._loop is asyncio.get_running_loop():
            await asyncio.gather(self._batcher, return_exceptions=True)
        self._queue.fail_all(RuntimeError(f"logprob worker {self.name} shut down"))
        logger.info("logprob worker %s shut down: %s", self.name, self.stats())

    def _ensure_batcher(self) -> None:
        """Start the batching task on first use; refuse use after shutdown or from another loop."""
        if self._closed:
            raise RuntimeError(f"logprob worker {self.name} is shut down")
        loop = asyncio.get_running_loop()
        if self._batcher is None:
            self._loop = loop
            self._batcher = loop.create_task(self._batch_forever(), name=f"{self.name}-batcher")
            self._batcher.add_done_callback(self._on_batcher_done)
        elif self._loop is not loop:
            raise RuntimeError(f"logprob worker {self.name} is bound to another event loop")
        elif self._batcher.done():
            raise RuntimeError(f"logprob worker {self.name} batching task stopped: {self._batcher_failure()}")

    def _on_batcher_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("logprob worker %s batching task crashed", self.name, exc_info=task.exception())

    def _batcher_failure(self) -> str:
        assert self._batcher is not None
        if self._batcher.cancelled():
            return "cancelled"
        return repr(self._batcher.exception())

    async def _batch_forever(self) -> None:
        """Form batches and score them, one at a time, until shutdown."""
        while not self._closed:
            batch = await self._queue.next_batch()
            if batch:
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[QueuedRequest]) -> None:
        """Score one batch in a thread and hand every caller its slice (or the batch's error)."""
        num_tokens = sum(r.num_tokens for r in batch)
        if num_tokens > self.config.batching.max_tokens_per_forward:
            self._counters.oversized_samples += 1
            logger.warning(
                "logprob worker %s: sample of %d tokens exceeds max_tokens_per_forward=%d; scoring it alone (%d so far)",
                self.name, num_tokens, self.config.batching.max_tokens_per_forward, self._counters.oversized_samples,
            )
        loop = asyncio.get_running_loop()
        async with self._model_lock:
            self._running_batch = len(batch)
            started = loop.time()
            try:
                version = self.weight_version  # fixed while the lock is held
                results = await asyncio.to_thread(self._score, [r.item for r in batch])
            except Exception as error:
                self._counters.failed_batches += 1
                self._counters.last_error = repr(error)
                logger.exception("logprob worker %s: batch of %d samples failed", self.name, len(batch))
                fail_requests(batch, error)
                return
            finally:
                self._counters.forward_s += loop.time() - started
                self._running_batch = 0
        self._record_batch(batch, num_tokens)
        for request, logprobs in zip(batch, results):
            if not request.future.done():
                request.future.set_result(TokenLogprobs(weight_version=version, values=logprobs))

    def _score(self, samples: list[Sample]) -> list[list[float]]:
        """One packed forward (runs in a worker thread): per-sample output-token logprobs."""
        inputs = get_input_for_logprobs(samples, share_prompts=self.config.sharing.share_prompts)
        with torch.inference_mode():
            logprobs, _entropy = self.model.score(inputs)
        return split_per_sample(logprobs, inputs.output_lengths)

    def _load_adapter(self, adapter_config: str, tensors: dict[str, torch.Tensor]) -> None:
        """Apply a PEFT adapter to the loaded base model (runs in a worker thread): the first one
        wraps the model with PEFT (in place, so the base weights are not copied), later ones
        replace the adapter's tensors. Raises ValueError naming what did not fit."""
        from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict

        config = PeftConfig.from_peft_type(**json.loads(adapter_config))
        if self._holds_pushed_weights and not isinstance(self.model.causal_lm, PeftModel):
            # Full weights a previous run pushed: the adapter was trained on the checkpoint's own.
            with torch.no_grad():
                load_state_dict_into(self.model.causal_lm, dict(iter_checkpoint_tensors(self.config.model_path)))
            self._holds_pushed_weights = False
            logger.warning("logprob worker %s held pushed full weights; reloaded %s's own before the LoRA adapter",
                           self.name, self.config.model_path)
        if not isinstance(self.model.causal_lm, PeftModel):
            self.model.causal_lm = get_peft_model(self.model.causal_lm, config, adapter_name=LORA_ADAPTER_NAME).eval()
        elif self.model.causal_lm.peft_config[LORA_ADAPTER_NAME].r != config.r:
            raise ValueError(f"adapter rank changed from {self.model.causal_lm.peft_config[LORA_ADAPTER_NAME].r} "
                             f"to {config.r} within a run")
        with torch.no_grad():
            result = set_peft_model_state_dict(self.model.causal_lm, tensors, adapter_name=LORA_ADAPTER_NAME)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"adapter tensors do not fit the model: missing {missing[:3]}, unexpected "
                             f"{list(result.unexpected_keys)[:3]}")

    def _load_adapter_shards(self, adapter_config: str, shards: list[dict[str, TensorBlob]]) -> None:
        """_load_adapter with the adapter's tensors assembled from its shards (small: a few MB)."""
        self._load_adapter(adapter_config, assemble_state_dict(shards))

    def _load_weights(self, shards: list[dict[str, TensorBlob]]) -> None:
        """Stream full HF-named tensors from an update's shards into the model, one assembled at a
        time (runs in a worker thread). A model a LoRA run wrapped with PEFT is unwrapped first
        (its adapter layers removed, not merged): full weights replace the whole policy."""
        from peft import PeftModel

        shapes = update_shapes(shards)
        if isinstance(self.model.causal_lm, PeftModel):
            self.model.causal_lm = self.model.causal_lm.unload()
            logger.warning("logprob worker %s served a LoRA adapter; removed it before loading full weights", self.name)
        load_streamed_into(self.model.causal_lm, shapes, iter_assembled(shards, views=True))
        self._holds_pushed_weights = True

    def _record_batch(self, batch: list[QueuedRequest], num_tokens: int) -> None:
        c = self._counters
        c.batches += 1
        c.samples += len(batch)
        c.tokens += num_tokens
        c.output_tokens += sum(len(r.item.output_token_ids) for r in batch)
        c.max_batch_tokens = max(c.max_batch_tokens, num_tokens)
        c.max_batch_samples = max(c.max_batch_samples, len(batch))


@ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)
class LogprobWorkerActor:
    """Ray shell over LogprobWorker; all methods run on the actor's event loop."""

    def __init__(self, worker_name: str, config: LogprobWorkerConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._worker = LogprobWorker(worker_name, config)

    async def start(self) -> WorkerHealth:
        return await self._worker.start()

    async def mark_ready(self) -> None:
        self._worker.mark_ready()

    async def compute_logprobs(self, sample: Sample) -> list[float]:
        return await self._worker.compute_logprobs(sample)

    async def compute_group_logprobs(self, samples: list[Sample]) -> list[TokenLogprobs]:
        return await self._worker.compute_group_logprobs(samples)

    async def call_many(self, method: str, calls: Bundle) -> AsyncIterator[Bundle]:
        """The registry's batched requests (vllm_registry.serve_many)."""
        async for chunk in serve_many(self._worker, ("compute_logprobs", "compute_group_logprobs"), method, calls):
            yield chunk

    async def update_weights(self, update: WeightUpdate) -> int:
        return await self._worker.update_weights(update)

    async def health(self) -> WorkerHealth:
        return self._worker.health()

    async def model_info(self) -> dict[str, str]:
        return self._worker.model_info()

    async def stats(self) -> LogprobWorkerStats:
        return self._worker.stats()

    async def shutdown(self) -> None:
        await self._worker.shutdown()
