"""Judge worker: answers the judge requests of the reward named `judge` (rewards/judge_reward.py)
from a frozen model, one worker of the judge pool (`worker_dispatcher.py --mode judge`).

    judge-registry           least-loaded leases of JUDGE_METHOD, failover (vllm_registry.py)
    judge-worker-<i>         JudgeWorkerActor over JudgeWorker: judge(JudgeRequest) -> JudgeReply

The model is a generative judge (its own vLLM engine, which may load the policy's checkpoint but
never receives its weight pushes) or a reward-model head (judge_models.py). Each request counts 1
in the registry's load (judge_reward.JUDGE_REQUEST_COST). An engine that dies moves the worker to
FAILED: its requests raise WorkerFailedError, which the registry re-sends to another judge, and
its dispatcher starts a replacement. The actor is a thin shell over the plain JudgeWorker, which
a test drives with a stand-in model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import ray

from async_grpo.config.actor_names import JUDGE
from async_grpo.config.run_config import flattened
from async_grpo.config.worker_options import EngineConfig, JudgeServingConfig, LogprobBatchingConfig
from async_grpo.inference.judge_models import EngineDeadError, load_reward_model_judge, start_generative_judge
from async_grpo.rewards.judge_reward import JUDGE_METHOD, JudgeReply, JudgeRequest
from async_grpo.routing.batch_calls import Bundle, serve_many
from async_grpo.routing.worker_lifecycle import WorkerHealth, WorkerLifecycle
from sample_processing_utils import INITIAL_WEIGHT_VERSION

logger = logging.getLogger(__name__)

# Every request awaits inside the actor until its reply is ready, and the registry may send a
# worker up to its cap at once (worker_dispatcher: twice the engine's sequences).
ACTOR_MAX_CONCURRENCY = 1024
# The self-check's request: any chat, one greedy token (a generative judge) or one score.
_CANARY = JudgeRequest(messages=[{"role": "user", "content": "Is 2+2=4? Answer yes or no."}], max_tokens=1,
                       temperature=0.0)


@dataclass(kw_only=True, frozen=True)
class JudgeWorkerConfig:
    """One judge worker: its model and how it serves it."""

    model_path: str
    """Hugging Face model folder: a causal LM with a chat template (generative), or a
    sequence-classification checkpoint with one label (reward_model)."""
    serving: JudgeServingConfig = flattened(JudgeServingConfig())
    """Generative judge or reward-model head (worker_options.JudgeServingConfig)."""
    engine: EngineConfig = flattened(EngineConfig())
    """A generative judge's vLLM engine (its dtype serves a reward-model head too)."""
    batching: LogprobBatchingConfig = flattened(LogprobBatchingConfig())
    """A reward-model head's token-budgeted forwards (max_tokens_per_forward, max_wait_ms)."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("JudgeWorkerConfig.model_path must be set")


class JudgeModel(Protocol):
    """A judge worker's model (judge_models.GenerativeJudge, RewardModelJudge, or a test's stand-in)."""

    async def answer(self, request: JudgeRequest) -> JudgeReply:
        """The reply to one request; EngineDeadError when the model can answer no more."""
        ...

    def problem(self) -> str:
        """'' while it can answer, else why not."""
        ...

    async def close(self) -> None: ...


def load_judge_model(worker_name: str, config: JudgeWorkerConfig) -> JudgeModel:
    """The model config.serving.judge_kind names, loaded (a generative judge's engine started)."""
    if config.serving.judge_kind == "reward_model":
        return load_reward_model_judge(worker_name, config.model_path, config.engine.dtype, config.batching)
    return start_generative_judge(worker_name, config.model_path, config.engine)


class JudgeWorker:
    """One judge's lifecycle and requests over its model (plain class; `start()` loads the model
    unless one is given)."""

    def __init__(self, worker_name: str, config: JudgeWorkerConfig, model: JudgeModel | None = None) -> None:
        self.worker_name = worker_name
        self.config = config
        self.model = model
        self.life = WorkerLifecycle(worker_name)
        self.inflight = 0
        """Requests being answered now (the registry's load: 1 each)."""
        self.tokens_in = 0
        self.tokens_out = 0

    async def start(self) -> None:
        """Load the model (a generative judge: start its engine, tens of seconds), then the
        self-check: one canary request must be answered. Idempotent."""
        if self.life.self_checked:
            return
        try:
            if self.model is None:
                self.model = load_judge_model(self.worker_name, self.config)
            reply = await self.model.answer(_CANARY)
            if not isinstance(reply, JudgeReply):
                raise RuntimeError(f"canary request answered with a {type(reply).__name__}, not a JudgeReply")
        except Exception as exc:
            raise self.life.fail(f"self-check failed: {type(exc).__name__}: {exc}") from exc
        self.life.passed_self_check()
        logger.info("%s: %s judge on %s passed its self-check", self.worker_name, self.config.serving.judge_kind,
                    self.config.model_path)

    def mark_ready(self) -> None:
        """INIT -> READY; the registry calls it at registration."""
        self.life.mark_ready()

    async def judge(self, request: JudgeRequest) -> JudgeReply:
        """The model's reply to one request. WorkerFailedError once the worker is FAILED (its
        engine died), which the registry treats as the worker's death and re-sends elsewhere."""
        self.life.require_alive()
        if not isinstance(request, JudgeRequest):
            raise TypeError(f"{JUDGE_METHOD} takes a JudgeRequest, got {type(request).__name__}")
        if self.model is None:
            raise RuntimeError(f"{self.worker_name}: not started (call start() first)")
        self.inflight += 1
        try:
            reply = await self.model.answer(request)
        except EngineDeadError as exc:
            raise self.life.fail(str(exc)) from exc
        except Exception:
            self.life.request_failed()
            raise
        finally:
            self.inflight -= 1
        self.life.served()
        self.tokens_in += reply.prompt_tokens
        self.tokens_out += reply.completion_tokens
        return reply

    async def update_weights(self, update: Any) -> int:
        """Refused (`update`: a weights.update.WeightUpdate): a judge is frozen; the policy's pushes never reach it."""
        raise ValueError(f"{self.worker_name} serves a frozen judge and never loads pushed weights "
                         f"(v{update.version} offered)")

    def model_info(self) -> dict[str, str]:
        return {"model_path": self.config.model_path, "judge_kind": self.config.serving.judge_kind}

    def health(self) -> WorkerHealth:
        """Lifecycle, load and liveness; a model found dead here (no request needed) moves the worker to FAILED."""
        problem = self.model.problem() if self.model is not None else "model not loaded"
        if problem and self.model is not None:
            self.life.fail(problem)
        note = (f"{self.config.serving.judge_kind}, tokens_in={self.tokens_in}, tokens_out={self.tokens_out}")
        return WorkerHealth.of(
            self.life, kind=JUDGE, node_id=ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            weight_version=INITIAL_WEIGHT_VERSION, inflight_requests=self.inflight, problem=problem, note=note)

    async def shutdown(self) -> None:
        """Stop the model (a generative judge's engine-core process)."""
        self.life.finish()
        if self.model is not None:
            await self.model.close()
            self.model = None
            logger.info("%s: judge shut down", self.worker_name)


@ray.remote(max_concurrency=ACTOR_MAX_CONCURRENCY)
class JudgeWorkerActor:
    """Ray actor over JudgeWorker: same methods, nothing else."""

    def __init__(self, worker_name: str, config: JudgeWorkerConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._worker = JudgeWorker(worker_name, config)

    async def start(self) -> None:
        await self._worker.start()

    async def mark_ready(self) -> None:
        self._worker.mark_ready()

    async def judge(self, request: JudgeRequest) -> JudgeReply:
        return await self._worker.judge(request)

    async def call_many(self, method: str, calls: Bundle) -> AsyncIterator[Bundle]:
        """The registry's batched requests (routing.batch_calls.serve_many): `judge` only."""
        async for chunk in serve_many(self._worker, (JUDGE_METHOD,), method, calls):
            yield chunk

    async def update_weights(self, update: Any) -> int:
        return await self._worker.update_weights(update)

    async def model_info(self) -> dict[str, str]:
        return self._worker.model_info()

    async def health(self) -> WorkerHealth:
        return self._worker.health()

    async def shutdown(self) -> None:
        await self._worker.shutdown()
