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
                                          ("num_junk_eval", 0)])
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
