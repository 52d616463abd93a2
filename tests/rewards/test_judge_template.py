"""The judge's records and rules (issue 60, item 1): JudgeConfig's checks, the template file, the
prompt builders and the verdict rules, against hand-written replies: clean ones, garbage, numbers
out of range, and group-wise replies with answers missing.

    .venv/bin/python -m pytest tests/rewards/test_judge_template.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from async_grpo.config.judge_config import JudgeConfig
from async_grpo.rewards.judge_template import (
    group_messages, parse_group_verdict, parse_verdict, prompt_text, sample_messages,
)

ONE_TO_TEN = JudgeConfig(verdict="number", low=1, high=10)
TAGS = JudgeConfig(verdict="tags", low=0, high=5)
YES_NO = JudgeConfig(verdict="yes_no")

# ------------------------------------------------------------------------------------------
# Verdict rules, one reply at a time
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, score", [
    ("7", 6 / 9),                                # (7 - 1) / (10 - 1)
    ("Score: 10. Flawless.", 1.0),
    ("1", 0.0),
    ("  5.5 out of 10", 4.5 / 9),
    ("I give it 4, not 9.", 3 / 9),              # the first number decides
])
def test_number_rule_scales_the_first_number(text: str, score: float) -> None:
    assert parse_verdict(text, ONE_TO_TEN).score == pytest.approx(score)


@pytest.mark.parametrize("text, problem", [
    ("", "no number"),
    ("Excellent work!", "no number"),
    ("11", "11 is outside [1, 10]"),
    ("0 - it is wrong", "0 is outside [1, 10]"),
    ("-3", "-3 is outside [1, 10]"),
    ("Step 12: the sum is right, so 9.", "12 is outside [1, 10]"),  # reasoning numbers trip this rule
])
def test_number_rule_refuses_garbage_and_out_of_range(text: str, problem: str) -> None:
    verdict = parse_verdict(text, ONE_TO_TEN)
    assert verdict.score is None and problem in verdict.problem


@pytest.mark.parametrize("text, score", [
    ("Yes", 1.0), ("no.", 0.0), ("YES, it is right", 1.0),
    ("Nope... actually no", 0.0),                # "Nope" is not a standalone no
    ("The answer is correct: yes. (Not no.)", 1.0),
])
def test_yes_no_rule_takes_the_first_standalone_word(text: str, score: float) -> None:
    assert parse_verdict(text, YES_NO).score == score


@pytest.mark.parametrize("text", ["", "maybe", "Yesterday I said nothing", "noyes"])
def test_yes_no_rule_refuses_replies_without_either(text: str) -> None:
    assert parse_verdict(text, YES_NO).score is None


@pytest.mark.parametrize("text, score", [
    ("<score>4</score>", 0.8),
    ("The format is <score>N</score>. Reasoning: 3+4=7, correct. <score> 5 </score>", 1.0),  # the last tag
    ("<SCORE>2.5</SCORE>", 0.5),
    ("7 apples, 12 pears. <score>0</score>", 0.0),  # numbers outside the tags do not count
])
def test_tags_rule_reads_the_last_tag(text: str, score: float) -> None:
    assert parse_verdict(text, TAGS).score == pytest.approx(score)


@pytest.mark.parametrize("text, problem", [
    ("4", "no <score>"),
    ("<score>four</score>", "not a number"),
    ("<score>4 out of 5</score>", "not a number"),
    ("<score>6</score>", "6 is outside [0, 5]"),
    ("<score>4", "no <score>"),                  # cut off before the closing tag
])
def test_tags_rule_refuses_garbage(text: str, problem: str) -> None:
    verdict = parse_verdict(text, TAGS)
    assert verdict.score is None and problem in verdict.problem


# ------------------------------------------------------------------------------------------
# Group-wise replies
# ------------------------------------------------------------------------------------------


def test_group_reply_gives_one_score_per_answer_in_order() -> None:
    reply = "Answer 2 forgot the carry.\n\n1: 10\n2: 1\nAnswer 3: 4\n**4.** 7"
    assert parse_group_verdict(reply, 4, ONE_TO_TEN).scores == pytest.approx([1.0, 0.0, 3 / 9, 6 / 9])


def test_group_reply_takes_the_last_verdict_of_an_answer_and_skips_reasoning_lines() -> None:
    reply = ("1. The first answer adds 3 and 4 correctly.\n"  # reasoning: parses as a score of 3 for answer 1
             "2) wrong\n"                                     # no number: passed over
             "Final verdicts:\n1: 9\n2: 2")
    assert parse_group_verdict(reply, 2, ONE_TO_TEN).scores == pytest.approx([8 / 9, 1 / 9])


def test_group_reply_with_tags_and_yes_no() -> None:
    assert parse_group_verdict("1: <score>5</score>\n2: <score>0</score>", 2, TAGS).scores == [1.0, 0.0]
    assert parse_group_verdict("1: no\n2: yes\n3: YES", 3, YES_NO).scores == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("reply, missing", [
    ("1: 5\n2: 6", "answer 3 of 3"),                          # partial: the third is missing
    ("1: 5\n3: 6", "answer 2 of 3"),
    ("1: 5\n2: 11\n3: 6", "answer 2 of 3"),                    # out of range is no verdict
    ("All three are fine: 7", "answers 1, 2, 3 of 3"),          # one score for the group is not three
    ("", "answers 1, 2, 3 of 3"),
    ("1: 5\n2: 6\n4: 7", "answer 3 of 3"),                    # an answer number the group lacks is ignored
    ("7.5 is my score for 1\n1: 5\n2: 5", "answer 3 of 3"),   # "7.5" is a decimal, not answer 7
])
def test_group_reply_missing_an_answer_scores_nobody(reply: str, missing: str) -> None:
    verdict = parse_group_verdict(reply, 3, ONE_TO_TEN)
    assert verdict.scores is None and f"no verdict for {missing}" in verdict.problem


# ------------------------------------------------------------------------------------------
# Prompt builders
# ------------------------------------------------------------------------------------------


def test_sample_messages_fill_the_template_once() -> None:
    config = JudgeConfig(system="Grade sums.", user="Q: {prompt}\nA: {completion}\nGold: {gt_answer}\n{verdict_format}"
                                                    "\nReply as JSON {\"score\": n}")
    messages = sample_messages(config, config.template(), prompt="3+4=", completion="7 {prompt}", gt_answer="7")
    assert messages == [
        {"role": "system", "content": "Grade sums."},
        {"role": "user", "content": "Q: 3+4=\nA: 7 {prompt}\nGold: 7\nReply with a single number from 0 to 10."
                                    "\nReply as JSON {\"score\": n}"},
    ]


def test_group_messages_number_the_answers() -> None:
    config = JudgeConfig(verdict="tags", low=1, high=5, group_wise=True, system="")
    (user,) = group_messages(config, config.template(), prompt="2+2=", completions=["4", "5"], gt_answer="4")
    assert user["role"] == "user"
    assert user["content"] == (
        "Question:\n2+2=\n\nAnswer 1:\n4\n\nAnswer 2:\n5\n\n"
        "End your reply with 2 lines, one per answer in order: 'K: <verdict>' for K from 1 to 2, where <verdict> "
        "is your score, a number from 1 to 5, between <score> and </score>.")


def test_an_answer_format_shows_each_answer_its_way() -> None:
    config = JudgeConfig(verdict="yes_no", group_wise=True, system="", user="{answers}",
                         answer_format="#{k} {prompt}{completion}")
    (user,) = group_messages(config, config.template(), prompt="2+2=", completions=["4", "{prompt}"], gt_answer="4")
    assert user["content"] == "#1 2+2=4\n\n#2 2+2={prompt}"  # an answer's braces are its text, never filled


def test_prompt_text_comes_from_the_record() -> None:
    assert prompt_text({"prompt": "3+4=", "question": "other"}, None) == "3+4="
    assert prompt_text({"question": "Natalia sold..."}, None) == "Natalia sold..."
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert prompt_text({"prompt": chat}, None) == "system: Be brief.\nuser: 2+2?"
    assert prompt_text({"task": "x", "prompt": "y"}, "task") == "x"
    with pytest.raises(ValueError, match="'task'"):
        prompt_text({"prompt": "y"}, "task")
    with pytest.raises(ValueError, match="'prompt' or 'question' or 'problem'"):
        prompt_text(None, None)


# ------------------------------------------------------------------------------------------
# JudgeConfig and the template file
# ------------------------------------------------------------------------------------------


def test_template_file_replaces_the_inline_messages(tmp_path: Path) -> None:
    path = tmp_path / "rubric.yaml"
    path.write_text("system: Only sums.\nuser: |\n  {prompt} -> {answers}\n  {verdict_format}\n")
    template = JudgeConfig(template_path=str(path), group_wise=True).template()
    assert (template.system, template.user) == ("Only sums.", "{prompt} -> {answers}\n{verdict_format}\n")
    only_user = tmp_path / "user.json"
    only_user.write_text('{"user": "{completion}?"}')
    assert JudgeConfig(template_path=str(only_user)).template().system == ""


@pytest.mark.parametrize("kwargs, match", [
    ({"verdict": "stars"}, "JudgeConfig.verdict"),
    ({"low": 5, "high": 5}, "JudgeConfig.low must be below high"),
    ({"timeout_s": 0}, "JudgeConfig.timeout_s"),
    ({"retries": -1}, "JudgeConfig.retries"),
    ({"max_tokens": 0}, "JudgeConfig.max_tokens"),
    ({"on_failure": "skip"}, "JudgeConfig.on_failure"),
    ({"user": "{prompt} only"}, "must show the answer with {completion}"),
    ({"user": "{answers}", "group_wise": True, "system": "{prompt}"}, "system message holds {prompt}"),
    ({"user": "{completion} {answer}"}, "unknown placeholder {answer}"),
    ({"user": "{completion}", "group_wise": True}, "unknown placeholder {completion}"),
    ({"template_path": "rubric.yaml", "user": "{completion}"}, "set one or the other"),
    ({"template_path": "/no/such/rubric.yaml"}, "cannot read it"),
    ({"agree_with": "judge"}, "JudgeConfig.agree_with must name another reward function"),
    ({"answer_format": "Answer:\n{completion}"}, "answer_format must show {k}"),
    ({"answer_format": "{k}: {answer}"}, "answer_format: unknown placeholder {answer}"),
])
def test_bad_judge_configs_are_refused_naming_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("{", r"\{").replace("}", r"\}")):
        JudgeConfig(**kwargs)


@pytest.mark.parametrize("content, match", [
    ("- a list", "must be a mapping"),
    ("rubric: x", "must be a mapping"),
    ("user: [1, 2]", "'user' must be text"),
    ("user: {completion", "not YAML"),
])
def test_bad_template_files_are_refused_naming_the_file(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"template_path {path}.*{match}"):
        JudgeConfig(template_path=str(path))


def test_agreement_needs_the_judge_and_the_named_function_in_the_reward() -> None:
    from async_grpo.config.reward_config import RewardConfig

    judge = JudgeConfig(agree_with="math_verify_reward")
    RewardConfig(functions=("judge", "async_grpo.rewards.math_verifier:math_verify_reward"), weights=(1.0, 0.0),
                 judge=judge)
    with pytest.raises(ValueError, match="judge.agree_with 'math_verify_reward' compares two of `functions`"):
        RewardConfig(functions=("judge",), judge=judge)
