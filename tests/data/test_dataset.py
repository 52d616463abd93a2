"""dataset.py: prompt loading (JSONL and Parquet; generic, GSM8K and MATH records; chat templates; with the
real tiny tokenizer), the arithmetic generator's files as the loader reads them, the data CLI. The sampler's
tests are in test_distributed_sampler.py, the answer extraction's in test_prompt_record.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
import string
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from async_grpo.config.run_config import ConfigError, config_to_flags, load_config
from async_grpo.demo_assets.arithmetic_data import write_arithmetic_dataset, write_arithmetic_table
from async_grpo.data.dataset import CheckConfig, DatasetConfig, DatasetError, load_prompt_file, load_prompts
from setup_model import load_tokenizer
from support.chat_tokenizer import CHATML_TEMPLATE, IM_END, IM_START, write_chat_model
from support.paths import REPO_ROOT

MAX_PROMPT_TOKENS = 16
GOOD_LINE = '{"prompt": "1+1=", "gt_answer": "2"}'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _config(path: Path, **overrides) -> DatasetConfig:
    return DatasetConfig(path=str(path), max_prompt_tokens=MAX_PROMPT_TOKENS, **overrides)


def _char_ids(tokenizer, text: str) -> list[int]:
    """Expected ids of a text without spaces under the char-level tokenizer: one vocab entry per
    character (printable ASCII other than space is its own symbol in the byte-level alphabet)."""
    assert " " not in text
    return tokenizer.convert_tokens_to_ids(list(text))


BAD_LINES = [
    ('{"prompt": "1+1=", "gt_answer": "2"', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "1+1="}', "missing field 'gt_answer'"),
    ('{"gt_answer": "2"}', "missing field: a record needs 'input_token_ids' (token ids) or 'prompt' (text)"),
    ('{"prompt": "1+1=", "input_token_ids": [5, 6], "gt_answer": "2"}', "ambiguous prompt: both"),
    ('{"prompt": "1+1=", "gt_answer": 2}', "field 'gt_answer' must be a string, got int 2"),
    ('{"prompt": "1+1=", "gt_answer": "  "}', "field 'gt_answer' is empty"),
    ('{"prompt": 5, "gt_answer": "2"}', "field 'prompt' must be a string, got int"),
    ('{"input_token_ids": "5 6", "gt_answer": "2"}', "field 'input_token_ids' must be a list of ints, got str"),
    ('{"input_token_ids": [5, "6"], "gt_answer": "2"}', "field 'input_token_ids' must be a list of ints; item 1 is '6'"),
    ('{"input_token_ids": [5, true], "gt_answer": "2"}', "field 'input_token_ids' must be a list of ints; item 1 is True"),
    ('{"input_token_ids": [5, 6.0], "gt_answer": "2"}', "field 'input_token_ids' must be a list of ints; item 1 is 6.0"),
    ('{"input_token_ids": [], "gt_answer": "2"}', "empty prompt"),
    ('{"prompt": "", "gt_answer": "2"}', "empty prompt"),
    ('{"prompt": "   ", "gt_answer": "2"}', "empty prompt"),
    ('{"input_token_ids": [5, -1], "gt_answer": "2"}', "token id -1 at position 1 is outside the vocabulary [0, 98)"),
    ('{"input_token_ids": [5, 98], "gt_answer": "2"}', "token id 98 at position 1 is outside the vocabulary [0, 98)"),
    (json.dumps({"input_token_ids": [5] * 17, "gt_answer": "2"}), "prompt has 17 tokens, more than max_prompt_tokens=16"),
    ('{"prompt": "1+1=1+1=1+1=1+1=1", "gt_answer": "2"}', "prompt has 17 tokens, more than max_prompt_tokens=16"),
    ('{"prompt": "h\\u00e9llo", "gt_answer": "2"}', "prompt text does not survive tokenization: decode(encode(text)) differs from character 1 ('é')"),
]


@pytest.mark.parametrize(("bad_line", "problem"), BAD_LINES, ids=[p for _, p in BAD_LINES])
def test_bad_line_fails_the_load_naming_file_line_and_problem(tmp_path: Path, tokenizer, bad_line: str, problem: str) -> None:
    # Line 1 good, line 2 blank, line 3 bad, line 4 good: the error must point at physical line 3.
    path = _write(tmp_path / "prompts.jsonl", [GOOD_LINE, "", bad_line, GOOD_LINE])
    with pytest.raises(DatasetError) as info:
        load_prompts(_config(path), tokenizer)
    assert str(info.value).startswith(f"{path}:3: {problem}")


def test_vocabulary_of_the_tiny_tokenizer_is_what_the_cases_assume(tokenizer) -> None:
    # 95 printable ASCII characters + newline + EOS + PAD.
    assert len(tokenizer) == 98


def test_invalid_utf8_is_reported_with_its_line(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + '{"prompt": "caf\xe9", "gt_answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: not UTF-8")):
        load_prompts(_config(path), tokenizer)


def test_empty_and_blank_only_files_and_missing_file(tmp_path: Path, tokenizer) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match=re.escape(f"{empty}: no prompts: the file is empty")):
        load_prompts(_config(empty), tokenizer)
    blank = _write(tmp_path / "blank.jsonl", ["", "   ", "\t"])
    with pytest.raises(DatasetError, match=re.escape(f"{blank}: no prompts: the file has only blank lines (3)")):
        load_prompts(_config(blank), tokenizer)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DatasetError, match=re.escape(f"{missing}: cannot read prompt file")):
        load_prompts(_config(missing), tokenizer)


def test_good_file_gives_samples_in_order_with_counted_skips(tmp_path: Path, tokenizer) -> None:
    lines = [
        '{"input_token_ids": [40, 41, 42], "gt_answer": "\\\\frac{1}{2}"}',
        "",
        '{"prompt": "3+4=", "gt_answer": "7", "source": "demo"}',
        "  ",
        '{"prompt": "Sum: 12+30=", "gt_answer": "42"}',
    ]
    loaded = load_prompt_file(_config(_write(tmp_path / "good.jsonl", lines)), tokenizer)
    samples = loaded.samples
    assert [s.prompt_id for s in samples] == [0, 1, 2]
    assert [s.gt_answer for s in samples] == ["\\frac{1}{2}", "7", "42"]
    assert samples[0].input_token_ids == [40, 41, 42]
    assert samples[1].input_token_ids == _char_ids(tokenizer, "3+4=")
    # "Sum: 12+30=" has a space, which the byte-level alphabet writes as "Ġ".
    assert samples[2].input_token_ids == tokenizer.convert_tokens_to_ids(["S", "u", "m", ":", "Ġ", *"12+30="])
    assert tokenizer.decode(samples[2].input_token_ids) == "Sum: 12+30="
    assert all(s.output_token_ids == [] and s.weight_version == -1 for s in samples)
    stats = loaded.stats
    assert (stats.prompts, stats.from_token_ids, stats.from_text, stats.blank_lines) == (3, 1, 2, 2)
    assert stats.ignored_fields == {"source": 1}


def test_round_trip_check_can_be_turned_off(tmp_path: Path, tokenizer) -> None:
    path = _write(tmp_path / "accents.jsonl", ['{"prompt": "h\\u00e9llo", "gt_answer": "1"}'])
    (sample,) = load_prompts(_config(path, check_round_trip=False), tokenizer)
    assert sample.input_token_ids == _char_ids(tokenizer, "hllo")  # the tokenizer drops the é


def test_dataset_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="DatasetConfig.path"):
        DatasetConfig(path="")
    with pytest.raises(ValueError, match="DatasetConfig.max_prompt_tokens"):
        DatasetConfig(path="x.jsonl", max_prompt_tokens=0)


def test_check_command_takes_every_data_field_as_the_trainer_does() -> None:
    data = DatasetConfig(path="d.parquet", format="gsm8k", prompt_field="q", answer_field="a", missing_answer="skip",
                         prompt_template="Q: {question}", max_prompt_tokens=64, add_special_tokens=True,
                         check_round_trip=False)
    argv = [*config_to_flags(data), "--model_path", "m", "--show", "2"]
    assert load_config(CheckConfig, argv) == CheckConfig(data=data, model_path="m", show=2)
    with pytest.raises(ConfigError, match="DatasetConfig.add_special_tokens must be false with"):
        load_config(CheckConfig, ["--path", "d.jsonl", "--model_path", "m", "--chat_template", "--add_special_tokens"])
    with pytest.raises(ConfigError, match="missing 1 required keyword-only argument: 'model_path'"):
        load_config(CheckConfig, ["--path", "d.jsonl"])


def _parse_arithmetic(path: Path) -> list[tuple[int, str, int, str]]:
    rows = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert set(record) == {"prompt", "gt_answer"}
        match = re.fullmatch(r"(\d+)([-+*])(\d+)=", record["prompt"])
        assert match, record
        rows.append((int(match[1]), match[2], int(match[3]), record["gt_answer"]))
    return rows


def test_arithmetic_default_is_single_digit_addition(tmp_path: Path, tokenizer) -> None:
    path = write_arithmetic_dataset(tmp_path / "a.jsonl", num_samples=300, seed=0)
    rows = _parse_arithmetic(path)
    assert len(rows) == 300
    assert {op for _, op, _, _ in rows} == {"+"}
    assert all(0 <= a <= 9 and 0 <= b <= 9 and gt == str(a + b) for a, _, b, gt in rows)
    assert len({(a, b) for a, _, b, _ in rows}) > 50  # drawn, not one repeated prompt
    samples = load_prompts(_config(path), tokenizer)
    assert [len(s.input_token_ids) for s in samples] == [4] * 300
    assert samples[0].input_token_ids == _char_ids(tokenizer, f"{rows[0][0]}+{rows[0][2]}=")


def test_arithmetic_is_seeded_and_supports_other_operators(tmp_path: Path) -> None:
    first = write_arithmetic_dataset(tmp_path / "1.jsonl", num_samples=50, seed=3).read_bytes()
    again = write_arithmetic_dataset(tmp_path / "2.jsonl", num_samples=50, seed=3).read_bytes()
    other = write_arithmetic_dataset(tmp_path / "3.jsonl", num_samples=50, seed=4).read_bytes()
    assert first == again and first != other
    path = write_arithmetic_dataset(tmp_path / "ops.jsonl", num_samples=200, seed=0, min_operand=10, max_operand=20, operators=("+", "-", "*"))
    rows = _parse_arithmetic(path)
    expected = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    assert all(10 <= a <= 20 and 10 <= b <= 20 and gt == str(expected[op](a, b)) for a, op, b, gt in rows)
    assert {op for _, op, _, _ in rows} == {"+", "-", "*"}
    assert not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="operators"):
        write_arithmetic_dataset(tmp_path / "bad.jsonl", num_samples=1, seed=0, operators=("/",))
    with pytest.raises(ValueError, match="min_operand"):
        write_arithmetic_dataset(tmp_path / "bad.jsonl", num_samples=1, seed=0, min_operand=5, max_operand=2)


def test_arithmetic_table_holds_every_problem_exactly_once(tmp_path: Path, tokenizer) -> None:
    path = write_arithmetic_table(tmp_path / "table.jsonl")
    rows = _parse_arithmetic(path)
    assert len(rows) == 100 and len({(a, b) for a, _, b, _ in rows}) == 100
    assert rows[0] == (0, "+", 0, "0") and rows[1] == (0, "+", 1, "1") and rows[-1] == (9, "+", 9, "18")
    assert all(op == "+" and gt == str(a + b) for a, op, b, gt in rows)
    assert len(load_prompts(_config(path), tokenizer)) == 100
    mixed = _parse_arithmetic(write_arithmetic_table(tmp_path / "mixed.jsonl", max_operand=3, min_operand=1,
                                                     operators=("-", "*")))
    assert [(a, op, b) for a, op, b, _ in mixed] == [(a, op, b) for op in "-*" for a in (1, 2, 3) for b in (1, 2, 3)]
    assert all(gt == str(a - b if op == "-" else a * b) for a, op, b, gt in mixed)
    assert not list(tmp_path.glob("*.partial"))
    for operators in (("/",), ("+", "+"), ()):
        with pytest.raises(ValueError, match="write_arithmetic_table: operators"):
            write_arithmetic_table(tmp_path / "bad.jsonl", operators=operators)
    with pytest.raises(ValueError, match="write_arithmetic_table: need 0 <= min_operand <= max_operand"):
        write_arithmetic_table(tmp_path / "bad.jsonl", min_operand=5, max_operand=2)


@pytest.mark.system
def test_arithmetic_cli_writes_the_same_file(tmp_path: Path) -> None:
    out = tmp_path / "cli.jsonl"
    subprocess.run(
        [sys.executable, "-m", "async_grpo.data.dataset", "write-arithmetic", "--out", str(out), "--num_samples", "20", "--seed", "7"],
        check=True, cwd=REPO_ROOT, capture_output=True, timeout=120,
    )
    assert out.read_bytes() == write_arithmetic_dataset(tmp_path / "api.jsonl", num_samples=20, seed=7).read_bytes()


# --- Published formats: GSM8K, MATH, Parquet, chat templates -------------------------------------

# The tiny tokenizer's vocabulary written down from its definition (EOS, PAD, then printable ASCII
# and newline, one token per character), independently of the tokenizer under test.
TINY_ALPHABET = string.printable[:95] + "\n"
NATALIA_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                    "How many clips did Natalia sell altogether in April and May?")
GSM8K_RECORDS = [
    {"question": NATALIA_QUESTION,
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "A farm has 10 coops of 100 hens. How many hens?", "answer": "10*100 = 1,000 hens.\n#### 1,000"},
]
MATH_RECORDS = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We get $\\frac{2}{4}+\\frac{1}{4}=\\boxed{\\frac{3}{4}}$."},
    {"problem": "Solve $x^2=4$ for $x>0$.", "level": "Level 2", "type": "Algebra",
     "solution": "Not $\\boxed{-2}$, which is negative; so $x = \\boxed {2}$."},
    {"problem": "Which set?", "level": "Level 1", "type": "Algebra", "solution": "It is \\fbox{\\{1, 2\\}}."},
]


def _tiny_ids(text: str) -> list[int]:
    return [2 + TINY_ALPHABET.index(char) for char in text]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    return _write(path, [json.dumps(record) for record in records])


def _write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow
    import pyarrow.parquet

    # One column per field of any record, null where a record lacks it (from_pylist would take the
    # columns of the first record only).
    names = list(dict.fromkeys(name for record in records for name in record))
    pyarrow.parquet.write_table(pyarrow.table({name: [record.get(name) for record in records] for name in names}), path)
    return path


def _sample_fields(samples) -> list[tuple[list[int], str, int]]:
    return [(s.input_token_ids, s.gt_answer, s.prompt_id) for s in samples]


def test_tiny_ids_helper_agrees_with_hand_written_ids(tokenizer) -> None:
    assert _tiny_ids("1+1=") == [3, 74, 3, 82]
    assert _tiny_ids("a b\n") == [12, 96, 13, 97]
    assert tokenizer.encode("a b\n1+1=", add_special_tokens=False) == [12, 96, 13, 97, 3, 74, 3, 82]


def test_gsm8k_file_gives_question_prompts_and_final_answers(tmp_path: Path, tokenizer) -> None:
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [{**GSM8K_RECORDS[0], "id": 7}, GSM8K_RECORDS[1]])
    loaded = load_prompt_file(DatasetConfig(path=str(path), format="gsm8k"), tokenizer)
    assert _sample_fields(loaded.samples) == [
        (_tiny_ids(NATALIA_QUESTION), "72", 0),
        (_tiny_ids("A farm has 10 coops of 100 hens. How many hens?"), "1000", 1),
    ]
    assert (loaded.stats.format, loaded.stats.from_text, loaded.stats.ignored_fields) == ("gsm8k", 2, {"id": 1})


def test_math_file_gives_problem_prompts_and_last_boxed_answers(tmp_path: Path, tokenizer) -> None:
    path = _write_jsonl(tmp_path / "math.jsonl", MATH_RECORDS)
    loaded = load_prompt_file(DatasetConfig(path=str(path), format="math"), tokenizer)
    assert _sample_fields(loaded.samples) == [
        (_tiny_ids("What is $\\frac{1}{2}+\\frac{1}{4}$?"), "\\frac{3}{4}", 0),
        (_tiny_ids("Solve $x^2=4$ for $x>0$."), "2", 1),
        (_tiny_ids("Which set?"), "\\{1, 2\\}", 2),
    ]
    assert loaded.stats.format == "math"
    assert loaded.stats.ignored_fields == {"level": 3, "type": 3}


@pytest.mark.parametrize(("records", "expected_format"), [
    ([{"prompt": "1+1=", "gt_answer": "2"}], "generic"),
    ([{"input_token_ids": [3, 74, 3, 82], "gt_answer": "2"}], "generic"),
    (GSM8K_RECORDS, "gsm8k"),
    (MATH_RECORDS, "math"),
])
def test_auto_detects_the_format_from_the_first_record_and_logs_it(
    tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture, records: list[dict], expected_format: str
) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", records)
    with caplog.at_level(logging.INFO, logger="async_grpo.data.dataset"):
        auto = load_prompt_file(DatasetConfig(path=str(path)), tokenizer)
    explicit = load_prompt_file(DatasetConfig(path=str(path), format=expected_format), tokenizer)
    assert auto.stats.format == expected_format
    assert _sample_fields(auto.samples) == _sample_fields(explicit.samples)
    assert f"reading {path} as format {expected_format} (detected from the fields of {path}:1)" in caplog.text


@pytest.mark.parametrize(("first_record", "problem"), [
    ({"text": "1+1=", "label": "2"}, "cannot detect data.format: the first record's fields ['label', 'text'] fits no format"),
    ({"question": "q", "solution": "\\boxed{1}"}, "cannot detect data.format: the first record's fields ['question', 'solution'] fits no format"),
    ({"prompt": "p", "problem": "q", "solution": "\\boxed{1}"}, "cannot detect data.format: the first record's fields ['problem', 'prompt', 'solution'] fits several formats (generic, math)"),
])
def test_auto_detection_failure_names_the_record_and_the_fields(tmp_path: Path, tokenizer, first_record: dict, problem: str) -> None:
    path = _write(tmp_path / "odd.jsonl", ["", json.dumps(first_record)])
    with pytest.raises(DatasetError) as info:
        load_prompts(DatasetConfig(path=str(path)), tokenizer)
    assert str(info.value).startswith(f"{path}:2: {problem}")
    assert "set data.format" in str(info.value)


def test_field_overrides_read_renamed_columns(tmp_path: Path, tokenizer) -> None:
    # DeepScaleR-style records: a bare final answer beside the worked solution.
    records = [{"problem": "2+2=", "answer": "4", "solution": "two and two: \\boxed{5}"}]
    path = _write_jsonl(tmp_path / "renamed.jsonl", records)
    generic = load_prompt_file(
        DatasetConfig(path=str(path), format="generic", prompt_field="problem", answer_field="answer"), tokenizer
    )
    assert _sample_fields(generic.samples) == [(_tiny_ids("2+2="), "4", 0)]
    assert generic.stats.ignored_fields == {"solution": 1}
    # The same file read as math takes the boxed answer of `solution` instead.
    (math_sample,) = load_prompts(DatasetConfig(path=str(path), format="math"), tokenizer)
    assert (math_sample.input_token_ids, math_sample.gt_answer) == (_tiny_ids("2+2="), "5")
    # A GSM8K copy with renamed columns.
    gsm8k = _write_jsonl(tmp_path / "gsm8k_renamed.jsonl", [{"query": "3+4=", "rationale": "3+4=7\n#### 7"}])
    (sample,) = load_prompts(
        DatasetConfig(path=str(gsm8k), format="gsm8k", prompt_field="query", answer_field="rationale"), tokenizer
    )
    assert (sample.input_token_ids, sample.gt_answer) == (_tiny_ids("3+4="), "7")


GOOD_GSM8K, GOOD_MATH = {"question": "1+1=", "answer": "#### 2"}, {"problem": "1+1=", "solution": "\\boxed{2}"}
# (format, field overrides, a good record, a bad record, the start of the expected problem)
FORMAT_BAD_RECORDS = [
    ("gsm8k", {}, GOOD_GSM8K, {"question": "q", "answer": "it is 72"},
     "field 'answer' has no final answer after a '####' marker (gsm8k format): 'it is 72'; data.missing_answer: skip"),
    ("gsm8k", {}, GOOD_GSM8K, {"question": "q", "answer": 72}, "field 'answer' must be a string, got int 72"),
    ("gsm8k", {}, GOOD_GSM8K, {"answer": "#### 1"}, "missing field 'question'"),
    ("gsm8k", {}, GOOD_GSM8K, {"question": "", "answer": "#### 1"}, "empty prompt: 'question' is ''"),
    ("math", {}, GOOD_MATH, {"problem": "p", "solution": "the answer is 5"},
     "field 'solution' has no final answer in a \\boxed{...} or \\fbox{...} with balanced braces (math format)"),
    ("math", {}, GOOD_MATH, {"problem": "p", "solution": "\\boxed{5"}, "field 'solution' has no final answer in a \\boxed"),
    ("math", {}, GOOD_MATH, {"solution": "\\boxed{5}"}, "missing field 'problem'"),
    ("math", {"answer_field": "worked"}, {"problem": "p", "worked": "\\boxed{1}"}, {"problem": "p", "worked": "5"},
     "field 'worked' has no final answer in a \\boxed"),
    ("math", {"prompt_field": "question"}, {"question": "p", "solution": "\\boxed{1}"},
     {"problem": "p", "solution": "\\boxed{5}"}, "missing field 'question'"),
    ("generic", {"prompt_field": "problem"}, {"problem": "1+1=", "gt_answer": "2"}, {"problem": "1+1=", "answer": "4"},
     "missing field 'gt_answer'"),
    ("generic", {"prompt_field": "problem"}, {"problem": "1+1=", "gt_answer": "2"}, {"gt_answer": "4"},
     "missing field: a record needs 'input_token_ids' (token ids) or 'problem' (text)"),
]


@pytest.mark.parametrize(("data_format", "overrides", "good_record", "bad_record", "problem"), FORMAT_BAD_RECORDS,
                         ids=[f"{f}-{p[:40]}" for f, _, _, _, p in FORMAT_BAD_RECORDS])
def test_bad_format_record_names_file_line_and_field(
    tmp_path: Path, tokenizer, data_format: str, overrides: dict, good_record: dict, bad_record: dict, problem: str
) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [good_record, good_record, bad_record, good_record])
    config = DatasetConfig(path=str(path), format=data_format, **overrides)
    assert len(load_prompts(replace(config, path=str(_write_jsonl(tmp_path / "good.jsonl", [good_record]))),
                            tokenizer)) == 1
    with pytest.raises(DatasetError) as info:
        load_prompts(config, tokenizer)
    assert str(info.value).startswith(f"{path}:3: {problem}")


def test_missing_answer_skip_counts_and_logs_the_skipped_records(
    tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    records = [MATH_RECORDS[0], {"problem": "p", "solution": "no box"}, MATH_RECORDS[2], {"problem": "q", "solution": ""}]
    path = _write_jsonl(tmp_path / "math.jsonl", records)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: field 'solution' has no final answer")):
        load_prompts(DatasetConfig(path=str(path), format="math"), tokenizer)
    # An empty solution is a broken record under either policy, not a missing answer.
    with pytest.raises(DatasetError, match=re.escape(f"{path}:4: field 'solution' is empty")):
        load_prompts(DatasetConfig(path=str(path), format="math", missing_answer="skip"), tokenizer)
    path = _write_jsonl(tmp_path / "math.jsonl", records[:3])
    with caplog.at_level(logging.INFO, logger="async_grpo.data.dataset"):
        loaded = load_prompt_file(DatasetConfig(path=str(path), format="math", missing_answer="skip"), tokenizer)
    assert _sample_fields(loaded.samples) == [
        (_tiny_ids("What is $\\frac{1}{2}+\\frac{1}{4}$?"), "\\frac{3}{4}", 0), (_tiny_ids("Which set?"), "\\{1, 2\\}", 1),
    ]
    assert (loaded.stats.prompts, loaded.stats.skipped_no_answer, loaded.stats.first_skipped) == (2, 1, [f"{path}:2"])
    assert f"skipped 1 records of {path} without a final answer (data.missing_answer: skip), first at {path}:2" in caplog.text
    none_left = _write_jsonl(tmp_path / "none.jsonl", [{"question": "q", "answer": "x"}] * 2)
    with pytest.raises(DatasetError, match=re.escape(
            f"{none_left}: no prompts: all 2 records were skipped for having no final answer")):
        load_prompts(DatasetConfig(path=str(none_left), format="gsm8k", missing_answer="skip"), tokenizer)


@pytest.mark.parametrize(("records", "data_format"), [
    ([{"prompt": "3+4=", "gt_answer": "7"}, {"input_token_ids": [3, 74, 3, 82], "gt_answer": "2"},
      {"prompt": "Sum: 12+30=", "gt_answer": "42", "source": "demo"}], "generic"),
    (GSM8K_RECORDS, "gsm8k"),
    (MATH_RECORDS, "math"),
])
def test_parquet_gives_the_same_samples_as_the_same_records_in_jsonl(
    tmp_path: Path, tokenizer, records: list[dict], data_format: str
) -> None:
    # Parquet stores every column in every row: a record without `prompt` has a null there,
    # which the loader reads as a missing field, as in JSONL.
    parquet = _write_parquet(tmp_path / "data.parquet", records)
    jsonl = _write_jsonl(tmp_path / "data.jsonl", records)
    from_parquet = load_prompt_file(DatasetConfig(path=str(parquet)), tokenizer)
    from_jsonl = load_prompt_file(DatasetConfig(path=str(jsonl)), tokenizer)
    assert from_parquet.stats.format == data_format
    assert _sample_fields(from_parquet.samples) == _sample_fields(from_jsonl.samples)
    assert from_parquet.stats == from_jsonl.stats
    if data_format == "generic":
        assert _sample_fields(from_parquet.samples) == [
            (_tiny_ids("3+4="), "7", 0), ([3, 74, 3, 82], "2", 1), (_tiny_ids("Sum: 12+30="), "42", 2),
        ]


def test_parquet_errors_name_file_row_and_field(tmp_path: Path, tokenizer) -> None:
    records = [GSM8K_RECORDS[0], GSM8K_RECORDS[1], {"question": "q", "answer": "it is 3"}]
    path = _write_parquet(tmp_path / "gsm8k.parquet", records)
    with pytest.raises(DatasetError) as info:
        load_prompts(DatasetConfig(path=str(path), format="gsm8k"), tokenizer)
    assert str(info.value).startswith(f"{path}: row 2: field 'answer' has no final answer after a '####' marker")
    nulls = _write_parquet(tmp_path / "nulls.parquet", [GSM8K_RECORDS[1], {"question": None, "answer": "#### 1"}])
    with pytest.raises(DatasetError, match=re.escape(f"{nulls}: row 1: missing field 'question'")):
        load_prompts(DatasetConfig(path=str(nulls), format="gsm8k"), tokenizer)
    wrong_type = _write_parquet(tmp_path / "ints.parquet", [{"prompt": "1+1=", "gt_answer": 2}])
    with pytest.raises(DatasetError, match=re.escape(f"{wrong_type}: row 0: field 'gt_answer' must be a string, got int 2")):
        load_prompts(DatasetConfig(path=str(wrong_type)), tokenizer)
    not_parquet = _write(tmp_path / "text.parquet", [GOOD_LINE])
    with pytest.raises(DatasetError, match=re.escape(f"{not_parquet}: not a readable Parquet file")):
        load_prompts(DatasetConfig(path=str(not_parquet)), tokenizer)
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'missing.parquet'}: cannot read prompt file")):
        load_prompts(DatasetConfig(path=str(tmp_path / "missing.parquet")), tokenizer)


def test_file_type_is_chosen_by_suffix(tmp_path: Path, tokenizer) -> None:
    for suffix in (".json", ".ndjson", ".JSONL"):
        path = _write(tmp_path / f"prompts{suffix}", [GOOD_LINE])
        assert _sample_fields(load_prompts(DatasetConfig(path=str(path)), tokenizer)) == [(_tiny_ids("1+1="), "2", 0)]
    text = _write(tmp_path / "prompts.txt", [GOOD_LINE])
    with pytest.raises(DatasetError, match=re.escape(f"{text}: unknown prompt file type '.txt': expected JSON Lines")):
        load_prompts(DatasetConfig(path=str(text)), tokenizer)


def test_prompt_template_rewrites_the_question_in_plain_completion_mode(tmp_path: Path, tokenizer) -> None:
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1=?", "answer": "#### 2"}])
    config = DatasetConfig(path=str(path), prompt_template="Q: {question}\nPut it in \\boxed{{}}.\nA:")
    (sample,) = load_prompts(config, tokenizer)
    assert sample.input_token_ids == _tiny_ids("Q: 1+1=?\nPut it in \\boxed{}.\nA:")
    assert tokenizer.decode(sample.input_token_ids) == "Q: 1+1=?\nPut it in \\boxed{}.\nA:"


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"format": "jsonl"}, "DatasetConfig.format must be one of ['auto', 'generic', 'gsm8k', 'math', 'verl', 'reasoning_gym']"),
    ({"prompt_field": "problem"}, "DatasetConfig.prompt_field renames a field of a format, so it needs an explicit"),
    ({"answer_field": "answer"}, "DatasetConfig.answer_field renames a field of a format, so it needs an explicit"),
    ({"format": "math", "answer_field": ""}, "DatasetConfig.answer_field must be a non-empty field name"),
    ({"missing_answer": "ignore"}, "DatasetConfig.missing_answer must be one of ['error', 'skip']"),
    ({"system_prompt": "Be brief."}, "DatasetConfig.system_prompt needs DatasetConfig.chat_template: true"),
    ({"chat_template": True, "add_special_tokens": True}, "DatasetConfig.add_special_tokens must be false with"),
    ({"prompt_template": "{problem}"}, "DatasetConfig.prompt_template '{problem}' is not a format string"),
    ({"prompt_template": "{question} in \\boxed{}"}, "is not a format string whose only placeholder is {question}"),
    ({"prompt_template": "Solve it."}, "DatasetConfig.prompt_template 'Solve it.' must contain {question}"),
])
def test_data_config_validation_names_the_field(overrides: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        DatasetConfig(path="x.jsonl", **overrides)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with ChatML markers as special tokens (ids 98, 99) and a ChatML
    template, saved next to the model's config like a user's instruct model."""
    assert load_tokenizer(tiny_model_dir).chat_template is None
    return write_chat_model(tiny_model_dir, tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def chat_tokenizer(chat_model_dir: Path):
    return load_tokenizer(chat_model_dir)


def test_chat_tokenizer_loads_with_its_template_and_markers(chat_tokenizer) -> None:
    assert chat_tokenizer.chat_template == CHATML_TEMPLATE
    assert chat_tokenizer.convert_tokens_to_ids([IM_START, IM_END]) == [98, 99]
    assert len(chat_tokenizer) == 100


def test_chat_template_wraps_system_and_user_turns_exactly(tmp_path: Path, chat_tokenizer) -> None:
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1=", "answer": "#### 2"}])
    config = DatasetConfig(path=str(path), chat_template=True, system_prompt="Be brief.")
    (sample,) = load_prompts(config, chat_tokenizer)
    assert chat_tokenizer.decode(sample.input_token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )
    # One id per marker (no BOS added in front, no marker spelled out as characters).
    assert sample.input_token_ids == (
        [98] + _tiny_ids("system\nBe brief.") + [99] + _tiny_ids("\n")
        + [98] + _tiny_ids("user\n1+1=") + [99] + _tiny_ids("\n")
        + [98] + _tiny_ids("assistant\n")
    )
    assert sample.gt_answer == "2"


def test_chat_template_applies_the_prompt_template_first_and_no_system_turn_by_default(
    tmp_path: Path, chat_tokenizer
) -> None:
    path = _write_jsonl(tmp_path / "math.jsonl", [MATH_RECORDS[2]])
    config = DatasetConfig(path=str(path), chat_template=True, prompt_template="{question}\nBox it: \\boxed{{}}")
    (sample,) = load_prompts(config, chat_tokenizer)
    assert sample.input_token_ids == (
        [98] + _tiny_ids("user\nWhich set?\nBox it: \\boxed{}") + [99] + _tiny_ids("\n") + [98] + _tiny_ids("assistant\n")
    )
    assert sample.gt_answer == "\\{1, 2\\}"
    # The same file in plain-completion mode is the bare question.
    (plain,) = load_prompts(DatasetConfig(path=str(path)), chat_tokenizer)
    assert plain.input_token_ids == _tiny_ids("Which set?")


def test_chat_template_counts_against_max_prompt_tokens(tmp_path: Path, chat_tokenizer) -> None:
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1=", "answer": "#### 2"}])
    # 3 markers + "user\n1+1=" (9) + "\n" (1) + "assistant\n" (10) = 23 tokens, where the bare question has 4.
    (sample,) = load_prompts(DatasetConfig(path=str(path), chat_template=True, max_prompt_tokens=23), chat_tokenizer)
    assert len(sample.input_token_ids) == 23
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: prompt has 23 tokens, more than max_prompt_tokens=22")):
        load_prompts(DatasetConfig(path=str(path), chat_template=True, max_prompt_tokens=22), chat_tokenizer)


def test_chat_template_without_one_fails_before_reading_and_names_the_model(
    tmp_path: Path, tiny_model_dir: Path, tokenizer
) -> None:
    never_read = tmp_path / "does-not-exist.jsonl"
    with pytest.raises(DatasetError) as info:
        load_prompts(DatasetConfig(path=str(never_read), chat_template=True), tokenizer)
    assert str(info.value).startswith(
        f"data.chat_template is true but the tokenizer of {str(tiny_model_dir)!r} has no chat template"
    )


def test_chat_template_refuses_pre_tokenized_prompts(tmp_path: Path, chat_tokenizer) -> None:
    path = _write(tmp_path / "ids.jsonl", [GOOD_LINE, '{"input_token_ids": [3, 74, 3, 82], "gt_answer": "2"}'])
    with pytest.raises(DatasetError, match=re.escape(
            f"{path}:2: field 'input_token_ids' gives a pre-tokenized prompt, which data.chat_template")):
        load_prompts(DatasetConfig(path=str(path), chat_template=True), chat_tokenizer)


def test_a_failing_chat_template_names_the_record_and_the_model(tmp_path: Path, chat_model_dir: Path) -> None:
    # Some templates (Gemma's, Mistral's) refuse a system turn with raise_exception(...).
    strict_dir = tmp_path / "strict"
    shutil.copytree(chat_model_dir, strict_dir)
    strict = load_tokenizer(strict_dir)
    strict.chat_template = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                            "{%- endif %}" + CHATML_TEMPLATE)
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_RECORDS)
    with pytest.raises(DatasetError) as info:
        load_prompts(DatasetConfig(path=str(path), chat_template=True, system_prompt="Be brief."), strict)
    assert str(info.value).startswith(f"{path}:1: the chat template of {str(strict_dir)!r} failed:")
    assert "System role not supported" in str(info.value)


