"""Reward functions for tests/rewards/test_reward_functions.py: well-behaved ones and hostile ones.
Loaded by `module:function` reference in the verifier pool's processes, like a user's plug-in
(importable by name: pyproject.toml puts tests/plugins on pytest's path, and the pool's processes
inherit it)."""

from __future__ import annotations

import asyncio
import os
import time

from async_grpo.rewards.reward_functions import batched


def exact(prompt, completion, token_ids, metadata):
    return float(completion.strip() == prompt["gt_answer"])


def length_parts(prompt, completion, token_ids, metadata):
    return {"tokens": float(len(token_ids)), "chars": len(completion) / 100, "solved": completion == "ok"}


async def async_exact(prompt, completion, token_ids, metadata):
    await asyncio.sleep(0)
    return completion.strip() == prompt["gt_answer"]


@batched
def batch_rank(prompts, completions, token_ids, metadata):
    return [float(i) for i in range(len(completions))]


@batched
def batch_too_short(prompts, completions, token_ids, metadata):
    return [1.0]


def reads_record(prompt, completion, token_ids, metadata):
    return float(prompt["extra"]["bonus"]) + metadata["prompt_id"]


def raises(prompt, completion, token_ids, metadata):
    raise RuntimeError("boom")


def hangs(prompt, completion, token_ids, metadata):
    time.sleep(3600)


def returns_text(prompt, completion, token_ids, metadata):
    return "1.0"


def returns_nan(prompt, completion, token_ids, metadata):
    return float("nan")


def exits(prompt, completion, token_ids, metadata):
    os._exit(3)


def hostile_by_text(prompt, completion, token_ids, metadata):
    """Misbehaves as the completion says: the benchmark's and tests' 'sometimes hostile' function."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "raise":
        raise ValueError(completion)
    return 1.0


def wrong_arity(prompt, completion):
    return 1.0



def fails_as_told(prompt, completion, token_ids, metadata):
    """Fails in the way the completion names (one per failure reason the pool counts), else 1.0."""
    if completion == "raise":
        raise ValueError(completion)
    if completion == "hang":
        time.sleep(3600)
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "1.0"
    if completion == "exit":
        os._exit(3)
    return 1.0
