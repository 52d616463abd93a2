"""A model judge as a reward: `JudgeConfig` (template, verdict rule, scale, mode, deadline, retries)
and the template it resolves to.

A run names the judge among its reward functions by the reserved name `judge` (JUDGE_FUNCTION),
weighted like any other part, and configures it under `sampling.reward.judge`:

    sampling:
      reward:
        functions: [judge, async_grpo.rewards.code_reward:run_tests]
        weights: [0.5, 0.5]
        judge: {verdict: tags, low: 1, high: 10, template_path: rubric.yaml}

The template is a chat of two messages: `system` (the rubric) and `user` (what is judged), inline
or from a YAML/JSON file with those keys. The user message names what it shows by placeholders,
replaced in one pass (other braces are left as they are, so a rubric may quote JSON):

    {prompt}          the question, from the prompt record (JudgeConfig.prompt_field)
    {completion}      the answer judged (per-sample mode; required there)
    {answers}         every answer of the group, each written by answer_format ("Answer 1:\n..."),
                      blank lines between them (group-wise; required there)
    {num_answers}     how many answers the group shows (group-wise)
    {gt_answer}       the record's gold answer
    {verdict_format}  how to write the verdict, from the verdict rule (judge_template.verdict_format)

How a reply becomes a score (the verdict rules) is rewards/judge_template.py's; the judge's calls
are rewards/judge_reward.py's. Pure: no Ray, no vLLM.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

import yaml

JUDGE_FUNCTION = "judge"
"""The name that stands for the model judge in RewardConfig.functions and by_data_source."""
VerdictRule = Literal["number", "yes_no", "tags"]
VERDICT_RULES: tuple[str, ...] = get_args(VerdictRule)
FailurePolicy = Literal["zero", "mask"]
FAILURE_POLICIES: tuple[str, ...] = get_args(FailurePolicy)

SAMPLE_PLACEHOLDERS = ("prompt", "completion", "gt_answer", "verdict_format")
GROUP_PLACEHOLDERS = ("prompt", "answers", "num_answers", "gt_answer", "verdict_format")
ANSWER_PLACEHOLDERS = ("k", "completion", "prompt")
"""What JudgeConfig.answer_format may show of one answer: its number, its text, its question."""
DEFAULT_ANSWER_FORMAT = "Answer {k}:\n{completion}"
# A `{name}` of lowercase letters and underscores is a placeholder; anything else in braces is text.
PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
# The keys a template file may hold.
_TEMPLATE_KEYS = ("system", "user")

DEFAULT_SYSTEM = ("You are a careful grader. Read the question and the answer given to it, decide whether "
                  "the answer is correct and complete, and give your verdict in exactly the format asked for.")
DEFAULT_SAMPLE_USER = "Question:\n{prompt}\n\nAnswer:\n{completion}\n\n{verdict_format}"
DEFAULT_GROUP_USER = "Question:\n{prompt}\n\n{answers}\n\n{verdict_format}"


@dataclass(slots=True, frozen=True)
class JudgeTemplate:
    """The resolved chat template: the rubric and the user message with its placeholders."""

    system: str
    """The system message (the rubric); "" sends no system message."""
    user: str
    """The user message; its placeholders are filled per call (module docstring)."""


@dataclass(kw_only=True, frozen=True)
class JudgeConfig:
    """The model judge behind the reward function named `judge` (config section `sampling.reward.judge`)."""

    template_path: str | None = None
    """YAML or JSON file with the chat template's `system` and/or `user` messages (the inline
    `system` and `user` must then stay unset); read on every node that judges."""
    system: str = DEFAULT_SYSTEM
    """The judge's system message: the rubric ("" sends none)."""
    # "" picks DEFAULT_SAMPLE_USER or DEFAULT_GROUP_USER by group_wise.
    user: str = ""
    """The user message with placeholders ({prompt}, {completion} or {answers}, {gt_answer},
    {verdict_format}: docs/rewards.md); "" uses the default for the mode."""
    prompt_field: str | None = None
    """Prompt record field whose text is {prompt} (a chat list shows as "role: content" lines);
    None: the first of prompt, question, problem the record has."""
    verdict: VerdictRule = "number"
    """How the reply is read: number (its first number, in [low, high]), yes_no (its first yes or
    no), tags (the number inside its last <score></score>, in [low, high]); judge_template.py."""
    low: float = 0.0
    """Lowest score of the number and tags rules; it maps to reward 0."""
    high: float = 10.0
    """Highest score of the number and tags rules; it maps to reward 1 (scores scale linearly)."""
    group_wise: bool = False
    """One call per group: the judge sees all n answers numbered and gives one verdict per answer
    ("K: verdict" lines); false judges each answer alone."""
    max_tokens: int = 512
    """Most tokens of one judge reply."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, the same reply for the same request)."""
    timeout_s: float = 60.0
    """Deadline of one judge request, from when it is sent; a request past it counts as a timeout."""
    retries: int = 1
    """Times a failed request (timeout, unparsable reply, pool error) is sent again before its samples fail."""
    on_failure: FailurePolicy = "mask"
    """A judge failure after its retries: mask leaves the sample out of its group's baseline and the
    loss (counted: reward/masked_samples); zero scores 0 for the judge's part."""
    agree_with: str | None = None
    """A reward function's metric name (e.g. math_verify_reward) to compare the judge with on each
    sample both score: reward/judge_agreement is the share where both call it solved or both not.
    Weight that function 0 to keep it out of the reward."""
    answer_format: str = DEFAULT_ANSWER_FORMAT
    """Group-wise: how {answers} shows one answer, with {k} (its number, from 1), {completion} and
    optionally {prompt} (the question again beside each answer); answers are blank lines apart."""
    batch_window_s: float = 0.0
    """How long judge requests wait to go out together in one client call; 0: those made in one turn of
    the event loop (concurrent groups) go together."""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICT_RULES:
            raise ValueError(f"JudgeConfig.verdict must be one of {list(VERDICT_RULES)}, got {self.verdict!r}")
        if self.on_failure not in FAILURE_POLICIES:
            raise ValueError(f"JudgeConfig.on_failure must be one of {list(FAILURE_POLICIES)}, got {self.on_failure!r}")
        for name in ("low", "high", "temperature", "timeout_s", "batch_window_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"JudgeConfig.{name} must be a finite number, got {value!r}")
        if not self.low < self.high:
            raise ValueError(f"JudgeConfig.low must be below high, got low={self.low}, high={self.high}")
        if self.timeout_s <= 0:
            raise ValueError(f"JudgeConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.temperature < 0 or self.batch_window_s < 0:
            raise ValueError(f"JudgeConfig.temperature and batch_window_s must be >= 0, got "
                             f"{self.temperature}, {self.batch_window_s}")
        for name in ("max_tokens", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "max_tokens" else 0):
                raise ValueError(f"JudgeConfig.{name} must be an int >= {1 if name == 'max_tokens' else 0}, "
                                 f"got {value!r}")
        if self.prompt_field is not None and (not isinstance(self.prompt_field, str) or not self.prompt_field):
            raise ValueError(f"JudgeConfig.prompt_field must be a non-empty field name or None, got {self.prompt_field!r}")
        if self.agree_with is not None and (not isinstance(self.agree_with, str) or not self.agree_with
                                            or self.agree_with == JUDGE_FUNCTION):
            raise ValueError(f"JudgeConfig.agree_with must name another reward function, got {self.agree_with!r}")
        if self.template_path is not None and (self.system != DEFAULT_SYSTEM or self.user):
            raise ValueError("JudgeConfig.template_path replaces the inline system and user messages: set one or the other")
        check_answer_format(self.answer_format)
        self.template()  # a missing file or a bad placeholder is reported now, naming it

    def template(self) -> JudgeTemplate:
        """The chat template: the file's (template_path) or the inline one, the mode's default
        user message where none is given; ValueError naming the file or field when it is unusable."""
        if self.template_path is not None:
            system, user = _read_template_file(self.template_path)
            where = f"JudgeConfig.template_path {self.template_path}"
        else:
            system, user, where = self.system, self.user, "JudgeConfig.user"
        if not user:
            user = DEFAULT_GROUP_USER if self.group_wise else DEFAULT_SAMPLE_USER
        check_placeholders(user, self.group_wise, where)
        for name in PLACEHOLDER.findall(system):
            if name in SAMPLE_PLACEHOLDERS + GROUP_PLACEHOLDERS:
                raise ValueError(f"{where}: the system message holds {{{name}}}; placeholders go in the user message")
        return JudgeTemplate(system=system, user=user)


def check_placeholders(user: str, group_wise: bool, where: str) -> None:
    """The user message names only its mode's placeholders, and the one that shows the answers."""
    allowed = GROUP_PLACEHOLDERS if group_wise else SAMPLE_PLACEHOLDERS
    mode = "group-wise" if group_wise else "per-sample"
    unknown = sorted({name for name in PLACEHOLDER.findall(user) if name not in allowed})
    if unknown:
        raise ValueError(f"{where}: unknown placeholder {{{unknown[0]}}} in the {mode} user message; "
                         f"known: {', '.join('{' + n + '}' for n in allowed)}")
    needed = "answers" if group_wise else "completion"
    if f"{{{needed}}}" not in user:
        raise ValueError(f"{where}: the {mode} user message must show the answer{'s' if group_wise else ''} "
                         f"with {{{needed}}}")


def check_answer_format(answer_format: str) -> None:
    """answer_format shows the answer's number and text, and only ANSWER_PLACEHOLDERS."""
    if not isinstance(answer_format, str):
        raise ValueError(f"JudgeConfig.answer_format must be text, got {type(answer_format).__name__}")
    unknown = sorted(set(PLACEHOLDER.findall(answer_format)) - set(ANSWER_PLACEHOLDERS))
    if unknown:
        raise ValueError(f"JudgeConfig.answer_format: unknown placeholder {{{unknown[0]}}}; known: "
                         f"{', '.join('{' + n + '}' for n in ANSWER_PLACEHOLDERS)}")
    for needed in ("k", "completion"):
        if f"{{{needed}}}" not in answer_format:
            raise ValueError(f"JudgeConfig.answer_format must show {{{needed}}}, got {answer_format!r}")


@lru_cache(maxsize=16)
def _read_template_file(path: str) -> tuple[str, str]:
    """(system, user) of a template file; "" for a key it leaves out."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"JudgeConfig.template_path {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"JudgeConfig.template_path {path}: not YAML or JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict) or not data or set(data) - set(_TEMPLATE_KEYS):
        raise ValueError(f"JudgeConfig.template_path {path}: must be a mapping with keys among {list(_TEMPLATE_KEYS)}, "
                         f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    for key, value in data.items():
        if not isinstance(value, str):
            raise ValueError(f"JudgeConfig.template_path {path}: {key!r} must be text, got {type(value).__name__}")
    return data.get("system", ""), data.get("user", "")
