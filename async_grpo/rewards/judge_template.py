"""The judge's messages and how its reply becomes a score: prompt builders and verdict rules.

Per-sample mode sends one chat per answer; group-wise mode one chat per group, showing the answers
numbered from 1 (JudgeConfig.answer_format, by default "Answer 1:", "Answer 2:", ...). The verdict
rules (JudgeConfig.verdict), each giving a score in [0, 1]:

    number  the reply's first number (e.g. "-2", "7", "7.5"); it must lie in [low, high]
            and scores (x - low) / (high - low). No number, or one out of range: unparsable.
    yes_no  the reply's first standalone "yes" or "no", any case: 1.0 or 0.0. Neither: unparsable.
    tags    the number inside the reply's last <score>...</score> (only the number and spaces
            inside); in [low, high], scaled as for number. Else unparsable.

A judge that reasons before its verdict trips the number rule on the numbers of its reasoning; the
tags rule is for such judges (the last tag decides, so a reply may quote the format first).

Group-wise replies are read line by line: a line "K: <verdict>" (also "K." or "K)", "Answer K:",
"#K:", markdown asterisks ignored) gives answer K's verdict, read from the rest of the line by the
rule. A line whose rest does not parse, or whose K is not an answer's number, is passed over (it
is reasoning); when K has several, the last one counts (the verdict list comes last). Every answer
1..n needs one, else the whole group's reply is unparsable: a partial reply scores nobody.

Pure: no Ray, no vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from async_grpo.config.judge_config import DEFAULT_ANSWER_FORMAT, PLACEHOLDER, JudgeConfig, JudgeTemplate

# A number as judges write it: an optional sign, digits, an optional decimal part.
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_SCORE_TAG = re.compile(r"<score>(.*?)</score>", re.IGNORECASE | re.DOTALL)
# "K: verdict", "K. verdict", "K) verdict", "Answer K: verdict", "#K: verdict" on one line.
# A "." followed by a digit is a decimal point ("7.5 points"), not the end of a label.
_GROUP_LINE = re.compile(r"^\s*(?:answer\s*)?#?(\d+)\s*(?:[:)]|\.(?!\d))\s*(.+?)\s*$", re.IGNORECASE)
# Record fields that hold the question when JudgeConfig.prompt_field is None, in order.
PROMPT_FIELDS = ("prompt", "question", "problem")
# Quoted replies in failure details: enough to recognise the garbage, never a whole essay.
_QUOTE_CHARS = 80


@dataclass(slots=True, frozen=True)
class Verdict:
    """A reply read by a verdict rule: a score in [0, 1], or why there is none."""

    score: float | None
    """The normalised score; None when the reply held no verdict the rule reads."""
    problem: str = ""
    """Why `score` is None, in words ("" when it is set)."""


def prompt_text(record: Mapping[str, Any] | None, field: str | None) -> str:
    """The question the judge is shown: the record's `field`, else its first of PROMPT_FIELDS; a
    chat list as "role: content" lines. ValueError naming the fields when the record has none."""
    record = record or {}
    names = (field,) if field is not None else PROMPT_FIELDS
    for name in names:
        value = record.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(m, dict) for m in value):
            return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value)
    raise ValueError(f"the prompt record has no text in {' or '.join(repr(n) for n in names)} for the judge "
                     f"(JudgeConfig.prompt_field)")


def verdict_format(config: JudgeConfig, num_answers: int | None = None) -> str:
    """What {verdict_format} says: how to write one verdict, or (num_answers given) one line per answer."""
    low, high = _plain(config.low), _plain(config.high)
    one = {"number": f"a single number from {low} to {high}",
           "yes_no": "yes or no",
           "tags": f"your score, a number from {low} to {high}, between <score> and </score>"}[config.verdict]
    if num_answers is None:
        return f"Reply with {one}." if config.verdict != "tags" else f"End your reply with {one}."
    return (f"End your reply with {num_answers} lines, one per answer in order: 'K: <verdict>' for K from 1 to "
            f"{num_answers}, where <verdict> is {one}.")


def fill(template: str, values: Mapping[str, str]) -> str:
    """`template` with each known {name} replaced by values[name], in one pass (a value that itself
    holds "{prompt}" is not filled again); other braces stay as written."""
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def _messages(template: JudgeTemplate, user: str) -> list[dict[str, str]]:
    chat = [{"role": "system", "content": template.system}] if template.system else []
    return chat + [{"role": "user", "content": user}]


def sample_messages(config: JudgeConfig, template: JudgeTemplate, *, prompt: str, completion: str,
                    gt_answer: str) -> list[dict[str, str]]:
    """The chat that judges one answer (per-sample mode)."""
    values = {"prompt": prompt, "completion": completion, "gt_answer": gt_answer,
              "verdict_format": verdict_format(config)}
    return _messages(template, fill(template.user, values))


def numbered_answers(completions: Sequence[str], answer_format: str = DEFAULT_ANSWER_FORMAT, prompt: str = "") -> str:
    """The group's answers as the judge sees them: answer_format filled per answer ({k} from 1,
    {completion}, {prompt}), one blank line apart."""
    return "\n\n".join(fill(answer_format, {"k": str(k), "completion": text, "prompt": prompt})
                       for k, text in enumerate(completions, start=1))


def group_messages(config: JudgeConfig, template: JudgeTemplate, *, prompt: str, completions: Sequence[str],
                   gt_answer: str) -> list[dict[str, str]]:
    """The chat that judges a group's answers together (group-wise mode), numbered from 1."""
    values = {"prompt": prompt, "answers": numbered_answers(completions, config.answer_format, prompt),
              "num_answers": str(len(completions)),
              "gt_answer": gt_answer, "verdict_format": verdict_format(config, len(completions))}
    return _messages(template, fill(template.user, values))