@pytest.mark.system
def test_check_command_reports_a_gsm8k_parquet_file_with_a_chat_template(tmp_path: Path, chat_model_dir: Path) -> None:
    path = _write_parquet(tmp_path / "gsm8k.parquet", [{"question": "1+1=", "answer": "#### 2"}, GSM8K_RECORDS[1]])
    done = subprocess.run(
        [sys.executable, "-m", "async_grpo.data.dataset", "check", "--path", str(path), "--model_path", str(chat_model_dir),
         "--format", "gsm8k", "--chat_template", "--system_prompt", "Be brief.", "--show", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected_prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    # 23 tokens as in the test above, plus the system turn: 2 markers + "system\nBe brief." (16) + "\n" (1).
    assert f"prompt 0 (42 tokens): {expected_prompt!r}\n  gt_answer: '2'\n" in done.stdout
    assert "ok: PromptFileStats(format='gsm8k', prompts=2" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "async_grpo.data.dataset", "check", "--path", str(path), "--model_path", str(chat_model_dir),
         "--format", "math"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2  # one line and argparse's status, as every entry point's refused input
    assert bad.stderr.splitlines()[-1] == (
        f"python -m async_grpo.data.dataset check: {path}: row 0: missing field 'solution'")


@pytest.mark.parametrize(("config_file", "records", "question", "answer", "expected_text"), [
    ("data_gsm8k_chat.yaml", GSM8K_RECORDS[1:], "A farm has 10 coops of 100 hens. How many hens?", "1000",
     "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
     "<|im_start|>user\nA farm has 10 coops of 100 hens. How many hens?<|im_end|>\n<|im_start|>assistant\n"),
    ("data_math_base.yaml", MATH_RECORDS[2:], "Which set?", "\\{1, 2\\}",
     "Problem: Which set?\nPut your final answer in \\boxed{}.\nSolution:"),
])
def test_example_data_configs_load_into_the_trainer_config_and_read_their_format(
    tmp_path: Path, chat_tokenizer, config_file: str, records: list[dict], question: str, answer: str,
    expected_text: str,
) -> None:
    from async_grpo.config.run_config import load_config
    from async_grpo.trainer.config import TrainerConfig

    path = _write_parquet(tmp_path / "data.parquet", records)
    config = load_config(TrainerConfig, ["--config", str(REPO_ROOT / "configs" / config_file),
                                         "--model.model_path", "m", "--data.path", str(path)])
    (sample,) = load_prompts(config.data, chat_tokenizer)
    assert chat_tokenizer.decode(sample.input_token_ids) == expected_text
    assert sample.gt_answer == answer
