"""The prompt record: each format's field names, format detection, and the gold answer a record holds.

Pure (no tokenizer, no file reading): dataset.py reads the files and turns records into Samples.
The formats and their fields are described in dataset.py's module docstring; here:

    detect_format({"question": "...", "answer": "... #### 72"})   -> "gsm8k"
    extract_gsm8k_answer("48+24 = 72\\n#### 1,000")                  -> "1000"
    extract_boxed_answer("It is $\\boxed{\\frac{1}{2}}$.")         -> "\\frac{1}{2}"
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

TOKEN_IDS_FIELD = "input_token_ids"
GROUPING_FIELDS = ("group_id", "run_id")
"""Optional record fields in every format: advantages normalise within each (group_id, run_id)
pair of a step; group_id defaults to the record's prompt_id, run_id to 0 (algorithm.py)."""
PROMPT_TEXT_FIELD = "prompt"
ANSWER_FIELD = "gt_answer"
DataFormat = Literal["auto", "generic", "gsm8k", "math", "verl", "reasoning_gym"]
MissingAnswerPolicy = Literal["error", "skip"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
MISSING_ANSWER_POLICIES: tuple[str, ...] = get_args(MissingAnswerPolicy)
# (prompt field, answer field) of each format, before data.prompt_field / data.answer_field.
FORMAT_FIELDS: dict[str, tuple[str, str]] = {
    "generic": (PROMPT_TEXT_FIELD, ANSWER_FIELD),
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
    "verl": ("prompt", "reward_model"),
    "reasoning_gym": ("question", "answer"),
}
# verl's layout: the gold answer under reward_model.ground_truth, the source dataset's name
# (which picks the reward function) under data_source.
VERL_GROUND_TRUTH = "ground_truth"
VERL_DATA_SOURCE = "data_source"
# verl's record fields besides the prompt and reward_model: kept in Sample.record for reward
# functions, not counted as ignored.
_VERL_EXTRA_FIELDS = ("data_source", "ability", "extra_info")
# GSM8K writes the final answer after this marker on the solution's last line.
GSM8K_ANSWER_MARKER = "####"
# The last of these LaTeX commands, followed by a braced argument, holds a MATH solution's answer;
# (?![A-Za-z]) keeps \boxedsymbol-like macros out, \s* admits "\boxed {..}".
_BOXED_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
# Characters of a bad line quoted in an error: enough to recognise it, never a megabyte.
_QUOTE_CHARS = 80


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line/row and the problem."""


def clip(text: str) -> str:
    """A text cut to what an error message quotes: enough to recognise it, never a megabyte."""
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "..."


def quote(text: str) -> str:
    """clip(text) as a Python literal, for an error message."""
    return repr(clip(text))


def quote_tail(text: str) -> str:
    """The end of a long text, where a solution's final answer sits."""
    return repr(text if len(text) <= _QUOTE_CHARS else "..." + text[-_QUOTE_CHARS:])


def extract_gsm8k_answer(solution: str) -> str | None:
    """The final answer of a GSM8K solution: the text after its last `####`, with commas and
    whitespace removed ("#### 1,000" -> "1000"), as GSM8K's own grader does; None if there is no
    marker or nothing after it."""
    marker = solution.rfind(GSM8K_ANSWER_MARKER)
    if marker < 0:
        return None
    answer = re.sub(r"[\s,]", "", solution[marker + len(GSM8K_ANSWER_MARKER):])
    return answer or None


def _braced_argument(text: str, start: int) -> str | None:
    """Contents of the brace group opening at text[start] ("{"), nested groups included; None if
    it never closes. A backslash escapes the next character, so \\{ and \\} do not count."""
    depth = 0
    position = start
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : position]
        position += 1
    return None


def extract_boxed_answer(solution: str) -> str | None:
    """The final answer of a MATH solution: the contents of its last `\\boxed{...}` or
    `\\fbox{...}` (whitespace before the brace allowed, nested braces kept, outer whitespace
    stripped); None if there is none, or the last one has no complete braced argument or an empty one."""
    matches = list(_BOXED_COMMAND.finditer(solution))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(solution) or solution[start] != "{":
        return None
    argument = _braced_argument(solution, start)
    if argument is None or not argument.strip():
        return None
    return argument.strip()


