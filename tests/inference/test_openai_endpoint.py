"""async_grpo.inference.openai_endpoint.Endpoint's wire format and input checks, and verifiers_rollouts' drift refusal.

    .venv/bin/python -m pytest tests/inference/test_openai_endpoint.py -q

The engine behind the endpoint here is a recording backend that answers fixed ids: these tests pin
the HTTP layer (what a client reads, what is refused and counted, the weight versions each answer
carries); tests/rollouts/test_verifiers_vllm.py runs the same endpoint served by a real generation
worker.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from async_grpo.config.worker_options import EngineConfig
from async_grpo.inference.openai_endpoint import Endpoint, EndpointConfig, SamplingRequest
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from async_grpo.rollouts.multi_turn import Generation
from async_grpo.rollouts.verifiers_rollouts import (
    PrefixDriftError, Turn, VerifiersRolloutConfig, VerifiersRollouts, VerifiersStats, sample_from_turns,
)
from sample_processing_utils import Sample
from setup_model import load_tokenizer

ANSWER_IDS = [5, 6, 7]
ANSWER_LOGPROBS = [-0.5, -1.25, -2.0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("tiny-chat"), TinyModelConfig(tokenizer="bpe")))


@pytest.fixture(scope="module", autouse=True)
def _openai_platform_probed() -> None:
    """The openai client reads the platform once per process (platform.uname, which runs `uname -p`
    as a subprocess); probing it before the tests keeps that one-off child out of the fast tier's
    process guard, which is about children the code under test starts."""
    from openai import AsyncOpenAI

    AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="loopback").platform_headers()


class Recorder:
    def __init__(self, version: int = -1, runs: list[tuple[int, int]] | None = None) -> None:
        self.calls: list[tuple[list[int], SamplingRequest]] = []
        self.version, self.runs = version, runs

    async def __call__(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> Generation:
        self.calls.append((list(prompt_ids), sampling))
        return Generation(token_ids=list(ANSWER_IDS), logprobs=list(ANSWER_LOGPROBS), finish_reason="length",
                          text="", weight_version=self.version, version_runs=self.runs)


async def _with_endpoint(tokenizer, body, recorder: Recorder | None = None, max_kept_exchanges: int = 10_000):
    recorder = recorder or Recorder()
    endpoint = Endpoint(EndpointConfig(max_request_bytes=4096, max_tokens_cap=32, default_max_tokens=16,
                                       max_kept_exchanges=max_kept_exchanges), tokenizer, recorder)
    await endpoint.start()
    try:
        return await body(endpoint), endpoint, recorder
    finally:
        await endpoint.close()


def test_chat_completions_carry_the_exact_ids_through_the_openai_client(tokenizer) -> None:
    from openai import AsyncOpenAI

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]

    async def body(endpoint: Endpoint):
        assert endpoint.base_url.startswith("http://127.0.0.1:")
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key="loopback", max_retries=0)
        return await client.chat.completions.create(model="policy", messages=messages, max_tokens=3, seed=7)

    chat, endpoint, recorder = asyncio.run(_with_endpoint(tokenizer, body))
    prompt = tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    assert recorder.calls == [(prompt, SamplingRequest(max_tokens=3, seed=7))]
    assert chat.model_extra["prompt_token_ids"] == prompt
    assert chat.choices[0].model_extra["token_ids"] == ANSWER_IDS
    assert [c.logprob for c in chat.choices[0].logprobs.content] == ANSWER_LOGPROBS
    assert chat.choices[0].message.content == tokenizer.decode(ANSWER_IDS, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(prompt) and chat.choices[0].finish_reason == "length"
    assert endpoint.exchanges[0].prompt_token_ids == prompt and endpoint.rejected == 0


def test_verifiers_token_client_reads_the_generate_route(tokenizer) -> None:
    from openai import AsyncOpenAI
    from renderers import DefaultRenderer
    from renderers.client import generate

    async def body(endpoint: Endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key="loopback", max_retries=0)
        return await generate(client=client, renderer=DefaultRenderer(tokenizer), model="policy",
                              messages=[{"role": "user", "content": "hi"}], sampling_params={"max_tokens": 3})

    result, endpoint, recorder = asyncio.run(_with_endpoint(tokenizer, body))
    (prompt, sampling), = recorder.calls
    assert result["prompt_ids"] == prompt == endpoint.exchanges[0].prompt_token_ids
    assert result["completion_ids"] == ANSWER_IDS and result["completion_logprobs"] == ANSWER_LOGPROBS
    assert sampling.stop_token_ids == (tokenizer.eos_token_id,)  # the renderer's stop ids reach the engine


def test_weight_versions_reach_the_wire_and_the_sample(tokenizer) -> None:
    """A turn sampled across a push (version 4 for two tokens, 5 for the last): the wire names
    both, and the rollout source reads them back by request id into the Sample."""
    recorder = Recorder(version=4, runs=[(4, 2), (5, 1)])

    async def body(endpoint: Endpoint):
        from openai import AsyncOpenAI

        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{endpoint.port}/inference/v1/generate",
                                    json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}) as response:
                wire = await response.json()
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key="loopback", max_retries=0)
        source = VerifiersRollouts(client=client, tokenizer=tokenizer, endpoint=endpoint,
                                   config=VerifiersRolloutConfig(turn_max_tokens=3))
        blind = VerifiersRollouts(client=client, tokenizer=tokenizer, config=VerifiersRolloutConfig(turn_max_tokens=3))
        messages = [{"role": "user", "content": "hi"}]

        async def reward(_: list) -> float:
            return 1.0
        sample = await source.rollout(Sample(input_token_ids=[1], gt_answer=""), messages, _none, reward)
        unknown = await blind.rollout(Sample(input_token_ids=[1], gt_answer=""), messages, _none, reward)
        return wire, sample, unknown

    (wire, sample, unknown), endpoint, _ = asyncio.run(_with_endpoint(tokenizer, body, recorder))
    choice = wire["choices"][0]
    assert choice["weight_version"] == 4 and choice["token_versions"] == [[4, 2], [5, 1]]
    assert endpoint.exchange(wire["request_id"]) is endpoint.exchanges[0]
    assert sample.weight_version == 4 and sample.token_versions == [(4, 2), (5, 1)]
    sample.validate_generated()
    assert unknown.weight_version == -1 and unknown.token_versions is None  # no endpoint given: unknown


async def _none(_: list) -> None:
    return None


def test_kept_exchanges_are_bounded(tokenizer) -> None:
    async def body(endpoint: Endpoint):
        ids = []
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(f"http://127.0.0.1:{endpoint.port}/inference/v1/generate",
                                        json={"token_ids": [1], "sampling_params": {"max_tokens": 3}}) as response:
                    ids.append((await response.json())["request_id"])
        return ids

    ids, endpoint, _ = asyncio.run(_with_endpoint(tokenizer, body, max_kept_exchanges=2))
    assert [e.request_id for e in endpoint.exchanges] == ids[1:]
    assert endpoint.exchange(ids[0]) is None and endpoint.exchange(ids[2]) is endpoint.exchanges[-1]


def test_versions_of_turns_merge_into_one_run_list() -> None:
    first, second = _turn([1, 2], [3, 4]), _turn([1, 2, 3, 4, 9], [5, 6])
    first.weight_version = second.weight_version = 7
    same = sample_from_turns(Sample(input_token_ids=[0], gt_answer=""), [first, second], 0.0)
    assert same.weight_version == 7 and same.token_versions is None
    second.weight_version, second.version_runs = 7, [(7, 1), (8, 1)]
    split = sample_from_turns(Sample(input_token_ids=[0], gt_answer=""), [first, second], 0.0)
    assert split.weight_version == 7 and split.token_versions == [(7, 3), (8, 1)]


BAD_REQUESTS = [
    ("/v1/chat/completions", b"not json", "not JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 3}).encode(), "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [1]}]}).encode(), "content"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n must"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 33}).encode(), "cap"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "temperature": "hot"}).encode(), "temperature"),
    ("/inference/v1/generate", json.dumps({"token_ids": [], "sampling_params": {"max_tokens": 3}}).encode(),
     "token_ids"),
    ("/inference/v1/generate", json.dumps({"token_ids": [1, -2], "sampling_params": {"max_tokens": 3}}).encode(),
     "token_ids"),
    ("/inference/v1/generate", json.dumps({"token_ids": [1], "sampling_params": {"top_p": 0}}).encode(), "top_p"),
]


def test_bad_input_gets_one_clear_400_and_never_reaches_the_engine(tokenizer) -> None:
    async def body(endpoint: Endpoint):
        answers = []
        async with aiohttp.ClientSession() as session:
            for path, data, _ in BAD_REQUESTS:
                async with session.post(f"http://127.0.0.1:{endpoint.port}{path}", data=data,
                                        headers={"Content-Type": "application/json"}) as response:
                    answers.append((response.status, (await response.json())["error"]["message"]))
            async with session.post(f"http://127.0.0.1:{endpoint.port}/v1/chat/completions",
                                    data=b"{" + b" " * 5000 + b"}") as response:
                answers.append((response.status, (await response.json())["error"]["message"]))
        return answers

    answers, endpoint, recorder = asyncio.run(_with_endpoint(tokenizer, body))
    for (status, message), (path, _, expected) in zip(answers, BAD_REQUESTS):
        assert status == 400 and expected in message, (path, message)
    assert answers[-1][0] == 413
    assert endpoint.rejected == len(BAD_REQUESTS) + 1 and recorder.calls == [] and endpoint.exchanges == []


def _turn(prompt: list[int], completion: list[int]) -> Turn:
    return Turn(prompt_token_ids=prompt, completion_ids=completion, completion_logprobs=[-1.0] * len(completion),
                finish_reason="stop", content="")


def test_turns_become_one_masked_stream() -> None:
    stats = VerifiersStats()
    turns = [_turn([1, 2], [3, 4]), _turn([1, 2, 3, 4, 9, 9], [5])]
    sample = sample_from_turns(Sample(input_token_ids=[0], gt_answer="", prompt_id=3), turns, 0.5, stats)
    assert sample.input_token_ids == [1, 2] and sample.output_token_ids == [3, 4, 9, 9, 5]
    assert sample.output_mask == [True, True, False, False, True] and sample.num_sampled_tokens == 3
    assert sample.reward == 0.5 and sample.prompt_id == 3
    assert stats.metrics()["verifiers/observation_tokens"] == 2 and stats.drifted == 0


def test_a_re_rendered_prefix_is_refused_and_counted() -> None:
    stats = VerifiersStats()
    turns = [_turn([1, 2], [3, 4]), _turn([1, 2, 3, 8, 9], [5])]  # token 3 of the context re-tokenised
    with pytest.raises(PrefixDriftError, match="first difference at token 3 of 4"):
        sample_from_turns(Sample(input_token_ids=[0], gt_answer=""), turns, 0.0, stats)
    assert stats.drifted == 1 and stats.rollouts == 0


def test_sampling_request_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingRequest(max_tokens=0)
    with pytest.raises(ValueError, match="default_max_tokens"):
        EndpointConfig(default_max_tokens=10, max_tokens_cap=5)
    with pytest.raises(ValueError, match="chat template"):
        Endpoint(EndpointConfig(), object(), Recorder())
    with pytest.raises(ValueError, match="max_kept_exchanges"):
        EndpointConfig(max_kept_exchanges=0)
    with pytest.raises(ValueError, match="EngineConfig.openai_endpoint_port"):
        EngineConfig(openai_endpoint_port=70000)
