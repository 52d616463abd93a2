"""Multi-turn rollouts against a real vLLM engine (AsyncLLM in this process, the tiny chat model).

    .venv/bin/python -m pytest tests/rollouts/test_multi_turn_vllm.py -q      # ~1-2 min (engine start)

What it checks, per rollout: the sample's output stream is exactly the tokens the engine
returned in each turn plus the observation tokens as appended (which are the hand-written ChatML
text of the tool's answer, encoded), the mask and the logprob count follow, the engine's prompt
of each turn is the trained context before that turn, and the trainer's own logprob pass over
the packed, masked sample reproduces the engine's sampling logprobs: a drifted token anywhere
before a turn would change that turn's logprobs.

A random tiny model never writes the <tool_call> tags, so the environment here reads each turn
as if the model had wrapped it in them: the engine's own text is what the tool-call parser meets,
and being random it is malformed JSON, which must come back as an observation saying so.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from async_grpo.inference.engine_requests import sampling_params
from async_grpo.inference.judge_models import GenerativeJudge, VllmTextEngine
from async_grpo.inference.judge_worker import JudgeWorker, JudgeWorkerConfig
from async_grpo.rewards.judge_reward import JudgeReply, JudgeRequest
from async_grpo.demo_assets.tiny_model import IM_END
from async_grpo.rewards.math_verify_pool import VerifierPool
from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.environments import StepResult, Turn
from async_grpo.rollouts.multi_turn import (
    ChatRenderer, GenerateFn, Generation, MultiTurnStats, engine_generate, run_rollouts,
)
from async_grpo.config.sampling import SamplingConfig
from async_grpo.rollouts.tool_environment import ToolEnvironment
from sample_processing_utils import Sample
from setup_model import load_tokenizer
from support.chat_engine import assert_trainer_logprobs_match_engine, chat_worker_config, tiny_chat_model
from vllm_worker import GenerationWorker

pytestmark = pytest.mark.vllm

HANG_GUARD_S = 300.0
NUM_ROLLOUTS = 3
MAX_TURNS = 3
TURN_MAX_TOKENS = 12  # short turns: several turns fit the total budget
MAX_TOTAL_TOKENS = 400  # the tool instructions alone are ~300 tokens of the tiny BPE
SEED = 1234
QUESTION = "What is 12 + 30?"


class TaggedTurns(ToolEnvironment):
    """ToolEnvironment that reads each model turn wrapped in <tool_call> tags (see module docstring)."""

    def step(self, turn: Turn) -> StepResult:
        wrapped = Turn(index=turn.index, token_ids=turn.token_ids, text=f"<tool_call>{turn.text}</tool_call>",
                       finish_reason=turn.finish_reason)
        return super().step(wrapped)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _environment(max_turns: int = MAX_TURNS) -> EnvironmentConfig:
    return EnvironmentConfig(name=f"{TaggedTurns.__module__}:TaggedTurns", max_turns=max_turns,
                             max_total_tokens=MAX_TOTAL_TOKENS, options={"tools": ["calculator"]})


def _recording(generate: GenerateFn, log: list[tuple[list[int], Generation]]) -> GenerateFn:
    async def wrapped(token_ids: list[int], max_tokens: int) -> Generation:
        generation = await generate(token_ids, max_tokens)
        log.append((list(token_ids), generation))
        return generation
    return wrapped


WORKER_ROLLOUTS = 4  # GenerationWorker.generate with an environment: one prompt, n of them


async def _rollouts(model_dir: Path, tokenizer):
    """The engine-level rollouts (each turn recorded) and a GenerationWorker's own, on one engine."""
    with VerifierPool(num_processes=1, timeout_s=30.0) as pool:  # the worker's start-up canary only
        worker = GenerationWorker("multi-turn-test", chat_worker_config(model_dir), verifier=pool)
        await worker.start()
        try:
            engine = worker._require_engine()
            sampling = SamplingConfig(n=1, max_tokens=TURN_MAX_TOKENS, seed=SEED)
            logs: list[list[tuple[list[int], Generation]]] = [[] for _ in range(NUM_ROLLOUTS)]
            sample = Sample(input_token_ids=[1], gt_answer="42", prompt_id=0, record={"question": QUESTION})

            def generate_for(index: int) -> GenerateFn:
                params = sampling_params(sampling, prompt_id=sample.prompt_id)
                return _recording(engine_generate(engine, params, "prompt-0", rollout_index=index), logs[index])

            config = _environment()
            config.check()
            stats = MultiTurnStats()
            samples = await run_rollouts(sample, NUM_ROLLOUTS, config, generate_for, ChatRenderer(tokenizer),
                                         TURN_MAX_TOKENS, stats)
            worker_sampling = SamplingConfig(n=WORKER_ROLLOUTS, max_tokens=TURN_MAX_TOKENS, seed=SEED + 1,
                                             environment=config)
            worker_samples = await worker.generate(sample, worker_sampling)
            judged = await _judge_on(engine, tokenizer)
            return samples, logs, stats, worker_samples, worker.multi_turn.metrics(), judged
        finally:
            worker.shutdown()


@pytest.fixture(scope="module")
def rollouts(chat_model_dir: Path):
    tokenizer = load_tokenizer(chat_model_dir)
    # vLLM's CPU platform swaps the in-process 'uni' executor for 'mp' unless this is off (as
    # GenerationWorker.start sets it); restored after the module.
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        outcome = asyncio.run(asyncio.wait_for(_rollouts(chat_model_dir, tokenizer), HANG_GUARD_S))
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    return (tokenizer, *outcome)


