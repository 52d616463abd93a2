"""A loopback OpenAI-compatible endpoint over our generation engine, returning exact token ids.

Two routes, both JSON in and out (never pickle), bound to 127.0.0.1 only:

- ``POST /v1/chat/completions``: the messages are rendered with the model's chat template to token
  ids, generated with those exact ids, and answered in the standard chat.completion shape plus
  ``prompt_token_ids`` and, per choice, ``token_ids`` and ``logprobs.content`` (as vLLM's own
  server does with ``return_token_ids`` / ``logprobs``).
- ``POST /inference/v1/generate``: vLLM's token-in/token-out route, which verifiers 0.4.0's train
  client (``renderers.client.generate``) calls: ``{"token_ids", "sampling_params"}`` in,
  ``{"prompt_token_ids", "choices": [{"token_ids", "logprobs": {"content": [{"token":
  "token_id:N", "logprob"}]}, "finish_reason"}]}`` out.

The trainer then trains on exactly the sampled tokens: each answer carries the ids the engine
sampled and their sampling logprobs, and per choice (our extension) ``weight_version`` (the
weights that sampled its first token) and ``token_versions`` (run-length (version, count) pairs
when a weight push landed inside it, else null). The last ``EndpointConfig.max_kept_exchanges``
exchanges are kept in ``Endpoint.exchanges`` (and by request id, ``Endpoint.exchange``) for the
rollout source (verifiers_rollouts.py) to rebuild the stream and its versions from.

A generation worker serves it when ``--openai_endpoint_port`` is set (endpoint_host.py).

Bad input (not JSON, over the size limit, a missing or mistyped field) gets one 400 line.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from async_grpo.rollouts.multi_turn import Generation, engine_generate

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(kw_only=True, frozen=True)
class SamplingRequest:
    """The sampling fields of one request that the engine honours."""

    max_tokens: int
    """New tokens at most (> 0)."""
    temperature: float = 1.0
    """Sampling temperature (>= 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    seed: int | None = None
    """Per-request seed; None: unseeded."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the turn (the tokenizer's EOS always does)."""

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


Backend = Callable[[list[int], SamplingRequest, str], Awaitable[Generation]]
"""(exact prompt token ids, sampling, request id) -> the engine's Generation."""


@dataclass(kw_only=True, frozen=True)
class EndpointConfig:
    """Where and how the endpoint serves."""

    port: int = 0
    """TCP port on 127.0.0.1; 0 picks a free one (read Endpoint.port after start)."""
    model_name: str = "policy"
    """The model name the endpoint answers to in responses and /v1/models."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted; larger ones get 413."""
    max_tokens_cap: int = 4096
    """Largest max_tokens a request may ask for."""
    default_max_tokens: int = 256
    """max_tokens when a chat request names none."""
    max_kept_exchanges: int = 10_000
    """Most recent exchanges kept in Endpoint.exchanges (older ones are dropped: a worker serves
    for a whole run)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if not self.model_name:
            raise ValueError("model_name must be non-empty")
        if self.max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be > 0, got {self.max_request_bytes}")
        if self.max_kept_exchanges < 1:
            raise ValueError(f"max_kept_exchanges must be >= 1, got {self.max_kept_exchanges}")
        if not 0 < self.default_max_tokens <= self.max_tokens_cap:
            raise ValueError(f"default_max_tokens must be in (0, max_tokens_cap={self.max_tokens_cap}], "
                             f"got {self.default_max_tokens}")


@dataclass
class Exchange:
    """One generation the endpoint served: the exact prompt ids and the engine's answer."""

    route: str
    prompt_token_ids: list[int]
    generation: Generation
    messages: list[dict[str, Any]] | None = None
    request_id: str = ""


class BadRequest(ValueError):
    """A request the endpoint refuses with 400 (its message is the reason)."""


def vllm_params(sampling: SamplingRequest) -> Any:
    """vLLM SamplingParams of one endpoint request (n = 1, the sampled token's logprob)."""
    from vllm.sampling_params import SamplingParams

    return SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                          max_tokens=sampling.max_tokens, seed=sampling.seed,
                          stop_token_ids=list(sampling.stop_token_ids), logprobs=0)


