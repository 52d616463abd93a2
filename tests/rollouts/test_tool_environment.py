"""The tool environment: the calculator, Qwen-format tool calls, and hostile Python contained.

    .venv/bin/python -m pytest tests/rollouts/test_tool_environment.py -q
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from async_grpo.rollouts.environments import EnvPrompt, Reset, Turn
from async_grpo.rollouts.tool_environment import (
    ToolCallError, ToolEnvironment, calculate, final_answer_matches, parse_tool_calls, tool_call_text,
)


@pytest.mark.parametrize(("expression", "value"), [
    ("123 + 456", "579"), ("2 * (3 + 4)", "14"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-3 ** 2", "-9"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("2 ** 10", "1024"), ("98765432101234 * 3", "296296296303702"),
])
def test_calculator_computes_arithmetic(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os').system('id')", "not Call"),
    ("open('/etc/passwd').read()", "not Call"),
    ("x + 1", "not Name"),
    ("(1).__class__", "not Attribute"),
    ("9 ** 9 ** 9", "exponents above"),
    ("10 ** 999 * 10 ** 999", "more than 1000 digits"),
    ("1 / 0", "division by zero"),
    ("1e308 * 10", "not a finite number"),
    ("1" * 201, "longer than 200"),
    ("2 +", "cannot parse"),
    ("'a' * 3", "not Constant"),
    ("True + 1", "not Constant"),
])
def test_calculator_refuses_everything_but_bounded_arithmetic(expression: str, reason: str) -> None:
    with pytest.raises(ToolCallError, match=reason):
        calculate(expression)


def test_tool_calls_are_parsed_in_qwens_format_and_malformed_ones_say_why() -> None:
    text = ('First <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call> then '
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call> and <tool_call>{bad json</tool_call>'
            ' and <tool_call>{"arguments": {}}</tool_call> and <tool_call>{"name": "python"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error[:20]) for c in calls] == [
        ("calculator", {"expression": "1+1"}, ""),
        ("calculator", {}, "the tool call's argu"),
        ("", {}, "the tool call is not"),
        ("", {}, 'the tool call needs '),
        ("", {}, "a <tool_call> has no"),
    ]
    assert parse_tool_calls("no calls here") == []


def test_final_answers_match_as_numbers() -> None:
    assert final_answer_matches("so \\boxed{579}", "579")
    assert final_answer_matches("the sum is 1,000 or rather 1000", "1,000")
    assert not final_answer_matches("\\boxed{578} though 579", "579")
    assert not final_answer_matches("no number", "579")


def _env(**options) -> ToolEnvironment:
    env = ToolEnvironment(**options)
    env.reset(EnvPrompt(record={"question": "What is 2 + 2?"}, gt_answer="4", prompt_token_ids=[1]))
    return env


def _turn(text: str) -> Turn:
    return Turn(index=0, token_ids=[1], text=text, finish_reason="stop")


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_step_answers_each_call_and_scores_the_final_answer() -> None:
    env = _env(tools=["calculator"], max_calls_per_turn=2)
    result = env.step(_turn(_call("calculator", expression="2+2") + _call("python", code="print(1)")
                            + _call("calculator", expression="3")))
    assert [m["content"] for m in result.messages] == [
        "4", "error: unknown tool 'python'; the tools are ['calculator']",
        "error: at most 2 tool calls per turn; the rest were not run"]
    assert {m["role"] for m in result.messages} == {"tool"} and not result.done and result.reward == 0.0
    assert env.step(_turn(_call("calculator", expr="2"))).messages[0]["content"] == (
        "error: calculator needs a string argument 'expression'")
    final = env.step(_turn("The answer is \\boxed{4}."))
    assert final.done and final.reward == 1.0 and final.messages is None
    assert env.step(_turn("\\boxed{5}")).reward == 0.0


def test_text_format_keeps_the_prompt_and_answers_in_tool_response_tags() -> None:
    env = ToolEnvironment(tools=["calculator"], format="text")
    assert env.reset(EnvPrompt(record={"prompt": "2+2="}, gt_answer="4", prompt_token_ids=[7, 8])) == Reset()
    result = env.step(_turn('<tool_call>{"name":"calculator","arguments":{"expression":"347+285"}}</tool_call>'))
    assert result.text == "<tool_response>632</tool_response>" and result.messages is None and not result.done
    assert tool_call_text("calculator", {"expression": "347+285"}) == (
        '<tool_call>{"name":"calculator","arguments":{"expression":"347+285"}}</tool_call>')
    assert parse_tool_calls(tool_call_text("python", {"code": "print(1)"}))[0].arguments == {"code": "print(1)"}
    assert env.step(_turn("4")).reward == 1.0


def test_no_tools_refuses_every_call_and_still_scores_the_answer() -> None:
    env = _env(tools=[])
    (message,) = env.step(_turn(_call("calculator", expression="2+2"))).messages
    assert message["content"] == "error: no tools are available here; answer without one"
    assert env.step(_turn("\\boxed{4}")).reward == 1.0
    with pytest.raises(ValueError, match="format must be one of"):
        ToolEnvironment(format="xml")
    with pytest.raises(ValueError, match="subset of"):
        ToolEnvironment(tools=["shell"])


def test_reset_needs_the_question_field() -> None:
    env = ToolEnvironment(question_field="task")
    with pytest.raises(ValueError, match=r"none of the fields \['task'\]"):
        env.reset(EnvPrompt(record={"question": "q"}, gt_answer="", prompt_token_ids=[1]))
    reset = env.reset(EnvPrompt(record={"task": "q"}, gt_answer="", prompt_token_ids=[1]))
    assert reset.messages[1] == {"role": "user", "content": "q"} and "<tools>" in reset.messages[0]["content"]


# ---------------------------------------------------------------------------------------------
# Hostile Python: each runs in the sandbox and comes back as an observation
# ---------------------------------------------------------------------------------------------

PYTHON_TIMEOUT_S = 2.0


def _python(code: str, **options) -> str:
    env = _env(tools=["python"], python_timeout_s=PYTHON_TIMEOUT_S, **options)
    (message,) = env.step(_turn(_call("python", code=code))).messages
    return message["content"]


@pytest.mark.system
def test_python_runs_and_returns_stdout() -> None:
    assert _python("print(sum(range(10)))") == "45\n"
    assert "ZeroDivisionError" in _python("1 / 0") and _python("1 / 0").endswith("[error]")


@pytest.mark.system
def test_an_infinite_loop_ends_at_its_deadline() -> None:
    """Killed at the wall deadline (or at its CPU limit, which the deadline sets: both end it)."""
    answer = _python("while True: pass")
    assert answer in ("[timeout]", "[cpu_limit]"), answer


@pytest.mark.system
def test_a_flood_of_output_is_cut() -> None:
    answer = _python("while True: print('x' * 1000)", max_output_chars=500)
    assert answer.endswith("[output_limit]")
    assert len(answer) <= 500 + len("\n[output_limit]")


@pytest.mark.system
def test_sockets_fail() -> None:
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    answer = _python(code)
    assert "connected" not in answer.replace("not connected", "") and answer.endswith("[error]")


@pytest.mark.system
def test_writes_outside_its_directory_fail(tmp_path: Path) -> None:
    target = Path("/tmp") / f"tool-env-escape-{uuid.uuid4().hex}"
    answer = _python(f"open({str(target)!r}, 'w').write('escaped')\nprint('wrote')")
    assert "PermissionError" in answer and answer.endswith("[error]")
    assert not target.exists()
    assert _python("open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())") == "ok\n"
