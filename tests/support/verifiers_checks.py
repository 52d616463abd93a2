"""What the verifiers-environment tests recompute by hand (tests/rollouts/test_verifiers_env.py
against a recording backend, tests/rollouts/test_verifiers_env_vllm.py on a real engine): the answer
of the task a prompt id picks and verifiers_arith's rubric written again, the endpoint exchanges
that lie on a sample's stream, the ids of a hand-written ChatML observation, and the marker of the
user agent's requests."""

from __future__ import annotations

import functools
import re

from async_grpo.config.rollout_sources import VerifiersEnvConfig
from sample_processing_utils import Sample

PERSONA_START = "You are role-playing a USER"  # UserSimEnv's persona: marks the user agent's requests


def chatml_ids(tokenizer, text: str) -> list[int]:
    """The ids of hand-written ChatML text, as the chat tokenizer encodes it (no special tokens added)."""
    return tokenizer.encode(text, add_special_tokens=False)


@functools.cache
def task_answer(index: int) -> str:
    """The answer of the task a prompt id picks (verifiers_arith's tasks, as the worker lists them)."""
    from verifiers.v1.utils.loaders import load_taskset

    tasks = list(load_taskset(VerifiersEnvConfig(taskset="async_grpo.demo_assets.verifiers_arith").resolve().taskset))
    return tasks[index % len(tasks)].data.answer


def expected_reward(reply: str, answer: str) -> float:
    """verifiers_arith's rubric, written again: 1 if the answer is one of the reply's numbers, plus
    0.5 x the share of the reply's non-blank characters that are digits."""
    correct = 1.0 if answer in re.findall(r"[0-9]+", reply) else 0.0
    visible = "".join(reply.split())
    return correct + 0.5 * (sum(ch.isdigit() and ch.isascii() for ch in visible) / len(visible) if visible else 0.0)


def assistant_exchanges(exchanges: list, sample: Sample) -> list:
    """The exchanges whose prompt lies on this sample's stream, in stream order."""
    stream = sample.input_token_ids + sample.output_token_ids
    on_stream = [e for e in exchanges if stream[:len(e.prompt_token_ids)] == e.prompt_token_ids
                 and stream[len(e.prompt_token_ids):len(e.prompt_token_ids) + len(e.generation.token_ids)]
                 == e.generation.token_ids]
    return sorted(on_stream, key=lambda e: len(e.prompt_token_ids))
