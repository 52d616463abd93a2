"""Real verifiers environments (verifiers.v1, unmodified) run by verifiers_env against our endpoint.

    .venv/bin/python -m pytest tests/rollouts/test_verifiers_env.py -q  # ~1-2 min (verifiers' chat program per turn)

The config checks are pure. The rest runs verifiers' own rollout code in-process: `Env.serving()`,
`Env.run_slot()`, its "null" harness program as a local process (registered to this interpreter,
no uv), its train client through renderers against openai_endpoint.Endpoint, its message graph
and the taskset's rubric; one single-turn environment (verifiers_arith under SingleAgentEnv) and
one multi-turn environment verifiers ships (UserSimEnv: a modelled user, played by the same
policy, converses with the assistant). The engine behind the endpoint here is a seeded recording
backend that answers a mix of numbers and token ids that do not survive decode/encode (so a
re-tokenised conversation would show); tests/rollouts/test_verifiers_env_vllm.py runs a real engine
through a generation worker.

Checked per Sample against what the endpoint served: the stream is the exchanges' sampled ids plus
hand-written ChatML observations, the mask and logprobs follow, the reward is recomputed from the
last reply's decoded ids with a regex written here (support.verifiers_checks).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from async_grpo.inference.openai_endpoint import Endpoint, EndpointConfig
from async_grpo.demo_assets.tiny_model import IM_END, TinyModelConfig, write_tiny_model
from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.multi_turn import Generation
from async_grpo.config.rollout_sources import VerifiersEnvConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.rollouts.verifiers_env import VerifiersEnvRunner, VerifiersEnvStats, sample_from_episode
from sample_processing_utils import Sample
from setup_model import load_tokenizer
from support.verifiers_checks import PERSONA_START, assistant_exchanges, chatml_ids, expected_reward, task_answer

VERSION = 7
SEED = 11
N = 2
MAX_TOKENS = 8
USER_TURNS = 3
PROMPT_ID = 5
HANG_GUARD_S = 600.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-chat"), TinyModelConfig(tokenizer="bpe"))


class MixedBackend:
    """Answers, per request, one of: a number, a number and words, or random ids (some of them
    bytes of a character that decode to U+FFFD), with or without <|im_end|>: seeded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(SEED)
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)

    async def __call__(self, prompt_ids, sampling, request_id) -> Generation:
        kind = self.rng.randrange(3)
        if kind == 0:
            ids = self.tokenizer.encode(str(self.rng.randrange(20)), add_special_tokens=False)
        elif kind == 1:
            ids = self.tokenizer.encode(f"{self.rng.randrange(20)} apples", add_special_tokens=False)
        else:
            ids = [self.rng.randrange(3, 600) for _ in range(self.rng.randrange(2, 7))]
        ids = ids[:sampling.max_tokens - 1]
        finish = "stop" if self.rng.random() < 0.5 else "length"
        if finish == "stop":
            ids = ids + [self.im_end]
        logprobs = [-self.rng.random() * 3 for _ in ids]
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish, text="", weight_version=VERSION)


async def _run(model_dir: Path, env: str, options: dict) -> tuple[list, list[Sample], dict, list]:
    tokenizer = load_tokenizer(model_dir)
    endpoint = Endpoint(EndpointConfig(), tokenizer, MixedBackend(tokenizer))
    await endpoint.start()
    runner = VerifiersEnvRunner(VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith", env=env, options=options),
                                endpoint, str(model_dir))
    try:
        await runner.start()
        prompt = Sample(input_token_ids=[1], gt_answer="", prompt_id=PROMPT_ID, group_id=PROMPT_ID)
        episodes = await runner.episodes(prompt, SamplingConfig(n=N, max_tokens=MAX_TOKENS, seed=SEED))
        samples = [sample_from_episode(prompt, episode, endpoint, runner.stats) for episode in episodes]
        return episodes, samples, runner.stats.metrics(), list(endpoint.exchanges)
    finally:
        await runner.close()
        await endpoint.close()


@pytest.fixture(scope="module")
def runs(model_dir: Path) -> dict:
    return {name: asyncio.run(asyncio.wait_for(_run(model_dir, env, options), HANG_GUARD_S))
            for name, env, options in (("single", "", {}), ("multi", "user-sim", {"user": {"max_turns": USER_TURNS}}))}


