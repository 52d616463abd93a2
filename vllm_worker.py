"""Generation worker: rollouts from a vLLM V1 `AsyncLLM`, rewards from the verifier pool.

One worker owns one engine (continuous batching, many concurrent requests). A request is one
dataset `Sample` plus the trainer's `SamplingConfig`; the answer is n completed copies of the
sample (tokens, sampling logprobs, reward, weight version). The group's advantages are computed
by the experience batcher once the group's reference logprobs are in (algorithm.py). Rewards
come from rollout_scoring.RolloutScorer (the verifier pool's verdict, shaped by
`SamplingConfig.reward` and the soft overlong punishment); sampling.py says what the tokens and
text hold when a stop string, stop token or EOS ends a completion.

The worker's other jobs are plain classes that it composes, sharing served_weights.ServedWeights
(the version and LoRA adapter the engine serves, and the requests running on them):

- its weight receivers (async_grpo/weights/, each a transport.WeightReceiver): full weights by the
  engine's transport, worker_object_store.ObjectStoreReloader (from the object store, in buckets of
  whole decoder layers, scheduling paused) or worker_cuda_transfer.TransferPassThrough (the
  trainer's CUDA transfers), and worker_adapter.AdapterLoader (a LoRA update as a new vLLM adapter
  once the run's STABLE marker names it);
- endpoint_host.EndpointHost: the loopback OpenAI-compatible endpoint over the engine.

The dispatcher starts it as a Ray actor (the engine-core process must be able to import
worker_transfer_backend.py, so the actor's runtime env carries the repository on PYTHONPATH). On
CPU an eager engine's core process is a fork of the actor (engine_process.py, engine_start.build_engine):

    worker = GenerationWorkerActor.options(name="generation-worker-0").remote(
        "generation-worker-0", GenerationWorkerConfig(model_path="runs/tiny-qwen2"))
    ray.get(worker.start.remote())
    samples = ray.get(worker.generate.remote(sample, SamplingConfig(n=8)))

Tests: `.venv/bin/python -m pytest tests/inference/test_vllm_worker.py -x -q` (starts real engines).
This module imports neither vLLM nor math-verify at import time (math_verifier loads it in its
own processes), so a process without them can still import it (the dispatcher, the tests).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

import ray

from async_grpo.config.actor_names import GENERATION, JUDGE
from async_grpo.config.run_config import flattened
from async_grpo.config.sampling import SamplingConfig
from async_grpo.config.worker_options import (
    OBJECT_STORE_TRANSFER, EngineConfig, EngineTransferConfig, FailedSamplesConfig, VerificationConfig,
)
from async_grpo.inference.endpoint_host import EndpointHost
from async_grpo.inference.engine_requests import canary_tokens, completed_sample, sampling_params
from async_grpo.inference.engine_start import EngineStartError, build_engine, cpu_dtype_failure
from async_grpo.inference.failed_samples import FailedSampleLog
from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.rewards.math_verifier import RewardResult
from async_grpo.rewards.judge_reward import RegistryJudgeClient
from async_grpo.rewards.math_verify_cluster import connect_verifier_pool
from async_grpo.rewards.shaping import ShapedReward
from async_grpo.rollouts.multi_turn import ChatRenderer, MultiTurnStats, engine_generate, run_rollouts
from async_grpo.rollouts.rollout_scoring import RewardScorer, RolloutScorer, shaped_rewards
from async_grpo.rollouts.token_versions import CompletionVersions
from async_grpo.routing.worker_lifecycle import WorkerHealth, WorkerLifecycle
from async_grpo.runtime.ray_access import shared_memory_owner
from async_grpo.weights.transport import WeightReceiver
from async_grpo.weights.update import WeightUpdate
from async_grpo.weights.worker_adapter import AdapterLoader
from async_grpo.weights.worker_cuda_transfer import TransferPassThrough
from async_grpo.weights.worker_object_store import ObjectStoreReloader
from sample_processing_utils import Sample
from vllm_registry import BatchedRegistryClient, Bundle, get_or_create_registry, serve_many

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# One generate call holds one actor slot for its whole rollout, and the registry may send a
# worker up to its cost cap (sequences) at once; Ray's async-actor default (1000) already fits,
# stating it makes the limit visible.
ACTOR_MAX_CONCURRENCY = 1024


@dataclass(kw_only=True, frozen=True)
class GenerationWorkerConfig:
    """One generation worker: its vLLM engine, its verifiers, and where failed samples go."""

    model_path: str
    """Hugging Face model folder the engine loads (safetensors + tokenizer)."""
    engine: EngineConfig = flattened(EngineConfig())
    """The vLLM engine's options (worker_options.EngineConfig; top-level flags and keys)."""
    transfer: EngineTransferConfig = flattened(EngineTransferConfig())
    """How the trainer's weights reach the engine: the trainer's choice (worker_options.EngineTransferConfig)."""
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