def _plain(value: float) -> str:
    """1.0 as "1", 2.5 as "2.5": how a scale reads in the judge's instructions."""
    return str(int(value)) if float(value).is_integer() else str(value)


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _scaled(number: float, config: JudgeConfig, what: str) -> Verdict:
    if not config.low <= number <= config.high:
        return Verdict(None, f"{what} {_plain(number)} is outside [{_plain(config.low)}, {_plain(config.high)}]")
    return Verdict((number - config.low) / (config.high - config.low))


def parse_verdict(text: str, config: JudgeConfig) -> Verdict:
    """One reply read by config.verdict (the module docstring's rules)."""
    if config.verdict == "number":
        match = _NUMBER.search(text)
        if match is None:
            return Verdict(None, f"no number in {_quote(text)}")
        return _scaled(float(match.group()), config, "the first number")
    if config.verdict == "yes_no":
        match = _YES_NO.search(text)
        if match is None:
            return Verdict(None, f"no yes or no in {_quote(text)}")
        return Verdict(1.0 if match.group(1).lower() == "yes" else 0.0)
    tags = _SCORE_TAG.findall(text)
    if not tags:
        return Verdict(None, f"no <score></score> in {_quote(text)}")
    inside = tags[-1].strip()
    if _NUMBER.fullmatch(inside) is None:
        return Verdict(None, f"the last <score> holds {_quote(inside)}, not a number")
    return _scaled(float(inside), config, "the score")


@dataclass(slots=True, frozen=True)
class GroupVerdict:
    """A group-wise reply read: one score per answer, or why there are none."""

    scores: list[float] | None
    """Answer K's score at index K - 1; None when some answer has no verdict."""
    problem: str = ""
    """Why `scores` is None, in words ("" when they are set)."""


def parse_group_verdict(text: str, num_answers: int, config: JudgeConfig) -> GroupVerdict:
    """A group-wise reply read line by line (the module docstring's rule): all num_answers scores or none."""
    found: dict[int, float] = {}
    for line in text.splitlines():
        match = _GROUP_LINE.match(line.replace("*", ""))
        if match is None:
            continue
        k = int(match.group(1))
        verdict = parse_verdict(match.group(2), config)
        if 1 <= k <= num_answers and verdict.score is not None:
            found[k] = verdict.score
    missing = [k for k in range(1, num_answers + 1) if k not in found]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        return GroupVerdict(None, f"no verdict for answer{'s' if len(missing) > 1 else ''} {shown} of "
                                  f"{num_answers} in {_quote(text)}")
    return GroupVerdict([found[k] for k in range(1, num_answers + 1)])