@dataclass(frozen=True, slots=True)
class RecordSchema:
    """A concrete format and the two fields it reads."""

    format: str
    prompt_field: str
    answer_field: str

    @property
    def known_fields(self) -> frozenset[str]:
        extra = (TOKEN_IDS_FIELD,) if self.format == "generic" else _VERL_EXTRA_FIELDS if self.format == "verl" else ()
        return frozenset((self.prompt_field, self.answer_field, *GROUPING_FIELDS, *extra))


def detect_format(record: dict[str, Any]) -> str:
    """The format a record's fields match; raises ValueError if none or several do."""
    matches = [
        name for name, present in (
            ("generic", isinstance(record.get(PROMPT_TEXT_FIELD), str) or TOKEN_IDS_FIELD in record),
            ("verl", isinstance(record.get(PROMPT_TEXT_FIELD), list) and "reward_model" in record),
            ("gsm8k", {"question", "answer"} <= record.keys()),
            ("math", {"problem", "solution"} <= record.keys()),
        ) if present
    ]
    if not matches and (ANSWER_FIELD in record or PROMPT_TEXT_FIELD in record):
        matches = ["generic"]  # so that the missing prompt field is reported as such
    if len(matches) == 1:
        return matches[0]
    found = "fits several formats (" + ", ".join(matches) + ")" if matches else "fits no format"
    raise ValueError(
        f"cannot detect data.format: the first record's fields {sorted(record)} {found}; expected "
        f"{PROMPT_TEXT_FIELD!r} or {TOKEN_IDS_FIELD!r} with {ANSWER_FIELD!r} (generic), 'question' + 'answer' "
        "(gsm8k), 'problem' + 'solution' (math) or 'prompt' (chat messages) + 'reward_model' (verl); set data.format, and data.prompt_field / data.answer_field "
        "for renamed fields"
    )


def string_field(record: dict[str, Any], name: str) -> str:
    if name not in record:
        raise ValueError(f"missing field {name!r}")
    value = record[name]
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__} {clip(repr(value))}")
    if not value.strip():
        raise ValueError(f"field {name!r} is empty")
    return value


def gold_answer(record: dict[str, Any], schema: RecordSchema) -> str | None:
    """The record's gold answer read the schema's way; None if a gsm8k/math solution has none."""
    if schema.format == "verl":
        return _verl_ground_truth(record, schema.answer_field)
    text = string_field(record, schema.answer_field)
    if schema.format == "gsm8k":
        return extract_gsm8k_answer(text)
    if schema.format == "math":
        return extract_boxed_answer(text)
    return text


def _verl_ground_truth(record: dict[str, Any], field_name: str) -> str:
    """reward_model.ground_truth as text: a string verbatim, anything else (code tests, a list of
    accepted answers) as its JSON text, which reward functions can parse back."""
    holder = record.get(field_name)
    if not isinstance(holder, dict) or VERL_GROUND_TRUTH not in holder:
        raise ValueError(f"field {field_name!r} must be an object with a {VERL_GROUND_TRUTH!r} "
                         f"(verl format), got {clip(repr(holder))}")
    truth = holder[VERL_GROUND_TRUTH]
    text = truth if isinstance(truth, str) else json.dumps(truth)
    if not text.strip():
        raise ValueError(f"field {field_name}.{VERL_GROUND_TRUTH} is empty")
    return text


def chat_messages(value: Any, field_name: str) -> list[dict[str, str]]:
    """A verl prompt: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field_name!r} must be a non-empty list of chat messages (verl format), "
                         f"got {clip(repr(value))}")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{field_name}[{i}] must be {{'role': str, 'content': str}}, got {clip(repr(message))}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def no_answer_problem(schema: RecordSchema, solution: str) -> str:
    if schema.format == "gsm8k":
        where = f"no final answer after a {GSM8K_ANSWER_MARKER!r} marker (gsm8k format)"
    else:
        where = "no final answer in a \\boxed{...} or \\fbox{...} with balanced braces (math format)"
    return (f"field {schema.answer_field!r} has {where}: {quote_tail(solution)}; "
            "data.missing_answer: skip leaves such records out, counted")