_ENGINE_DEAD = "engine dead"


def connect_judge_pool() -> RegistryJudgeClient:
    """The judge pool's client (its registry's leases), made on the first group a judge scores."""
    return RegistryJudgeClient(BatchedRegistryClient(get_or_create_registry(JUDGE)))


class GenerationWorker:
    """One vLLM AsyncLLM engine and the rollouts it serves, scored by the verifier pool; new
    weights and the endpoint are the jobs of the plain classes it composes (module docstring).

    Plain class: construct it without Ray; `start()` builds the engine. The verifier defaults
    to the cluster's named verifier-pool actor (connected on first use); pass any RewardScorer
    to use another one.
    """

    def __init__(self, worker_name: str, config: GenerationWorkerConfig, verifier: RewardScorer | None = None,
                 files_owner: str | None = None) -> None:
        """files_owner: the name its shared-memory files go under (ray_access.shared_memory_owner
        in a cluster, so that its dispatcher finds and removes them; default worker_name)."""
        self.worker_name = worker_name
        self.config = config
        self.stats = GenerationStats()
        connect = functools.partial(connect_verifier_pool, config.verification.global_num_verifiers,
                                    config.verification.verifier_timeout_s)
        self.scorer = RolloutScorer(worker_name, connect, verifier, count_in_worker=self._count_verdicts_in_worker,
                                    connect_judge=connect_judge_pool)
        self._failed = FailedSampleLog(config.failed_samples.path, worker_name)
        self._engine: AsyncLLM | None = None
        self._renderer: ChatRenderer | None = None
        """The chat template that renders environments' observations (loaded on first use)."""
        self.multi_turn = MultiTurnStats()
        self._request_counter = 0
        self._update_lock = asyncio.Lock()
        self._start_error = ""
        self.engine_core_start = ""
        """How its engine-core process started: 'fork' or 'spawn' (engine_process.py); '' before start()."""
        self.life = WorkerLifecycle(worker_name)
        self.served = ServedWeights(self._remove_adapter)
        """The version and adapter the engine serves, and the requests running on them."""
        self.reloader = ObjectStoreReloader(
            worker_name, model_path=config.model_path, weight_transfer=config.transfer.weight_transfer,
            bucket_bytes=config.weight_reload_bucket_bytes, pause_mode=config.weight_update_pause_mode,
            served=self.served, stats=self.stats, life=self.life)
        self.adapter_loader = AdapterLoader(
            worker_name, max_lora_rank=config.engine.max_lora_rank, reloader=self.reloader, served=self.served,
            stats=self.stats, on_engine_error=self._fail_if_engine_dead, files_owner=files_owner)
        self.transfer = TransferPassThrough(
            worker_name, backend=config.transfer.weight_transfer, pause_mode=config.weight_update_pause_mode,
            engine=self._require_engine, served=self.served, stats=self.stats, life=self.life)
        self.full_weights: WeightReceiver = (
            self.reloader if config.transfer.weight_transfer == OBJECT_STORE_TRANSFER else self.transfer)
        self.endpoint_host = EndpointHost(
            worker_name, model_path=config.model_path, port=config.engine.openai_endpoint_port,
            engine=self._require_engine, served=self.served, stats=self.stats, life=self.life,
            on_engine_error=self._fail_if_engine_dead)
        from async_grpo.rollouts.verifiers_env import VerifiersSource

        self.verifiers = VerifiersSource(config.model_path, self.endpoint_host.served)
        """Rollouts through a verifiers environment (sampling.verifiers), started by the first such request."""

    @property
    def weight_version(self) -> int:
        """Version of the weights the engine serves (-1: the initial checkpoint)."""
        return self.served.version

    async def start(self) -> None:
        """Build the engine (tens of seconds: the engine-core process loads and warms the model)."""
        if self._engine is not None:
            return
        try:
            self._engine, self.engine_core_start = build_engine(self.config, self.worker_name)
        except EngineStartError as exc:
            self._start_error = str(exc)
            raise self.life.fail(f"engine did not start: {exc}") from exc.__cause__
        await self.full_weights.init_engine(self._engine)
        await self._self_check()
        await self.endpoint_host.start()

    def endpoint_url(self) -> str | None:
        """The endpoint's base URL (http://127.0.0.1:PORT/v1); None when it is off or not started."""
        return self.endpoint_host.url()

    async def close_endpoint(self) -> None:
        """Stop serving the endpoint and the verifiers environment on it (before shutdown(); the
        actor's shutdown does both)."""
        await self.verifiers.close()
        await self.endpoint_host.close()

    async def _self_check(self) -> None:
        """The canary before READY: one greedy token from the engine, one verification from the
        pool (plain numbers, so it checks the pool answers, not math-verify's parsing)."""
        engine = self._require_engine()
        try:
            tokens = await canary_tokens(engine, f"{self.worker_name}-canary-{uuid.uuid4().hex[:8]}")
            if tokens != 1:
                raise RuntimeError(f"canary generation returned {tokens} tokens, expected 1")
            (result,) = await self.scorer.verify(["2"], "2", in_worker=False)  # the pool must answer
            if result.failed or result.reward != 1.0:
                raise RuntimeError(f"canary verification of '2' against '2' gave reward {result.reward} "
                                   f"({result.error or 'no error'})")
        except Exception as exc:
            reason = cpu_dtype_failure(self.config.engine.dtype) or f"{type(exc).__name__}: {exc}"
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
        async with self.served.request() as (version, adapter):
            # A LoRA request keeps its adapter (one version) to the end, and adapter loads do not
            # relabel the engine: only full-weight requests are tracked.
            track_id = uuid.uuid4().hex
            if adapter is None:
                self.served.token_versions.begin(track_id, version)
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
                    self._failed.record([(s, f"reward failed: {r.error}") for s, r in zip(samples, rewards)
                                         if r.failed])
                for s in samples:
                    s.record = None  # scored: nothing downstream reads it, and n copies would travel
                self.stats.count(samples, shaped)
                self.life.served()
                return samples
            finally:
                self.served.token_versions.discard(track_id)

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
                                      version=lambda: self.served.version, lora_request=adapter),
            self._renderer, sampling.max_tokens, self.multi_turn)

    def _completion_versions(self, track_id: str, completions: list[CompletionOutput], version: int,
                             tracked: bool) -> list[CompletionVersions]:
        """Each completion's weight versions: the engine's spans (vLLM labels every step's tokens
        with the weights that sampled them), checked against the pushes the request saw."""
        if not tracked:
            return [CompletionVersions(weight_version=version, token_versions=None) for _ in completions]
        versions = self.served.token_versions.finish(
            track_id, [(getattr(c, "weight_versions", None), len(c.token_ids)) for c in completions])
        self.stats.unattributed_versions += sum(not v.attributed for v in versions)
        return versions

    def _count_verdicts_in_worker(self, count: int) -> None:
        self.stats.verdicts_in_worker += count

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
        """Load a new weight version into the engine (`full_weights`), or a LoRA update as a new
        adapter (AdapterLoader); returns the version now served. A load that fails part-way leaves
        the engine with a mix of versions: the worker enters FAILED, and its dispatcher replaces it."""
        self.life.require_alive()
        engine = self._require_engine()
        async with self._update_lock:
            if update.version < self.served.version and not update.initial:
                raise ValueError(
                    f"{self.worker_name}: update to version {update.version} is older than served {self.served.version}"
                )
            await (self.adapter_loader if update.is_adapter else self.full_weights).receive(engine, update)
            return self.served.version

    # ---- vLLM's CUDA weight transfers (EngineTransferConfig.weight_transfer nccl / nccl_m2n / ipc): the
    # trainer drives them (trainer_cuda_transfer.EngineWeightSender); TransferPassThrough passes them on.

    def transfer_describe(self) -> dict[str, Any]:
        return self.transfer.describe()

    async def transfer_init(self, backend: str, init_info: dict[str, Any]) -> None:
        await self.transfer.init(backend, init_info)

    async def transfer_start(self) -> None:
        await self.transfer.start()

    async def transfer_update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self.transfer.update(update_info)

    async def transfer_finish(self, version: int) -> int:
        return await self.transfer.finish(version)

    def health(self) -> WorkerHealth:
        """Lifecycle state, liveness and load as the registry sees them. An engine found dead
        here (no request needed to notice) moves the worker to FAILED."""
        problem = self._engine_problem()
        if problem == _ENGINE_DEAD:
            self.life.fail("vLLM engine died (engine-core process gone)")
        note = ", ".join(f"{k}={v:g}" for k, v in {**self.stats.as_metrics(), **self.multi_turn.metrics(),
                                                   **self.verifiers.metrics(), **self.scorer.judge_stats.as_metrics()}.items())
        if self.engine_core_start:
            note += f", engine_core={self.engine_core_start}"
        if self.endpoint_host.endpoint is not None:
            note += f", endpoint={self.endpoint_host.url()}"
        return WorkerHealth.of(
            self.life, kind=GENERATION,
            node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            weight_version=self.served.version, inflight_requests=self.served.inflight, problem=problem, note=note,
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
        self.endpoint_host.close_in_background()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            logger.info("%s: engine shut down", self.worker_name)


@ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)
class GenerationWorkerActor:
    """Ray actor over GenerationWorker: same methods, nothing else."""

    def __init__(self, worker_name: str, config: GenerationWorkerConfig) -> None:
        self._worker = GenerationWorker(worker_name, config, files_owner=shared_memory_owner(worker_name))

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
