"""A tool-use environment: the model calls a calculator or runs Python, then gives a final answer.

    environment: {name: "async_grpo.rollouts.tool_environment:ToolEnvironment", max_turns: 4, max_total_tokens: 1024,
                  options: {tools: ["calculator", "python"]}}

Tool calls use Qwen's format (its chat template's tool-use section), anywhere in the model's turn:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

Each call's answer comes back as one `tool` message (format "chat", rendered with the model's chat
template after a system prompt listing the tools), or with format "text" (for a model without a
chat template, e.g. the tool demo's char model: scripts/demo_tools.sh) as the text
`<tool_response>ANSWER</tool_response>` appended after the turn, the dataset's prompt kept as it is.
`tools: []` refuses every call ("no tools are available here"): the same task without the tool,
the demo's baseline.

A turn with no call is the final answer, scored 1.0 when its answer (the last \\boxed{...}, else the last number) equals the record's gold
answer as a number, else 0.0; the rollout ends there. A malformed call (no closing tag, bad JSON,
an unknown tool, wrong arguments) is answered with a tool message saying what is wrong, never an
exception: the model learns from it like from any other observation.

The tools:
- calculator: arithmetic on numbers (+ - * / // % **, parentheses), evaluated by walking Python's
  AST over an allow-list of node types: no names, calls or attributes, so no code runs; exponents
  and the size of intermediate results are bounded so that `9**9**9` is refused, not computed.
- python: the code runs in sandbox.run_python (no network; CPU, memory, process, file-size and
  output limits; a wall deadline; its own temporary directory), and its stdout comes back, cut at
  `max_output_chars`. Infinite loops, floods of output, sockets and writes outside the directory
  end as an observation saying so.

step() is a plain function: the rollout loop runs it in a worker thread, so a tool that takes its
whole deadline never stalls the engine's event loop.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from async_grpo.rewards.sandbox import SandboxConfig, run_python
from async_grpo.rollouts.environments import TOOL_ROLE, EnvPrompt, Message, Reset, StepResult, Turn

logger = logging.getLogger(__name__)

TOOL_NAMES = ("calculator", "python")
FORMATS = ("chat", "text")
# Qwen's chat template wraps a tool message in these; the text format writes them itself.
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN_TAG = "<tool_call>"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Calculator bounds: an expression longer than this is refused before parsing (ast recursion).
_MAX_EXPRESSION_CHARS = 200
# |exponent| above this is refused: 10**1000 is already a 1000-digit number.
_MAX_EXPONENT = 1000
# Results (and intermediates) with more digits than this are refused: keeps big-int work small.
_MAX_RESULT_DIGITS = 1000
# Where the question lives in a record when question_field is "": the dataset formats' fields.
_QUESTION_FIELDS = ("question", "prompt", "problem")

_TOOL_SCHEMAS = {
    "calculator": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                   "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                  "required": ["expression"]}},
    "python": {"name": "python", "description": "Run a Python program; returns what it prints.",
               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
}
_INSTRUCTIONS = (
    "You may call these tools:\n<tools>\n{schemas}\n</tools>\n"
    "To call one, write <tool_call>{{\"name\": <tool>, \"arguments\": {{...}}}}</tool_call>. "
    "When you know the answer, write it as \\boxed{{answer}} without a tool call."
)


class ToolCallError(ValueError):
    """A call the model wrote that cannot run; its message becomes the observation."""


# ---------------------------------------------------------------------------------------------
# The calculator
# ---------------------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolCallError("calculator: the result is not a finite number")
    if isinstance(value, int) and abs(value) >= 10 ** _MAX_RESULT_DIGITS:
        raise ToolCallError(f"calculator: the result has more than {_MAX_RESULT_DIGITS} digits")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolCallError(f"calculator: exponents above {_MAX_EXPONENT} are not supported")
        if isinstance(node.op, ast.Pow) and left != 0 and abs(right) * math.log10(max(abs(left), 1)) > _MAX_RESULT_DIGITS:
            raise ToolCallError(f"calculator: the result has more than {_MAX_RESULT_DIGITS} digits")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolCallError("calculator: division by zero") from None
        except OverflowError:
            raise ToolCallError("calculator: the result is too large") from None
    raise ToolCallError(f"calculator: only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text; ToolCallError says why not."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolCallError("calculator: 'expression' must be a non-empty string")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ToolCallError(f"calculator: the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolCallError(f"calculator: cannot parse {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Tool calls in the model's text
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One parsed call, or the reason it could not be parsed."""

    name: str
    arguments: dict[str, Any]
    error: str = ""
    """Non-empty: the call is malformed and this says why."""


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as a model writes it in Qwen's format (compact JSON, no newlines inside the tags)."""
    return f"{_OPEN_TAG}{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


def tool_response_text(answer: str) -> str:
    """A tool's answer as format "text" appends it after the model's turn."""
    return f"{_RESPONSE_OPEN}{answer}{_RESPONSE_CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>{json}</tool_call> in `text`, in order; malformed ones carry an error."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        calls.append(_parse_call(body))
    if text.count(_OPEN_TAG) > len(calls):
        calls.append(ToolCall(name="", arguments={}, error="a <tool_call> has no closing </tool_call>"))
    return calls


