"""code_reward.run_tests: fraction of stdin/stdout tests passed by the completion's program, run in
the sandbox, through the verifier pool like any reward function; hostile programs score 0 in
bounded time and leave the pool serving."""

from __future__ import annotations

import json
import time

import pytest

from async_grpo.rewards import code_reward
from async_grpo.rewards.math_verify_pool import VerifierPool

SQUARE_TESTS = [{"input": "3\n", "output": "9\n"}, {"input": "12\n", "output": "144\n"},
                {"input": "-2\n", "output": "4"}]
# Queueing and process restarts on a busy 2-core machine; a stalled pool never finishes.
SLACK_S = 30.0


def _call(completion: str, tests=SQUARE_TESTS) -> dict:
    return {"prompt": {"gt_answer": "", "tests": tests}, "completion": completion, "token_ids": [],
            "metadata": {"prompt_id": 0}}


def _fenced(program: str) -> str:
    return f"Here is my solution:\n```python\n{program}\n```\nIt squares n."


def test_extract_program_takes_the_last_fenced_block():
    assert code_reward.extract_program("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"
    assert code_reward.extract_program("print(1)") == "print(1)"


@pytest.mark.system
def test_reward_is_the_fraction_of_tests_passed():
    right = code_reward.run_tests(**_call(_fenced("n = int(input())\nprint(n * n)")))
    assert right == {"pass_rate": 1.0, "solved": 1.0}
    # abs() missing: wrong on the negative input only -> 2 of 3.
    partial = code_reward.run_tests(**_call(_fenced("n = int(input())\nprint(n * n if n > 0 else n)")))
    assert partial["pass_rate"] == pytest.approx(2 / 3) and partial["solved"] == 0.0
    crashing = code_reward.run_tests(**_call(_fenced("raise SystemExit(1)")))
    assert crashing["pass_rate"] == 0.0


@pytest.mark.system
def test_tests_may_come_as_json_text_and_must_exist():
    assert code_reward.run_tests(**_call("print(int(input())**2)", tests=json.dumps(SQUARE_TESTS)))["solved"] == 1.0
    with pytest.raises(ValueError, match="non-empty 'tests'"):
        code_reward.run_tests(**_call("print(1)", tests=[]))


@pytest.mark.system
def test_through_the_pool_hostile_programs_score_zero_in_bounded_time():
    programs = ["n = int(input())\nprint(n * n)", "while True:\n    pass",
                "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                "import sys\nsys.stdout.write('x' * 100_000_000)", "x = bytearray(8 * 1024 ** 3)",
                "import socket\nsocket.create_connection(('127.0.0.1', 22))"]
    one_test = [SQUARE_TESTS[0]]
    deadline = 2 * code_reward.DEFAULT_SANDBOX.timeout_s + 5
    with VerifierPool(num_processes=2, timeout_s=deadline) as pool:
        start = time.monotonic()
        scores = pool.score_function_sync("async_grpo.rewards.code_reward:run_tests", [_call(_fenced(p), one_test) for p in programs])
        elapsed = time.monotonic() - start
        assert [(s.reward, s.solved, s.failed) for s in scores] == [(1.0, True, False)] + [(0.0, False, False)] * 5
        assert elapsed < len(programs) * deadline + SLACK_S
        assert pool.score_sync(["\\boxed{7}"], "7")[0].reward == 1.0
