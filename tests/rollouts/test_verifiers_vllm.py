"""verifiers' token client against our loopback endpoint on a real vLLM engine (the tiny chat model).

    .venv/bin/python -m pytest tests/rollouts/test_verifiers_vllm.py -q      # ~1-2 min (engine start)

One engine: a GenerationWorker started with its verifier canary and --openai_endpoint_port 0, so
the worker itself serves openai_endpoint.Endpoint on 127.0.0.1 (the path users get), an
AsyncOpenAI client pointed at the worker's endpoint_url(), and verifiers_rollouts.VerifiersRollouts
driving conversations through renderers.client.generate (verifiers 0.4.0's train-client call,
unmodified): a single-turn environment and a multi-turn one (a user turn after each answer).
Checked per rollout: the Sample's stream is exactly the ids the endpoint returned for each turn
plus the observation ids, which are the hand-written ChatML text of the user turn, encoded; masks
and logprob counts follow; the trainer's packed logprob pass reproduces the engine's sampling
logprobs (a drifted token anywhere would change them). The chat-completions route returns the
hand-written ChatML prompt's ids and the sampled ids with their logprobs. The checkpoint's own
weights are pushed as version PUSHED_VERSION first (a real update_weights through Ray's object
store): every Sample and answer carries that version, and the endpoint's requests count in the
worker's stats.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from async_grpo.demo_assets.tiny_model import IM_END
from async_grpo.rewards.math_verify_pool import VerifierPool
from async_grpo.rollouts.verifiers_rollouts import VerifiersRolloutConfig, VerifiersRollouts
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
from sample_processing_utils import Sample
from setup_model import load_causal_lm, load_tokenizer
from support.chat_engine import assert_trainer_logprobs_match_engine, chat_worker_config, tiny_chat_model
from vllm_worker import GenerationWorker

pytestmark = pytest.mark.vllm

HANG_GUARD_S = 300.0
ROLLOUTS_PER_ENV = 2
MAX_TURNS = 3
TURN_MAX_TOKENS = 12
SEED = 4321
SYSTEM = "Answer with a number."
QUESTION = "What is 2 + 2?"
NUDGE = "Try again."
# The checkpoint's own weights pushed as this version before any rollout: the logprobs still
# match the checkpoint, and a Sample left at the default -1 could not pass for the served version.
PUSHED_VERSION = 5


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


async def _single_turn_reward(messages: list[dict]) -> float:
    return 1.0 if "4" in messages[-1]["content"] else 0.0


async def _no_response(messages: list[dict]) -> None:
    return None


async def _nudge(messages: list[dict]) -> list[dict]:
    return [{"role": "user", "content": NUDGE}]


async def _turns_reward(messages: list[dict]) -> float:
    return float(sum(m["role"] == "assistant" for m in messages))


async def _run(model_dir: Path, tokenizer, ray):
    from openai import AsyncOpenAI

    with VerifierPool(num_processes=1, timeout_s=30.0) as pool:  # the worker's start-up canary only
        worker = GenerationWorker("verifiers-test", chat_worker_config(model_dir, openai_endpoint_port=0), verifier=pool)
        await worker.start()
        endpoint = worker.endpoint_host.endpoint
        try:
            weights = state_dict_to_blobs(dict(load_causal_lm(model_dir).state_dict()))
            assert await worker.update_weights(WeightUpdate(version=PUSHED_VERSION,
                                                            shard_refs=[ray.put(weights)])) == PUSHED_VERSION
            url = worker.endpoint_url()
            assert url is not None and url.startswith("http://127.0.0.1:")
            assert f"endpoint={url}" in worker.health().detail
            client = AsyncOpenAI(base_url=url, api_key="loopback", max_retries=0)
            runs = {}
            for name, turns, respond, reward in (("single", 1, _no_response, _single_turn_reward),
                                                 ("multi", MAX_TURNS, _nudge, _turns_reward)):
                source = VerifiersRollouts(client=client, tokenizer=tokenizer, endpoint=endpoint,
                                           config=VerifiersRolloutConfig(max_turns=turns,
                                                                         turn_max_tokens=TURN_MAX_TOKENS, seed=SEED))
                samples = []
                for index in range(ROLLOUTS_PER_ENV):
                    start = len(endpoint.exchanges)
                    prompt = Sample(input_token_ids=[1], gt_answer="4", prompt_id=index)
                    sample = await source.rollout(prompt, _messages(), respond, reward)
                    samples.append((sample, endpoint.exchanges[start:]))
                    source.config = VerifiersRolloutConfig(max_turns=turns, turn_max_tokens=TURN_MAX_TOKENS,
                                                           seed=SEED + 100 * (index + 1))
                runs[name] = (samples, source.stats.metrics())
            chat = await client.chat.completions.create(model="policy", messages=_messages(),
                                                        max_tokens=TURN_MAX_TOKENS, seed=SEED, temperature=1.0)
            served = {"version": worker.weight_version, "requests": worker.stats.endpoint_requests,
                      "exchanges": len(endpoint.exchanges), "inflight": worker.health().inflight_requests}
            return runs, chat, endpoint.exchanges[-1], served
        finally:
            await worker.close_endpoint()
            worker.shutdown()


@pytest.fixture(scope="module")
def outcome(ray_local, chat_model_dir: Path):
    tokenizer = load_tokenizer(chat_model_dir)
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as GenerationWorker.start sets it; restored below
    try:
        result = asyncio.run(asyncio.wait_for(_run(chat_model_dir, tokenizer, ray_local), HANG_GUARD_S))
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    return (tokenizer, *result)


def _prompt_ids(tokenizer) -> list[int]:
    text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False)


def _observation_ids(tokenizer, last_token: int) -> list[int]:
    """The ChatML text of the nudge after an assistant turn, written out by hand: the turn's
    <|im_end|> unless the model sampled it, then the user turn and the next assistant opener."""
    closer = "" if last_token == tokenizer.convert_tokens_to_ids(IM_END) else IM_END
    text = f"{closer}\n<|im_start|>user\n{NUDGE}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("env", ["single", "multi"])
def test_the_stream_is_the_endpoints_ids_plus_observations_verbatim(outcome, env: str) -> None:
    tokenizer, runs, _, _, _ = outcome
    samples, metrics = runs[env]
    multi_turn_seen = False
    for sample, exchanges in samples:
        assert sample.input_token_ids == _prompt_ids(tokenizer) == exchanges[0].prompt_token_ids
        expected_ids: list[int] = []
        expected_mask: list[bool] = []
        expected_logprobs: list[float] = []
        for turn, exchange in enumerate(exchanges):
            assert exchange.route == "generate"  # verifiers' token route, not chat re-rendering
            assert exchange.prompt_token_ids == sample.input_token_ids + expected_ids
            generation = exchange.generation
            expected_ids += generation.token_ids
            expected_mask += [True] * len(generation.token_ids)
            expected_logprobs += generation.logprobs
            if turn + 1 < len(exchanges):
                observation = _observation_ids(tokenizer, generation.token_ids[-1])
                expected_ids += observation
                expected_mask += [False] * len(observation)
        assert sample.output_token_ids == expected_ids
        assert (sample.output_mask or [True] * len(expected_ids)) == expected_mask
        assert sample.sampling_logprobs == expected_logprobs
        assert len(sample.sampling_logprobs) == sample.num_sampled_tokens
        sample.validate_generated()
        if env == "single":
            assert len(exchanges) == 1 and sample.output_mask is None
            assert sample.reward == (1.0 if "4" in tokenizer.decode(expected_ids, skip_special_tokens=True) else 0.0)
        else:
            assert sample.reward == float(len(exchanges))
        multi_turn_seen |= len(exchanges) > 1
    assert multi_turn_seen == (env == "multi")
    assert metrics["verifiers/rollouts"] == ROLLOUTS_PER_ENV and metrics["verifiers/drifted"] == 0
    assert metrics["verifiers/sampled_tokens"] == sum(s.num_sampled_tokens for s, _ in samples)


def test_the_trainers_packed_logprobs_reproduce_the_engines(outcome, chat_model_dir: Path) -> None:
    _, runs, _, _, _ = outcome
    samples = [s for env in ("single", "multi") for s, _ in runs[env][0]]
    assert_trainer_logprobs_match_engine(chat_model_dir, samples)


def test_chat_completions_return_the_exact_ids_and_logprobs(outcome) -> None:
    tokenizer, _, chat, exchange, served = outcome
    extra = chat.model_extra or {}
    assert extra["prompt_token_ids"] == _prompt_ids(tokenizer) == exchange.prompt_token_ids
    choice = chat.choices[0]
    assert (choice.model_extra or {})["token_ids"] == exchange.generation.token_ids
    assert [c.token for c in choice.logprobs.content] == [f"token_id:{t}" for t in exchange.generation.token_ids]
    assert [c.logprob for c in choice.logprobs.content] == exchange.generation.logprobs
    assert choice.message.content == tokenizer.decode(exchange.generation.token_ids, skip_special_tokens=True)
    assert chat.usage.completion_tokens == len(exchange.generation.token_ids)
    assert (choice.model_extra or {})["weight_version"] == served["version"] == exchange.generation.weight_version


def test_samples_carry_the_workers_weight_version_and_count_in_its_stats(outcome) -> None:
    _, runs, _, _, served = outcome
    samples = [s for env in ("single", "multi") for s, _ in runs[env][0]]
    # The push landed before any rollout: every token came from the version the worker serves.
    assert served["version"] == PUSHED_VERSION
    assert all(s.weight_version == served["version"] and s.token_versions is None for s in samples)
    assert all(e.generation.weight_version == served["version"] for env in runs for _, ex in runs[env][0] for e in ex)
    assert served["requests"] == served["exchanges"] > 0
    assert served["inflight"] == 0