def _parse_call(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(name="", arguments={}, error=f"the tool call is not valid JSON ({exc.msg})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(name="", arguments={}, error='the tool call needs {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(name=payload["name"], arguments={}, error="the tool call's arguments must be an object")
    return ToolCall(name=payload["name"], arguments=arguments)


def final_answer_matches(text: str, gt_answer: str) -> bool:
    """The last \\boxed{...} (else the last number) of text equals gt_answer as a number."""
    boxed = _BOXED.findall(text)
    candidates = _NUMBER.findall(boxed[-1] if boxed else text)
    if not candidates:
        return False
    try:
        return math.isclose(float(candidates[-1]), float(gt_answer.replace(",", "")), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------


class ToolEnvironment:
    """Calculator and Python tools over a question from the prompt record (one instance per rollout)."""

    def __init__(self, tools: list[str] | tuple[str, ...] = TOOL_NAMES, question_field: str = "",
                 python_timeout_s: float = 5.0, python_memory_bytes: int = 256 * 1024 * 1024,
                 max_output_chars: int = 2000, max_calls_per_turn: int = 4, format: str = "chat") -> None:
        unknown = sorted(set(tools) - set(TOOL_NAMES))
        if unknown:
            raise ValueError(f"ToolEnvironment.tools must be a subset of {list(TOOL_NAMES)}, got {list(tools)}")
        if max_output_chars < 1 or max_calls_per_turn < 1:
            raise ValueError("ToolEnvironment.max_output_chars and max_calls_per_turn must be >= 1")
        if format not in FORMATS:
            raise ValueError(f"ToolEnvironment.format must be one of {list(FORMATS)}, got {format!r}")
        self.tools = tuple(tools)
        self.format = format
        self.question_field = question_field
        self.max_output_chars = max_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        cpu_s = max(1, math.ceil(python_timeout_s))
        self.sandbox = SandboxConfig(timeout_s=python_timeout_s, cpu_time_s=cpu_s, memory_bytes=python_memory_bytes,
                                     max_output_bytes=4 * max_output_chars)
        self.gt_answer = ""

    def system_prompt(self) -> str:
        schemas = "\n".join(json.dumps(_TOOL_SCHEMAS[name]) for name in self.tools)
        return _INSTRUCTIONS.format(schemas=schemas)

    def reset(self, prompt: EnvPrompt) -> Reset:
        self.gt_answer = prompt.gt_answer
        if self.format == "text":
            return Reset()  # the dataset's prompt tokens as they are
        question = self._question(prompt.record or {})
        return Reset(messages=[{"role": "system", "content": self.system_prompt()},
                               {"role": "user", "content": question}])

    def _question(self, record: dict[str, Any]) -> str:
        fields = (self.question_field,) if self.question_field else _QUESTION_FIELDS
        for name in fields:
            if isinstance(record.get(name), str):
                return record[name]
        raise ValueError(f"ToolEnvironment: the prompt record has none of the fields {list(fields)} "
                         f"(set options.question_field); it has {sorted(record)}")

    def step(self, turn: Turn) -> StepResult:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return StepResult(reward=1.0 if final_answer_matches(turn.text, self.gt_answer) else 0.0, done=True)
        answers = [self._answer(call) for call in calls[: self.max_calls_per_turn]]
        if len(calls) > self.max_calls_per_turn:
            answers.append(f"error: at most {self.max_calls_per_turn} tool calls per turn; the rest were not run")
        if self.format == "text":
            return StepResult(text="".join(tool_response_text(a) for a in answers))
        return StepResult(messages=[_tool_message(a) for a in answers])

    def _answer(self, call: ToolCall) -> str:
        if call.error:
            return f"error: {call.error}"
        try:
            if not self.tools:
                raise ToolCallError("no tools are available here; answer without one")
            if call.name not in self.tools:
                raise ToolCallError(f"unknown tool {call.name!r}; the tools are {list(self.tools)}")
            if call.name == "calculator":
                return calculate(_argument(call, "expression"))
            return self._run_python(_argument(call, "code"))
        except ToolCallError as exc:
            return f"error: {exc}"

    def _run_python(self, code: str) -> str:
        result = run_python(code, config=self.sandbox)
        output = result.stdout if result.outcome == "ok" else f"{result.stdout}{result.stderr}"
        output = output[: self.max_output_chars]
        if result.outcome != "ok":
            logger.debug("python tool ended with %s after %.2f s", result.outcome, result.wall_s)
            return f"{output}\n[{result.outcome}]" if output else f"[{result.outcome}]"
        return output


def _argument(call: ToolCall, name: str) -> str:
    value = call.arguments.get(name)
    if not isinstance(value, str):
        raise ToolCallError(f"{call.name} needs a string argument {name!r}")
    return value


def _tool_message(content: str) -> Message:
    return {"role": TOOL_ROLE, "content": content}