@pytest.mark.system
@pytest.mark.parametrize("name", ["single", "multi"])
def test_samples_are_the_served_ids_plus_chatml_observations(runs: dict, model_dir: Path, name: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    episodes, samples, metrics, exchanges = runs[name]
    user_replies = [tokenizer.decode(e.generation.token_ids, skip_special_tokens=True) for e in exchanges
                    if PERSONA_START in tokenizer.decode(e.prompt_token_ids)]
    turns_seen = []
    for episode, sample in zip(episodes, samples):
        assert episode.ok and not sample.reward_failed
        served = assistant_exchanges(exchanges, sample)
        assert served and served[0].prompt_token_ids == sample.input_token_ids
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        for turn, exchange in enumerate(served):
            assert exchange.route == "generate"  # verifiers' token route: the prompt ids are the client's
            assert exchange.prompt_token_ids == sample.input_token_ids + ids
            ids += exchange.generation.token_ids
            mask += [True] * len(exchange.generation.token_ids)
            logprobs += exchange.generation.logprobs
            if turn + 1 < len(served):
                # The user's message, as the hand-written ChatML a correct bridge appends: the
                # turn's <|im_end|> unless it was sampled, the user turn, the assistant opener.
                gap = served[turn + 1].prompt_token_ids[len(sample.input_token_ids) + len(ids):]
                closer = "" if exchange.generation.token_ids[-1] == im_end else IM_END
                matches = [reply for reply in user_replies if gap == chatml_ids(
                    tokenizer, f"{closer}\n<|im_start|>user\n{reply.strip()}<|im_end|>\n<|im_start|>assistant\n")]
                assert matches, f"turn {turn}: the observation is not a user-sim reply in ChatML"
                ids += gap
                mask += [False] * len(gap)
        assert sample.output_token_ids == ids
        assert (sample.output_mask or [True] * len(ids)) == mask
        assert sample.sampling_logprobs == logprobs
        assert sample.weight_version == VERSION and sample.token_versions is None
        last_reply = tokenizer.decode(served[-1].generation.token_ids, skip_special_tokens=True)
        assert sample.reward == pytest.approx(expected_reward(last_reply, task_answer(PROMPT_ID)), abs=1e-12)
        turns_seen.append(len(served))
    if name == "single":
        assert turns_seen == [1] * N and all(s.output_mask is None for s in samples)
    else:
        assert all(turns > 1 for turns in turns_seen)
    assert metrics["verifiers/samples"] == N and metrics["verifiers/drifted"] == 0
    assert metrics["verifiers/extra_branches"] == 0 and metrics["verifiers/failed_episodes"] == 0
    assert metrics["verifiers/turns"] == sum(turns_seen)
    assert metrics["verifiers/sampled_tokens"] == sum(s.num_sampled_tokens for s in samples)


@pytest.mark.system
def test_rewards_vary_across_the_run(runs: dict) -> None:
    """The recomputed rewards are not all one value: the comparison above can fail."""
    rewards = {s.reward for name in runs for s in runs[name][1]}
    assert len(rewards) > 1


@pytest.mark.system
def test_spans_the_endpoint_did_not_serve_are_refused_as_drifted(runs: dict, model_dir: Path) -> None:
    episodes, samples, _, _ = runs["multi"]
    empty = Endpoint(EndpointConfig(), load_tokenizer(model_dir), MixedBackend(load_tokenizer(model_dir)))
    stats = VerifiersEnvStats()
    prompt = Sample(input_token_ids=[1], gt_answer="", prompt_id=PROMPT_ID)
    refused = sample_from_episode(prompt, episodes[0], empty, stats)
    assert refused.reward_failed and refused.reward == 0.0
    assert refused.reward_failure_reasons == ["verifiers/drifted"]
    assert refused.output_token_ids == samples[0].output_token_ids  # counted, not dropped: the batcher sees it
    assert stats.drifted == 1 and stats.samples == 1


def test_the_config_names_the_source_and_checks_it_in_one_line() -> None:
    assert VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith").check() == "SingleAgentEnv"
    assert VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith", env="user-sim").check() == "UserSimEnv"
    resolved = VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith", env="user-sim", max_turns=2,
                                  options={"user": {"max_turns": 3}}).resolve()
    assert resolved.user.max_turns == 3 and resolved.assistant.max_turns == 2  # options win over the defaults
    assert resolved.assistant.harness.id == "null" and resolved.assistant.runtime.type == "subprocess"
    for bad, words in ((dict(taskset="no_such_taskset"), "cannot import"),
                       (dict(taskset="async_grpo.demo_assets.verifiers_arith", env="no-such-env"), "cannot import"),
                       (dict(taskset="sampling"), "__all__")):
        with pytest.raises(ValueError, match=words) as error:
            VerifiersEnvConfig(**bad).check()
        assert "\n" not in str(error.value)
    for bad, field in ((dict(env="user-sim"), "needs a taskset"), (dict(taskset="x", max_turns=0), "max_turns"),
                       (dict(taskset="x", options="[1"), "options"), (dict(taskset="x", max_total_tokens=0),
                                                                       "max_total_tokens")):
        with pytest.raises(ValueError, match=field):
            VerifiersEnvConfig(**bad)
    with pytest.raises(ValueError, match="one of them"):
        SamplingConfig(verifiers=VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith"),
                       environment=EnvironmentConfig(name="async_grpo.rollouts.tool_environment:ToolEnvironment"))
