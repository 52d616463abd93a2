"""dataset.py: JSONL prompt loading (with the real tiny tokenizer), the arithmetic generator, the sampler."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest

from dataset import (
    DatasetConfig,
    DatasetError,
    InfiniteDistributedSampler,
    load_prompt_file,
    load_prompts,
    write_arithmetic_dataset,
    write_arithmetic_table,
)
from setup_model import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
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


def test_arithmetic_cli_writes_the_same_file(tmp_path: Path) -> None:
    out = tmp_path / "cli.jsonl"
    subprocess.run(
        [sys.executable, "dataset.py", "write-arithmetic", "--out", str(out), "--num_samples", "20", "--seed", "7"],
        check=True, cwd=REPO_ROOT, capture_output=True, timeout=120,
    )
    assert out.read_bytes() == write_arithmetic_dataset(tmp_path / "api.jsonl", num_samples=20, seed=7).read_bytes()


def test_sampler_ranks_are_disjoint_within_each_epoch() -> None:
    num_items, world_size = 11, 3  # 11 % 3 = 2 items dropped per epoch
    samplers = [InfiniteDistributedSampler(num_items, rank, world_size, seed=5) for rank in range(world_size)]
    for epoch in range(4):
        shards = [s.next_batch(3) for s in samplers]
        drawn = [i for shard in shards for i in shard]
        assert len(set(drawn)) == 9, f"epoch {epoch}: ranks overlap: {shards}"
        assert all(0 <= i < num_items for i in drawn)
        assert all(s.epoch == epoch for s in samplers)
    assert samplers[0].next_batch(1) and samplers[0].epoch == 4


def test_sampler_is_deterministic_and_reshuffles_each_epoch() -> None:
    a = InfiniteDistributedSampler(20, 1, 2, seed=0).next_batch(40)
    b = InfiniteDistributedSampler(20, 1, 2, seed=0).next_batch(40)
    c = InfiniteDistributedSampler(20, 1, 2, seed=1).next_batch(40)
    assert a == b and a != c
    epochs = [a[i : i + 10] for i in range(0, 40, 10)]
    assert all(len(set(e)) == 10 for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    single = InfiniteDistributedSampler(6, 0, 1, seed=0)
    assert sorted(single.next_batch(6)) == list(range(6))  # world_size 1: every item once per epoch
    assert list(islice(iter(InfiniteDistributedSampler(20, 1, 2, seed=0)), 40)) == a


@pytest.mark.parametrize("drawn_before_save", [0, 7, 10, 23])
def test_sampler_resumes_exactly_from_a_json_state(drawn_before_save: int) -> None:
    original = InfiniteDistributedSampler(20, 0, 2, seed=9)
    original.next_batch(drawn_before_save)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = InfiniteDistributedSampler(20, 0, 2, seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_batch(25) == original.next_batch(25)


def test_one_ranks_state_resumes_every_rank() -> None:
    rank0, rank1 = (InfiniteDistributedSampler(20, r, 2, seed=2) for r in (0, 1))
    rank0.next_batch(13)
    rank1.next_batch(13)
    resumed1 = InfiniteDistributedSampler(20, 1, 2, seed=2)
    resumed1.load_state_dict(rank0.state_dict())
    assert resumed1.next_batch(15) == rank1.next_batch(15)


def test_sampler_rejects_mismatched_state_and_bad_arguments() -> None:
    sampler = InfiniteDistributedSampler(20, 0, 2, seed=0)
    for name, value in (("seed", 1), ("num_items", 21), ("world_size", 4)):
        with pytest.raises(ValueError, match=f"{name} is {value}"):
            sampler.load_state_dict({**sampler.state_dict(), name: value})
    with pytest.raises(ValueError, match="position"):
        sampler.load_state_dict({**sampler.state_dict(), "position": 11})
    with pytest.raises(ValueError, match="num_items"):
        InfiniteDistributedSampler(1, 0, 2, seed=0)
    with pytest.raises(ValueError, match="rank"):
        InfiniteDistributedSampler(10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="k must be"):
        sampler.next_batch(-1)