def engine_backend(engine: Any, version: Callable[[], int] = lambda: -1, lora_request: Any = None) -> Backend:
    """A Backend over a vLLM AsyncLLM: one request per call, n = 1, through
    multi_turn.engine_generate (exact TokensPrompt, logprobs of the sampled tokens; `version` is
    the weight version served, read as the request starts). A generation worker serves the
    endpoint through its own backend instead (endpoint_host.EndpointHost: pause, stats, adapters)."""
    async def generate(prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> Generation:
        return await engine_generate(engine, vllm_params(sampling), request_id, version=version,
                                     lora_request=lora_request)(prompt_ids, sampling.max_tokens)
    return generate


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in value):
        raise BadRequest(f"{name} must be a non-empty list of non-negative integers")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] must be an object with a string role")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            # Only text: multimodal parts would need a processor the tiny chat models lack.
            raise BadRequest(f"messages[{index}].content must be a string (text only)")
    return value


def _logprobs_wire(generation: Generation) -> dict[str, Any]:
    # vLLM's shape, with the token named "token_id:N" as vLLM does under return_tokens_as_token_ids
    # (renderers.client checks that name against the returned id).
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(generation.token_ids, generation.logprobs)]}


def _versions_wire(generation: Generation) -> dict[str, Any]:
    runs = generation.version_runs
    return {"weight_version": generation.weight_version,
            "token_versions": [list(run) for run in runs] if runs else None}


