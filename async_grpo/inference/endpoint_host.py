"""The OpenAI-compatible endpoint a generation worker serves over its engine (openai_endpoint.py).

It starts after the worker's self-check when EngineConfig.openai_endpoint_port is set, or on a
free port when a verifiers environment first needs it (`EndpointHost.served`), and closes
before the engine. Its requests run on the engine as the worker's own rollouts do: refused once
the worker is FAILED, held during a weight update, counted in flight and in the worker's stats,
on the adapter served when they start, labelled with the weight version.

Worker side: aiohttp (openai_endpoint.py) and the tokenizer are imported when the endpoint starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Callable

from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.rollouts.multi_turn import Generation, engine_generate
from async_grpo.routing.worker_lifecycle import WorkerLifecycle

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.inference.openai_endpoint import Endpoint, SamplingRequest

logger = logging.getLogger(__name__)


class EndpointHost:
    """Starts, serves and closes the worker's loopback OpenAI-compatible endpoint."""

    def __init__(self, worker_name: str, *, model_path: str, port: int | None, engine: Callable[[], AsyncLLM],
                 served: ServedWeights, stats: GenerationStats, life: WorkerLifecycle,
                 on_engine_error: Callable[[BaseException], None]) -> None:
        """port: EngineConfig.openai_endpoint_port (None: off unless asked for; 0: a free port);
        engine: the started engine (raises before start); on_engine_error: the worker's check
        that fails it when a request raised because the engine died."""
        self.worker_name = worker_name
        self._model_path = model_path
        self._port = port
        self._engine = engine
        self._served = served
        self._stats = stats
        self._life = life
        self._on_engine_error = on_engine_error
        self.endpoint: Endpoint | None = None
        """The endpoint being served, once started."""
        self._closing: asyncio.Task | None = None
        """close_in_background's close (kept: a task nobody references may be collected)."""

    async def start(self, port: int | None = None) -> None:
        """Serve the endpoint on 127.0.0.1 when asked (the worker calls this after its self-check:
        nothing is served by an engine that failed it); `port` overrides the configured one."""
        port = self._port if port is None else port
        if port is None or self.endpoint is not None:
            return
        from async_grpo.inference.openai_endpoint import Endpoint, EndpointConfig
        from setup_model import load_tokenizer

        endpoint = Endpoint(EndpointConfig(port=port), load_tokenizer(self._model_path), self._generate)
        try:
            await endpoint.start()
        except OSError as exc:
            raise self._life.fail(f"OpenAI-compatible endpoint could not bind 127.0.0.1:{port}: {exc}") from exc
        self.endpoint = endpoint
        logger.info("%s: OpenAI-compatible endpoint on %s", self.worker_name, endpoint.base_url)

    async def served(self) -> Endpoint:
        """The endpoint, started on a free port if the configured port did not start one."""
        await self.start(0 if self._port is None else None)
        return self.endpoint

    def url(self) -> str | None:
        """The endpoint's base URL (http://127.0.0.1:PORT/v1); None when it is off or not started."""
        return self.endpoint.base_url if self.endpoint is not None else None

    async def _generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> Generation:
        """One endpoint request (openai_endpoint.Backend) on the engine as the worker's generate()
        runs its own: refused once FAILED, queued during a weight push, counted in flight and
        served, on the adapter served now, labelled with the weight version."""
        from async_grpo.inference.openai_endpoint import vllm_params

        self._life.require_alive()
        async with self._served.request() as (version, adapter):
            # A LoRA request keeps its adapter's version; full weights are read as the turn starts.
            current = (lambda: version) if adapter is not None else (lambda: self._served.version)
            try:
                generation = await engine_generate(self._engine(), vllm_params(sampling),
                                                   f"{self.worker_name}-{request_id}-{uuid.uuid4().hex[:8]}",
                                                   version=current, lora_request=adapter)(prompt_ids, sampling.max_tokens)
            except Exception as exc:
                self._stats.generation_failures += 1
                self._on_engine_error(exc)
                self._life.request_failed()
                raise
        self._stats.endpoint_requests += 1
        self._life.served()
        return generation

    async def close(self) -> None:
        """Stop serving the endpoint (before the engine shuts down)."""
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            await endpoint.close()
            logger.info("%s: OpenAI-compatible endpoint closed", self.worker_name)

    def close_in_background(self) -> None:
        """Close an endpoint still open (close() not awaited) on the running event loop, if any:
        its requests then fail, the engine being gone."""
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            with contextlib.suppress(RuntimeError):  # no running loop: the loop that served it is gone
                self._closing = asyncio.get_running_loop().create_task(endpoint.close())
