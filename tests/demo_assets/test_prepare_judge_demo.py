"""scripts/prepare_judge_demo.py's pure parts: its examples' labels and balance, the evaluation
table, and the chat template as transformers reads it back from the saved tokenizer (no training).

    .venv/bin/python -m pytest tests/demo_assets/test_prepare_judge_demo.py -q
"""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest

from support.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import prepare_judge_demo  # noqa: E402

from async_grpo.demo_assets import arithmetic_judge  # noqa: E402
from async_grpo.demo_assets.tiny_model import build_tiny_tokenizer  # noqa: E402


def test_examples_are_labelled_by_the_exact_sum_and_balanced() -> None:
    rng = random.Random(0)
    examples = [prepare_judge_demo.judge_example(rng, 0.5) for _ in range(4000)]
    for a, b, completion, answer in examples:
        assert answer == ("yes" if completion == str(a + b) else "no"), (a, b, completion, answer)
        assert len(completion) <= prepare_judge_demo.MAX_COMPLETION_CHARS
    counts = Counter(answer for *_, answer in examples)
    assert 0.45 < counts["yes"] / len(examples) < 0.55, counts
    negatives = {completion for *_, completion, answer in examples if answer == "no"}
    # Every kind of negative shows up: wrong sums, longer numbers, junk after a number, junk, nothing.
    assert "" in negatives
    assert any(c.isdigit() and len(c) >= 3 for c in negatives)
    assert any(c[:1].isdigit() and not c.isdigit() for c in negatives)
    assert any(c and not any(ch.isdigit() for ch in c) for c in negatives)


def test_negatives_are_never_the_sum() -> None:
    rng = random.Random(1)
    for kind in prepare_judge_demo.NEGATIVE_KINDS:
        for _ in range(200):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            assert prepare_judge_demo.negative_completion(a, b, kind, rng) != str(a + b)
    with pytest.raises(ValueError, match="unknown negative kind"):
        prepare_judge_demo.negative_completion(1, 2, "typo", rng)


def test_the_eval_table_is_every_problem_against_every_number() -> None:
    cases = prepare_judge_demo.eval_cases(num_junk=50, seed=0)
    table = [case for case in cases if case[0] == "table"]
    assert len(table) == 1900 and len(set(table)) == 1900
    assert sum(prepare_judge_demo.is_correct(a, b, c) for _, a, b, c in table) == 100
    junk = [case for case in cases if case[0] == "junk"]
    assert len(junk) == 50 and not any(prepare_judge_demo.is_correct(a, b, c) for _, a, b, c in junk)
    assert cases == prepare_judge_demo.eval_cases(num_junk=50, seed=0)


def test_the_chat_template_survives_a_save_and_renders_the_contents_only(tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = arithmetic_judge.JUDGE_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == arithmetic_judge.JUDGE_CHAT_TEMPLATE
    mark = arithmetic_judge.GENERATION_MARK
    assert prepare_judge_demo.render(reloaded, prepare_judge_demo.judge_messages(3, 4, "7")) == "3+4=7" + mark
    assert prepare_judge_demo.render(reloaded, prepare_judge_demo.judge_messages(3, 4, "7", system="S")) == (
        "S\n3+4=7" + mark)
    assert reloaded.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": "3+4=7"}],
                                        tokenize=False, add_generation_prompt=False) == "3+4=7"
    # One token per character, the mark included: the judge reads its verdict after the mark.
    ids = prepare_judge_demo.prompt_ids(reloaded, 3, 4, "7")
    assert reloaded.decode(ids) == "3+4=7" + mark and len(ids) == len("3+4=7" + mark)


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", 0), ("lr", 0.0), ("positive_fraction", 1.0),
                                          ("num_junk_eval", 0), ("group_size", 0),
                                          ("num_eval_groups", 0)])
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"PrepareJudgeDemoConfig.{field}"):
        prepare_judge_demo.PrepareJudgeDemoConfig(out_dir="x", **{field: value})