class Endpoint:
    """The aiohttp app and its runner; start() binds 127.0.0.1, close() stops it."""

    def __init__(self, config: EndpointConfig, tokenizer: Any, backend: Backend) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the endpoint renders chat messages with a chat template; the tokenizer has none")
        self.config = config
        self.tokenizer = tokenizer
        self.backend = backend
        self.exchanges: list[Exchange] = []
        self._by_id: dict[str, Exchange] = {}
        self._by_tokens: dict[int, list[Exchange]] = {}
        """Kept exchanges by _token_key of (prompt ids, sampled ids), for find()."""
        self.rejected = 0
        """Requests answered 400/413 (counted: refused input is a metric, not a silence)."""
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port = config.port

    def exchange(self, request_id: str) -> Exchange | None:
        """The kept exchange answered with `request_id` (None once dropped or never served)."""
        return self._by_id.get(request_id)

    def find(self, prompt_ids: list[int], token_ids: list[int]) -> Exchange | None:
        """The kept exchange that sampled exactly `token_ids` after exactly `prompt_ids` (None: this
        endpoint did not serve that, or the exchange was dropped). How a rollout source proves a
        conversation's sampled spans are the engine's own, whatever client drove it."""
        for exchange in self._by_tokens.get(_token_key(prompt_ids, token_ids), ()):
            if exchange.prompt_token_ids == prompt_ids and exchange.generation.token_ids == token_ids:
                return exchange
        return None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("OpenAI-compatible endpoint on %s", self.base_url)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except ValueError as error:
            raise BadRequest(f"the body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _sampling(self, source: dict[str, Any], default_max_tokens: int | None) -> SamplingRequest:
        max_tokens = source.get("max_completion_tokens", source.get("max_tokens", default_max_tokens))
        if max_tokens is None or isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise BadRequest("max_tokens must be an integer")
        if max_tokens > self.config.max_tokens_cap:
            raise BadRequest(f"max_tokens {max_tokens} is over this endpoint's cap {self.config.max_tokens_cap}")
        if source.get("n", 1) != 1:
            raise BadRequest("n must be 1 (one completion per request)")
        seed = source.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer")
        stop_ids = source.get("stop_token_ids") or []
        if stop_ids:
            _int_list(stop_ids, "stop_token_ids")
        try:
            return SamplingRequest(max_tokens=max_tokens, temperature=_number(source, "temperature", 1.0),
                                   top_p=_number(source, "top_p", 1.0), seed=seed, stop_token_ids=tuple(stop_ids))
        except ValueError as error:
            raise BadRequest(str(error)) from None

    async def _serve(self, request: web.Request, handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
                     ) -> web.Response:
        try:
            return web.json_response(await handle(await self._body(request)))
        except BadRequest as error:
            self.rejected += 1
            logger.warning("400 on %s: %s", request.path, error)
            return web.json_response({"error": {"message": str(error), "type": "invalid_request_error"}}, status=400)
        except web.HTTPRequestEntityTooLarge:
            self.rejected += 1
            return web.json_response({"error": {"message": f"request body over {self.config.max_request_bytes} "
                                                           "bytes", "type": "invalid_request_error"}}, status=413)

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._chat_body)

    async def _generate(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._generate_body)

    async def _models(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"object": "list", "data": [{"id": self.config.model_name, "object": "model"}]})

    def render(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        """The chat template's token ids of `messages` with the assistant opener appended."""
        try:
            rendered = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)
        except Exception as error:  # the template's own refusal (bad roles, ...) is the client's input
            raise BadRequest(f"the chat template refused the messages: {error}") from None
        if isinstance(rendered, dict) or hasattr(rendered, "keys"):
            rendered = rendered["input_ids"]
        return list(rendered)

    async def _run(self, route: str, prompt_ids: list[int], sampling: SamplingRequest,
                   messages: list[dict[str, Any]] | None) -> tuple[str, Generation]:
        request_id = f"oai-{next(self._ids)}"
        generation = await self.backend(prompt_ids, sampling, request_id)
        exchange = Exchange(route=route, prompt_token_ids=list(prompt_ids), generation=generation,
                            messages=messages, request_id=request_id)
        self.exchanges.append(exchange)
        self._by_id[request_id] = exchange
        self._by_tokens.setdefault(_token_key(prompt_ids, generation.token_ids), []).append(exchange)
        excess = len(self.exchanges) - self.config.max_kept_exchanges
        if excess > 0:
            for old in self.exchanges[:excess]:
                self._by_id.pop(old.request_id, None)
                self._forget_tokens(old)
            del self.exchanges[:excess]
        return request_id, generation

    def _forget_tokens(self, exchange: Exchange) -> None:
        key = _token_key(exchange.prompt_token_ids, exchange.generation.token_ids)
        kept = [e for e in self._by_tokens.get(key, ()) if e is not exchange]
        if kept:
            self._by_tokens[key] = kept
        else:
            self._by_tokens.pop(key, None)

    async def _chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = _messages(body.get("messages"))
        sampling = self._sampling(body, self.config.default_max_tokens)
        prompt_ids = self.render(messages, body.get("tools"))
        request_id, generation = await self._run("chat", prompt_ids, sampling, messages)
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": generation.finish_reason, "token_ids": generation.token_ids,
                  "logprobs": _logprobs_wire(generation), **_versions_wire(generation)}
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.config.model_name, "choices": [choice], "prompt_token_ids": prompt_ids,
                "usage": _usage(prompt_ids, generation)}

    async def _generate_body(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt_ids = _int_list(body.get("token_ids"), "token_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        sampling = self._sampling(params, self.config.default_max_tokens)
        request_id, generation = await self._run("generate", prompt_ids, sampling, None)
        choice = {"index": 0, "token_ids": generation.token_ids, "finish_reason": generation.finish_reason,
                  "logprobs": _logprobs_wire(generation), **_versions_wire(generation)}
        return {"request_id": request_id, "prompt_token_ids": prompt_ids, "choices": [choice],
                "usage": _usage(prompt_ids, generation)}


def _token_key(prompt_ids: list[int], token_ids: list[int]) -> int:
    # A hash, not the ids: the exchange keeps the ids already; find() compares them in full.
    return hash((len(prompt_ids), tuple(prompt_ids), tuple(token_ids)))


def _usage(prompt_ids: list[int], generation: Generation) -> dict[str, int]:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(generation.token_ids),
            "total_tokens": len(prompt_ids) + len(generation.token_ids)}

