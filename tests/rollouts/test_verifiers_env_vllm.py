"""Real verifiers environments through a generation worker on a real vLLM engine (the tiny chat model).

    .venv/bin/python -m pytest tests/rollouts/test_verifiers_env_vllm.py -q  # ~2-3 min (engine start, chat programs)

One GenerationWorker (verifier canary only, no --openai_endpoint_port: the worker starts its
endpoint itself on the first request with `sampling.verifiers`), the checkpoint's own weights
pushed as PUSHED_VERSION, then GenerationWorker.generate with sampling.verifiers naming one
single-turn environment (verifiers_arith under verifiers' SingleAgentEnv) and one multi-turn
environment verifiers ships (UserSimEnv: the policy also plays the modelled user). Everything of
verifiers runs unmodified (tests/rollouts/test_verifiers_env.py says how it runs offline).

Checked: each Sample's stream is exactly the ids the engine sampled (the endpoint's exchanges) plus
the user's replies as hand-written ChatML; the trainer's packed logprob pass over the Samples
reproduces the engine's sampling logprobs (a drifted or misplaced token anywhere would change
them); each reward equals the rubric recomputed from the last turn's decoded ids; versions and
verifiers/* counters.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from async_grpo.demo_assets.tiny_model import IM_END
from async_grpo.rewards.math_verify_pool import VerifierPool
from async_grpo.config.rollout_sources import VerifiersEnvConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
from sample_processing_utils import Sample
from setup_model import load_causal_lm, load_tokenizer
from support.chat_engine import assert_trainer_logprobs_match_engine, chat_worker_config, tiny_chat_model
from support.verifiers_checks import PERSONA_START, assistant_exchanges, chatml_ids, expected_reward, task_answer
from vllm_worker import GenerationWorker

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # the engine, and verifiers' chat program processes

HANG_GUARD_S = 540.0
N = 2
MAX_TOKENS = 12
USER_TURNS = 2
SEED = 2024
PROMPT_IDS = (3, 8)
PUSHED_VERSION = 4
ENVS = {"single": VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith", max_total_tokens=256),
        "multi": VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith", env="user-sim", max_total_tokens=512,
                                    options={"user": {"max_turns": USER_TURNS}})}


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


async def _run(model_dir: Path, ray) -> dict:
    with VerifierPool(num_processes=1, timeout_s=30.0) as pool:  # the worker's start-up canary only
        worker = GenerationWorker("verifiers-env-test", chat_worker_config(model_dir, max_model_len=1024), verifier=pool)
        await worker.start()
        try:
            assert worker.endpoint_url() is None  # not asked for: the verifiers source starts it
            weights = state_dict_to_blobs(dict(load_causal_lm(model_dir).state_dict()))
            assert await worker.update_weights(WeightUpdate(version=PUSHED_VERSION,
                                                            shard_refs=[ray.put(weights)])) == PUSHED_VERSION
            samples = {}
            for name, env in ENVS.items():
                sampling = SamplingConfig(n=N, max_tokens=MAX_TOKENS, seed=SEED, verifiers=env)
                samples[name] = [s for prompt_id in PROMPT_IDS for s in await worker.generate(
                    Sample(input_token_ids=[1], gt_answer="", prompt_id=prompt_id), sampling)]
            return {"samples": samples, "exchanges": list(worker.endpoint_host.endpoint.exchanges),
                    "url": worker.endpoint_url(), "detail": worker.health().detail,
                    "metrics": worker.verifiers.metrics(), "inflight": worker.health().inflight_requests}
        finally:
            await worker.close_endpoint()
            worker.shutdown()


@pytest.fixture(scope="module")
def outcome(ray_local, chat_model_dir: Path) -> dict:
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as GenerationWorker.start sets it; restored below
    try:
        return asyncio.run(asyncio.wait_for(_run(chat_model_dir, ray_local), HANG_GUARD_S))
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


@pytest.mark.parametrize("name", ["single", "multi"])
def test_streams_are_the_engines_ids_plus_chatml_observations_and_rewards_the_rubric(
        outcome: dict, chat_model_dir: Path, name: str) -> None:
    tokenizer = load_tokenizer(chat_model_dir)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    exchanges = outcome["exchanges"]
    user_replies = [tokenizer.decode(e.generation.token_ids, skip_special_tokens=True) for e in exchanges
                    if PERSONA_START in tokenizer.decode(e.prompt_token_ids)]
    turns = []
    for sample in outcome["samples"][name]:
        assert not sample.reward_failed
        served = assistant_exchanges(exchanges, sample)
        assert served and served[0].prompt_token_ids == sample.input_token_ids
        ids: list[int] = []
        mask: list[bool] = []
        for turn, exchange in enumerate(served):
            assert exchange.route == "generate"
            assert exchange.prompt_token_ids == sample.input_token_ids + ids
            ids += exchange.generation.token_ids
            mask += [True] * len(exchange.generation.token_ids)
            if turn + 1 < len(served):
                gap = served[turn + 1].prompt_token_ids[len(sample.input_token_ids) + len(ids):]
                closer = "" if exchange.generation.token_ids[-1] == im_end else IM_END
                assert any(gap == chatml_ids(tokenizer, f"{closer}\n<|im_start|>user\n{reply.strip()}<|im_end|>\n"
                                                     "<|im_start|>assistant\n") for reply in user_replies)
                ids += gap
                mask += [False] * len(gap)
        assert sample.output_token_ids == ids
        assert (sample.output_mask or [True] * len(ids)) == mask
        assert sample.sampling_logprobs == [lp for e in served for lp in e.generation.logprobs]
        last_reply = tokenizer.decode(served[-1].generation.token_ids, skip_special_tokens=True)
        assert sample.reward == pytest.approx(expected_reward(last_reply, task_answer(sample.prompt_id)), abs=1e-12)
        turns.append(len(served))
    assert len(turns) == N * len(PROMPT_IDS)
    assert all(t == 1 for t in turns) if name == "single" else all(t > 1 for t in turns)


def test_the_trainers_packed_logprobs_reproduce_the_engines(outcome: dict, chat_model_dir: Path) -> None:
    samples = [s for name in ENVS for s in outcome["samples"][name]]
    assert_trainer_logprobs_match_engine(chat_model_dir, samples)


def test_versions_counters_and_the_endpoint_the_worker_started(outcome: dict) -> None:
    samples = [s for name in ENVS for s in outcome["samples"][name]]
    assert all(s.weight_version == PUSHED_VERSION and s.token_versions is None for s in samples)
    assert outcome["url"] is not None and outcome["url"].startswith("http://127.0.0.1:")
    metrics = outcome["metrics"]
    assert metrics["verifiers/samples"] == metrics["verifiers/episodes"] == len(samples)
    assert metrics["verifiers/drifted"] == metrics["verifiers/extra_branches"] == 0
    assert metrics["verifiers/failed_episodes"] == 0
    assert metrics["verifiers/sampled_tokens"] == sum(s.num_sampled_tokens for s in samples)
    assert f"verifiers/samples={len(samples)}" in outcome["detail"]
    assert outcome["inflight"] == 0
