"""Code-execution reward: run the completion's program against the prompt record's test cases in
the sandbox (sandbox.py); the reward is the fraction of tests passed.

    --sampling.reward.functions async_grpo.rewards.code_reward:run_tests --sampling.reward.function_timeout_s 20

The prompt record carries the tests as stdin/stdout pairs, a list or its JSON text:

    {"prompt": "Read n, print n squared.", "gt_answer": "",
     "tests": [{"input": "3\\n", "output": "9\\n"}, {"input": "12\\n", "output": "144\\n"}]}

The program is the last ```python (or plain ```) fenced block of the completion, else the whole
completion. A test passes when the program exits 0 and its stdout equals the expected output up
to trailing whitespace on each line and trailing blank lines. Each test is one sandboxed run
under SandboxConfig's limits (`timeout_s` per test, `sandbox_timeout_s` in the record overrides
it); the reward function's own deadline (function_timeout_s) must cover every test of a prompt,
or a slow program loses all its tests at once. Returns {"pass_rate": passed / total, "solved":
every test passed}: `reward/run_tests/pass_rate` is logged, and accuracy counts fully solved prompts.

Imports no Ray, vLLM or torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any, Mapping, Sequence

from async_grpo.rewards.sandbox import SandboxConfig, run_python

TESTS_FIELD = "tests"
TIMEOUT_FIELD = "sandbox_timeout_s"
# The last fenced code block: ```python ...```, ```py ...``` or ``` ...```.
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
# Per-test limits: contest-style programs run in milliseconds; these bound a hostile one.
DEFAULT_SANDBOX = SandboxConfig(timeout_s=2.0, cpu_time_s=2, memory_bytes=512 * 1024 * 1024, max_processes=8,
                                max_output_bytes=256 * 1024)


def extract_program(completion: str) -> str:
    """The last fenced code block's content, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def normalize_output(text: str) -> str:
    """Output compared with trailing whitespace of each line and trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def load_tests(prompt: Mapping[str, Any]) -> list[dict[str, str]]:
    """The record's test cases as [{"input", "output"}]; ValueError when they are missing or malformed."""
    tests = prompt.get(TESTS_FIELD)
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"prompt record needs a non-empty {TESTS_FIELD!r} list of {{input, output}}")
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("input", ""), str) or not isinstance(
                test.get("output"), str):
            raise ValueError(f"{TESTS_FIELD}[{i}] must be {{'input': str, 'output': str}}, got {test!r}")
    return tests


def passes(program: str, test: Mapping[str, str], config: SandboxConfig) -> bool:
    """Whether one sandboxed run of `program` on the test's input prints the expected output."""
    result = run_python(program, stdin=test.get("input", ""), config=config)
    return result.outcome == "ok" and normalize_output(result.stdout) == normalize_output(test["output"])


def run_tests(prompt: Mapping[str, Any], completion: str, token_ids: Sequence[int],
              metadata: Mapping[str, Any]) -> dict[str, float]:
    """Reward function: the fraction of the record's tests the completion's program passes."""
    tests = load_tests(prompt)
    config = DEFAULT_SANDBOX
    if prompt.get(TIMEOUT_FIELD) is not None:
        config = replace(DEFAULT_SANDBOX, timeout_s=float(prompt[TIMEOUT_FIELD]))
    program = extract_program(completion)
    passed = sum(passes(program, test, config) for test in tests)
    return {"pass_rate": passed / len(tests), "solved": float(passed == len(tests))}