def _expected_observation(tokenizer, last_token: int, content: str) -> list[int]:
    """The ChatML text of one tool answer after an assistant turn, written out by hand: the turn's
    <|im_end|> unless the model sampled it, then the tool turn and the next assistant opener."""
    closer = "" if last_token == tokenizer.convert_tokens_to_ids(IM_END) else IM_END
    text = f"{closer}\n<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_stream_is_the_engines_tokens_plus_observations_verbatim(rollouts) -> None:
    tokenizer, samples, logs, stats, _, _, _ = rollouts
    env = ToolEnvironment(tools=["calculator"])
    env.gt_answer = "42"
    prompt_text = (f"<|im_start|>system\n{env.system_prompt()}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                   "<|im_start|>assistant\n")
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    multi_turn_seen = False
    for sample, log in zip(samples, logs):
        assert sample.input_token_ids == prompt
        expected_ids: list[int] = []
        expected_mask: list[bool] = []
        expected_logprobs: list[float] = []
        for turn, (engine_prompt, generation) in enumerate(log):
            # The engine saw exactly the trained context up to this turn.
            assert engine_prompt == prompt + expected_ids
            expected_ids += generation.token_ids
            expected_mask += [True] * len(generation.token_ids)
            expected_logprobs += generation.logprobs
            if turn + 1 < len(log):
                # The tool's answer (the environment's words); its tokens are the ChatML text above.
                wrapped = Turn(index=turn, token_ids=generation.token_ids, text=f"<tool_call>{generation.text}</tool_call>",
                               finish_reason=generation.finish_reason)
                (message,) = env.step(wrapped).messages
                assert message["content"].startswith("error: "), message  # malformed: an observation, no crash
                observation = _expected_observation(tokenizer, generation.token_ids[-1], message["content"])
                expected_ids += observation
                expected_mask += [False] * len(observation)
        assert sample.output_token_ids == expected_ids
        assert sample.output_mask == expected_mask
        assert sample.sampling_logprobs == expected_logprobs
        assert len(sample.sampling_logprobs) == sample.num_sampled_tokens
        assert sample.num_tokens <= MAX_TOTAL_TOKENS
        sample.validate_generated()
        multi_turn_seen |= len(log) > 1
    assert multi_turn_seen, "no rollout had a second turn: the observation path went untested"
    assert stats.rollouts == NUM_ROLLOUTS and stats.observation_tokens > 0



def test_the_trainers_packed_logprobs_reproduce_the_engines(rollouts, chat_model_dir: Path) -> None:
    """The trainer's logprob pass over the packed, masked samples gives each sampled token the
    logprob the engine sampled it with: the context it scores is the engine's, token for token."""
    _, samples, _, _, _, _, _ = rollouts
    assert_trainer_logprobs_match_engine(chat_model_dir, samples)


def test_the_generation_worker_runs_the_configured_environment(rollouts) -> None:
    """GenerationWorker.generate with sampling.environment set: n multi-turn rollouts of the
    prompt, each a stream whose sampled tokens are the masked-in ones, with the environment's
    reward, its record dropped after scoring, and the worker's multi_turn counters."""
    tokenizer, _, _, _, worker_samples, metrics, _ = rollouts
    assert len(worker_samples) == WORKER_ROLLOUTS
    env = ToolEnvironment(tools=["calculator"])
    prompt_text = (f"<|im_start|>system\n{env.system_prompt()}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                   "<|im_start|>assistant\n")
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    for sample in worker_samples:
        sample.validate_generated()
        assert sample.input_token_ids == prompt
        assert sample.output_mask is not None and len(sample.output_mask) == len(sample.output_token_ids)
        assert len(sample.sampling_logprobs) == sample.num_sampled_tokens
        assert sample.record is None and sample.reward in (0.0, 1.0)
        assert sample.weight_version == -1  # no push: the loaded checkpoint
    observation_tokens = sum(len(s.output_token_ids) - s.num_sampled_tokens for s in worker_samples)
    assert metrics["multi_turn/rollouts"] == WORKER_ROLLOUTS
    assert metrics["multi_turn/observation_tokens"] == observation_tokens > 0
    assert metrics["multi_turn/sampled_tokens"] == sum(s.num_sampled_tokens for s in worker_samples)


JUDGE_MESSAGES = [{"role": "system", "content": "Grade the answer."}, {"role": "user", "content": QUESTION + " 42"}]
JUDGE_MAX_TOKENS = 8


async def _judge_on(engine, tokenizer) -> JudgeReply:
    """A judge worker's generative judge over this module's engine (a judge has an engine of its
    own in a run; its requests are what matter here): one greedy request."""
    worker = JudgeWorker("judge-worker-0", JudgeWorkerConfig(model_path="m"),
                         model=GenerativeJudge("judge-worker-0", tokenizer, VllmTextEngine(engine)))
    await worker.start()
    worker.mark_ready()
    return await worker.judge(JudgeRequest(messages=JUDGE_MESSAGES, max_tokens=JUDGE_MAX_TOKENS, temperature=0.0))


def test_a_generative_judge_replies_as_the_model_greedily_continues_its_chat(rollouts, chat_model_dir: Path) -> None:
    """The judge's reply is HF's greedy continuation of the hand-written ChatML of its request."""
    import torch

    from setup_model import load_causal_lm

    tokenizer, *_, reply = rollouts
    chat = ("<|im_start|>system\nGrade the answer.<|im_end|>\n<|im_start|>user\n" + QUESTION
            + " 42<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(chat, add_special_tokens=False)
    model = load_causal_lm(chat_model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=JUDGE_MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert reply.text == expected and reply.prompt_tokens == len(ids)
    assert 1 <= reply.completion_tokens <= JUDGE_MAX_TOKENS