def test_the_template_file_is_the_judge_configs_template(tmp_path) -> None:
    from async_grpo.config.judge_config import JudgeConfig, JudgeTemplate
    from async_grpo.rewards.judge_template import sample_messages

    config = JudgeConfig(template_path=str(arithmetic_judge.write_judge_template(tmp_path / "t.yaml")))
    assert config.template() == JudgeTemplate(system="", user="{prompt}{completion}")
    messages = sample_messages(config, config.template(), prompt="3+4=", completion="7", gt_answer="7")
    assert [m["content"] for m in messages if m["content"]] == ["3+4=7"]


def test_group_examples_are_labelled_by_the_exact_sum_with_every_share_of_right_answers() -> None:
    rng = random.Random(2)
    right_counts = set()
    for _ in range(600):
        a, b, completions, labels = prepare_judge_demo.group_example(rng, 16)
        assert len(completions) == len(labels) == 16
        assert labels == ["yes" if c == str(a + b) else "no" for c in completions], (a, b, completions, labels)
        assert all(len(c) <= prepare_judge_demo.MAX_COMPLETION_CHARS for c in completions)
        right_counts.add(labels.count("yes"))
    assert right_counts == set(range(17))  # all wrong, all right and every share between


def test_the_group_reply_parses_to_the_labels() -> None:
    labels = ["yes", "no"] * 8
    reply = prepare_judge_demo.group_reply(labels)
    assert reply.splitlines()[:2] == ["1: yes", "2: no"] and reply.splitlines()[-1] == "16: no"
    verdict = prepare_judge_demo.parse_group_verdict(reply, 16, prepare_judge_demo.GROUP_RULE)
    assert verdict.scores == [1.0 if label == "yes" else 0.0 for label in labels]
    assert prepare_judge_demo.parse_group_verdict(reply, 17, prepare_judge_demo.GROUP_RULE).scores is None


def test_the_group_chat_after_a_save_shows_the_prompt_and_numbered_answers(tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = arithmetic_judge.JUDGE_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    completions = ["7", "12", "", "7x"]
    text = prepare_judge_demo.render(reloaded, prepare_judge_demo.group_chat(3, 4, completions))
    assert text == "3+4=\nAnswer 1:\n7\n\nAnswer 2:\n12\n\nAnswer 3:\n\n\nAnswer 4:\n7x" + arithmetic_judge.GENERATION_MARK
    ids = prepare_judge_demo.group_prompt_ids(reloaded, 3, 4, completions)
    assert reloaded.decode(ids) == text and len(ids) == len(text)
    # The longest group and its reply fit the vLLM launcher's CPU max_model_len.
    assert prepare_judge_demo.longest_group_tokens(reloaded, 16) <= 512
    samples = prepare_judge_demo.group_batch(reloaded, 4, 16, random.Random(0))
    for sample in samples:
        assert sample.output_token_ids[-1] == reloaded.eos_token_id
        reply = reloaded.decode(sample.output_token_ids[:-1])
        assert prepare_judge_demo.parse_group_verdict(reply, 16, prepare_judge_demo.GROUP_RULE).scores is not None


def test_the_table_groups_show_every_pair_once_as_scored() -> None:
    groups = prepare_judge_demo.table_groups(16, seed=0)
    scored = [(a, b, c) for a, b, completions, first in groups for c, f in zip(completions, first) if f]
    assert len(scored) == 1900 and len(set(scored)) == 1900
    assert all(len(completions) == 16 for _, _, completions, _ in groups)


def test_the_group_template_file_is_a_group_wise_judge_configs_template(tmp_path) -> None:
    from async_grpo.config.judge_config import JudgeConfig, JudgeTemplate
    from async_grpo.rewards.judge_template import group_messages

    path = arithmetic_judge.write_judge_template(tmp_path / "g.yaml", group_wise=True)
    config = JudgeConfig(template_path=str(path), group_wise=True, verdict="yes_no")
    assert config.template() == JudgeTemplate(system="", user="{prompt}\n{answers}")
    messages = group_messages(config, config.template(), prompt="3+4=", completions=["7", "8"], gt_answer="7")
    assert [m["content"] for m in messages] == ["3+4=\nAnswer 1:\n7\n\nAnswer 2:\n8"]
