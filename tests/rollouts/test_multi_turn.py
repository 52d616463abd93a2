"""The multi-turn rollout loop (multi_turn.py) with the real chat tokenizer and a scripted engine.

    .venv/bin/python -m pytest tests/rollouts/test_multi_turn.py -q

The engine here answers from a script so that each turn's tokens are known in advance; the same loop
against a real vLLM engine is tests/rollouts/test_multi_turn_vllm.py. Expected observation tokens
are the tokenizer's encoding of text written out by hand below (ChatML), not the renderer's.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from async_grpo.demo_assets.tiny_model import IM_END, build_chat_tokenizer
from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.environments import EnvPrompt, Reset, StepResult, Turn
from async_grpo.rollouts.multi_turn import (
    ENVIRONMENT_FAILURE, ChatRenderer, Generation, MultiTurnStats, run_rollout, run_rollouts,
)
from async_grpo.rollouts.tool_environment import ToolEnvironment
from sample_processing_utils import Sample, get_input_for_logprobs

HANG_GUARD_S = 60.0  # a deadlocked loop fails the test instead of hanging it
QUESTION = "What is 123 + 456?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer)


class ScriptedEngine:
    """Answers each call with the next scripted text (+ <|im_end|> unless cut), recording prompts."""

    def __init__(self, tokenizer, turns: list[str], cut: set[int] = frozenset(), versions: list[int] | None = None):
        self.tokenizer, self.turns, self.cut = tokenizer, turns, cut
        self.versions = versions or [0] * len(turns)
        self.prompts: list[list[int]] = []
        self.max_tokens: list[int] = []
        self.returned: list[list[int]] = []

    async def __call__(self, token_ids: list[int], max_tokens: int) -> Generation:
        i = len(self.prompts)
        self.prompts.append(list(token_ids))
        self.max_tokens.append(max_tokens)
        ids = self.tokenizer.encode(self.turns[i], add_special_tokens=False)
        cut = i in self.cut or len(ids) >= max_tokens
        ids = ids[:max_tokens] if cut else ids + [self.tokenizer.convert_tokens_to_ids(IM_END)]
        self.returned.append(ids)
        return Generation(token_ids=ids, logprobs=[-0.5 - 0.01 * k for k in range(len(ids))],
                          finish_reason="length" if cut else "stop", text=self.turns[i][: 10_000],
                          weight_version=self.versions[i])


def _sample() -> Sample:
    return Sample(input_token_ids=[5, 6], gt_answer="579", prompt_id=3, record={"question": QUESTION})


def _config(**overrides) -> EnvironmentConfig:
    fields = dict(name="async_grpo.rollouts.tool_environment:ToolEnvironment", max_turns=4, max_total_tokens=1024,
                  options={"tools": ["calculator"]})
    return EnvironmentConfig(**{**fields, **overrides})


def _run(sample, env, engine, renderer, config, max_tokens=256):
    return asyncio.run(asyncio.wait_for(run_rollout(sample, env, engine, renderer, config, max_tokens), HANG_GUARD_S))


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 + 456"}}</tool_call>'


def test_tokens_are_the_engines_plus_observations_verbatim(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "It is \\boxed{579}."])
    env = ToolEnvironment(tools=["calculator"])
    outcome = _run(_sample(), env, engine, renderer, _config())
    s = outcome.sample
    turn1, turn2 = engine.returned
    observation = tokenizer.encode("\n<|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    assert s.output_token_ids == turn1 + observation + turn2
    assert s.output_mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    assert len(s.sampling_logprobs) == s.num_sampled_tokens == len(turn1) + len(turn2)
    assert s.sampling_logprobs[len(turn1)] == -0.5  # turn 2's first logprob follows turn 1's last
    prompt_text = (f"<|im_start|>system\n{env.system_prompt()}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert s.input_token_ids == tokenizer.encode(prompt_text, add_special_tokens=False)
    # The engine's second prompt is exactly the trained context before turn 2.
    assert engine.prompts == [s.input_token_ids, s.input_token_ids + turn1 + observation]
    assert (outcome.turns, outcome.stop, s.reward, s.truncated, s.finish_reason) == (2, "done", 1.0, False, "stop")
    s.validate_generated()
    packed = get_input_for_logprobs([s])
    assert packed.output_lengths == [len(turn1) + len(turn2)]
    assert packed.targets.tolist() == turn1 + turn2


def test_a_malformed_tool_call_is_an_observation_not_a_crash(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "calculator", "arguments": </tool_call>',
                                        "<tool_call>oops", "\\boxed{1}"])
    outcome = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config())
    text = outcome.sample.output_text
    assert "<|im_start|>tool\nerror: the tool call is not valid JSON" in text
    assert "<|im_start|>tool\nerror: a <tool_call> has no closing </tool_call>" in text
    assert (outcome.turns, outcome.stop, outcome.sample.reward) == (3, "done", 0.0)


def test_a_turn_cut_at_its_limit_is_closed_by_the_observation(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, [CALL + " and more words", "\\boxed{579}"], cut={0})
    outcome = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config())
    turn1 = engine.returned[0]
    observation = outcome.sample.output_token_ids[len(turn1): len(outcome.sample.output_mask) - len(engine.returned[1])]
    assert tokenizer.decode(observation) == "<|im_end|>\n<|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n"
    assert not outcome.sample.truncated  # the last turn finished


def test_max_turns_and_the_token_budget_end_the_rollout(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, [CALL] * 3)
    outcome = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config(max_turns=2))
    assert (outcome.turns, outcome.stop, outcome.sample.truncated) == (2, "max_turns", False)
    assert outcome.sample.output_mask[-1] is True  # no observation after the last turn

    engine = ScriptedEngine(tokenizer, [CALL] * 3)
    first = _run(_sample(), ToolEnvironment(tools=["calculator"]), ScriptedEngine(tokenizer, [CALL] * 3), renderer,
                 _config(max_turns=1)).sample
    budget = first.num_tokens + 3  # room for turn 1 but not for its observation and a token
    outcome = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config(max_total_tokens=budget))
    assert (outcome.turns, outcome.stop, outcome.sample.truncated) == (1, "token_budget", True)
    assert outcome.sample.num_tokens <= budget

    engine = ScriptedEngine(tokenizer, [CALL] * 3)
    budget = first.num_tokens - 5  # turn 1 itself is cut by the budget
    outcome = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config(max_total_tokens=budget))
    assert engine.max_tokens[0] == budget - len(first.input_token_ids)
    assert outcome.sample.num_tokens == budget and outcome.sample.truncated


class _RaisingEnv:
    def reset(self, prompt: EnvPrompt) -> Reset:
        return Reset()  # keep the dataset's prompt tokens

    def step(self, turn: Turn) -> StepResult:
        raise RuntimeError("tool backend down")


def test_an_environment_that_raises_ends_its_rollout_flagged(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, ["hello"])
    outcome = _run(_sample(), _RaisingEnv(), engine, renderer, _config())
    s = outcome.sample
    assert s.input_token_ids == [5, 6]
    assert (outcome.stop, s.reward, s.reward_failed, s.reward_failure_reasons) == (
        "environment_error", 0.0, True, [ENVIRONMENT_FAILURE])


def test_a_rollout_across_a_weight_push_records_its_token_versions(tokenizer, renderer) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "\\boxed{579}"], versions=[4, 5])
    s = _run(_sample(), ToolEnvironment(tools=["calculator"]), engine, renderer, _config()).sample
    assert s.weight_version == 4
    assert s.token_versions == [(4, len(engine.returned[0])), (5, len(engine.returned[1]))]
    s.validate_generated()


class BlockingEnv:
    """step() of rollout 0 blocks (a plain, synchronous call) until rollout 1 has been sampled."""

    released = threading.Event()

    def reset(self, prompt: EnvPrompt) -> Reset:
        self.index = prompt.rollout_index
        return Reset()

    def step(self, turn: Turn) -> StepResult:
        if self.index == 0 and not BlockingEnv.released.wait(HANG_GUARD_S):
            raise RuntimeError("rollout 1 was never served while rollout 0 waited on its environment")
        return StepResult(reward=1.0, done=True)


def test_the_engine_serves_other_rollouts_while_one_waits_on_its_environment(tokenizer, renderer) -> None:
    """Rollout 0's environment blocks its thread until rollout 1 reaches the engine: if step()
    ran on the event loop, rollout 1 could never be sampled and rollout 0 would fail."""
    BlockingEnv.released.clear()

    def generate_for(index: int):
        async def generate(token_ids: list[int], max_tokens: int) -> Generation:
            if index == 1:
                await asyncio.sleep(0)  # yield once, so rollout 0's step is already waiting
                BlockingEnv.released.set()
            return Generation(token_ids=[7, 8], logprobs=[-1.0, -1.0], finish_reason="stop", text="x")
        return generate

    config = EnvironmentConfig(name=f"{BlockingEnv.__module__}:BlockingEnv")
    stats = MultiTurnStats()
    samples = asyncio.run(asyncio.wait_for(run_rollouts(_sample(), 2, config, generate_for, renderer, 8, stats),
                                           HANG_GUARD_S))
    assert [s.reward for s in samples] == [1.0, 1.0] and not any(s.reward_failed for s in samples)
    assert stats.metrics()["multi_turn/stop/done"] == 2.0 and stats.rollouts == 2


def test_text_observations_need_no_chat_template_and_are_appended_as_encoded() -> None:
    """The tool demo's path: a char tokenizer without a chat template, the dataset's prompt kept
    (Reset()), the tool's answer appended as plain text (ToolEnvironment format "text")."""
    from async_grpo.demo_assets.tiny_model import build_tiny_tokenizer

    char = build_tiny_tokenizer()
    assert not getattr(char, "chat_template", None)
    renderer = ChatRenderer(char)  # no template needed until messages are rendered
    eos = char.eos_token_id

    class CharEngine(ScriptedEngine):
        async def __call__(self, token_ids, max_tokens):
            i = len(self.prompts)
            self.prompts.append(list(token_ids))
            ids = char.encode(self.turns[i], add_special_tokens=False) + [eos]
            self.returned.append(ids)
            return Generation(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", text=self.turns[i])

    call = '<tool_call>{"name":"calculator","arguments":{"expression":"347+285"}}</tool_call>'
    engine = CharEngine(char, [call, "632"])
    prompt = char.encode("347+285=", add_special_tokens=False)
    sample = Sample(input_token_ids=prompt, gt_answer="632", prompt_id=1, record={"prompt": "347+285="})
    env = ToolEnvironment(tools=["calculator"], format="text")
    outcome = _run(sample, env, engine, renderer, _config(options={"tools": ["calculator"], "format": "text"}))
    s = outcome.sample
    turn1, turn2 = engine.returned
    observation = [char.convert_tokens_to_ids(c) for c in "<tool_response>632</tool_response>"]
    assert s.input_token_ids == prompt
    assert s.output_token_ids == turn1 + observation + turn2
    assert s.output_mask == [True] * len(turn1) + [False] * len(observation) + [True] * len(turn2)
    assert engine.prompts == [prompt, prompt + turn1 + observation]
    assert (outcome.stop, s.reward) == ("done", 1.0)


def test_messages_without_a_chat_template_fail_the_rollout_with_a_clear_error() -> None:
    from async_grpo.demo_assets.tiny_model import build_tiny_tokenizer

    renderer = ChatRenderer(build_tiny_tokenizer())
    with pytest.raises(ValueError, match="StepResult\\(text=...\\)"):
        renderer.prompt([{"role": "user", "content": "hi"}])


def test_step_result_takes_one_observation_form() -> None:
    assert StepResult(text="ok").text == "ok"
    with pytest.raises(ValueError, match="messages and text"):
        StepResult(messages=[{"role": "tool", "content": "1"}], text="1")
    with pytest.raises(ValueError, match="text and token_ids"):
        StepResult(text="1", token_ids=[1])
