"""Data as other frameworks publish it: verl-style Parquet (chat-message prompts, the answer under
reward_model.ground_truth, a data_source that picks the reward function), and evaluation data in
its own format. Real tiny tokenizer with a ChatML template; rewards routed through RewardConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_grpo.data.dataset import DatasetConfig, DatasetError, load_prompt_file, load_prompts
from async_grpo.config.reward_config import RewardConfig
from async_grpo.trainer.evaluation import EvalConfig, EvalDataConfig, load_eval_prompts
from setup_model import load_tokenizer
from support.chat_tokenizer import write_chat_model

CODE_TESTS = [{"input": "3\n", "output": "9\n"}]
VERL_RECORDS = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1="}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": "codecontests", "prompt": [{"role": "system", "content": "Code."},
                                               {"role": "user", "content": "n*n"}], "ability": "code",
     "reward_model": {"style": "rule", "ground_truth": CODE_TESTS}, "extra_info": {"split": "train", "index": 1}},
]


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(write_chat_model(tiny_model_dir, tmp_path_factory.mktemp("tiny-chat")))


def _write_parquet(path: Path, records: list[dict]) -> Path:
    """Records as verl's preprocessing scripts write them (pyarrow infers the nested types)."""
    import pyarrow
    import pyarrow.parquet

    # ground_truth holds a string in one row and a list in another: verl stores such columns as
    # text, so the list goes in as its JSON (the loader must read both).
    rows = [{**r, "reward_model": {**r["reward_model"], "ground_truth": r["reward_model"]["ground_truth"]
                                   if isinstance(r["reward_model"]["ground_truth"], str)
                                   else json.dumps(r["reward_model"]["ground_truth"])}} for r in records]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_reads_as_published(tmp_path: Path, chat_tokenizer) -> None:
    path = _write_parquet(tmp_path / "train.parquet", VERL_RECORDS)
    loaded = load_prompt_file(DatasetConfig(path=str(path)), chat_tokenizer)
    assert loaded.stats.format == "verl" and loaded.stats.ignored_fields == {}
    first, second = loaded.samples
    assert chat_tokenizer.decode(first.input_token_ids) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert chat_tokenizer.decode(second.input_token_ids) == (
        "<|im_start|>system\nCode.<|im_end|>\n<|im_start|>user\nn*n<|im_end|>\n<|im_start|>assistant\n")
    assert (first.gt_answer, json.loads(second.gt_answer)) == ("2", CODE_TESTS)
    assert first.record["data_source"] == "openai/gsm8k" and second.record["extra_info"]["index"] == 1


def test_verl_jsonl_with_a_structured_ground_truth_gives_its_json(tmp_path: Path, chat_tokenizer) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in VERL_RECORDS))
    samples = load_prompts(DatasetConfig(path=str(path), format="verl"), chat_tokenizer)
    assert json.loads(samples[1].gt_answer) == CODE_TESTS


@pytest.mark.parametrize("record, problem", [
    ({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, "must be a non-empty list of chat messages"),
    ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "2"}}, "prompt[0] must be {'role': str"),
    ({"prompt": [{"role": "user", "content": "1"}], "reward_model": {"style": "rule"}},
     "must be an object with a 'ground_truth'"),
])
def test_bad_verl_records_fail_with_file_line_and_field(tmp_path: Path, chat_tokenizer, record, problem) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: .*" + problem.replace("[", r"\[").replace("(", r"\(")
                       .replace("{", r"\{")):
        load_prompts(DatasetConfig(path=str(path), format="verl"), chat_tokenizer)


def test_verl_needs_a_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _write_parquet(tmp_path / "train.parquet", VERL_RECORDS[:1])
    with pytest.raises(DatasetError, match="has no chat template"):
        load_prompts(DatasetConfig(path=str(path), format="verl"), load_tokenizer(tiny_model_dir))


def test_data_source_picks_the_reward_function() -> None:
    config = RewardConfig(by_data_source=("codecontests=async_grpo.rewards.code_reward:run_tests",
                                          "openai/gsm8k=async_grpo.rewards.math_verifier:math_verify_reward"))
    assert config.functions_for(VERL_RECORDS[1]) == (("async_grpo.rewards.code_reward:run_tests",), (1.0,))
    assert config.functions_for(VERL_RECORDS[0]) == (("async_grpo.rewards.math_verifier:math_verify_reward",), (1.0,))
    assert config.functions_for({"data_source": "other"}) == ((), ())  # math-verify, the default
    assert config.functions_for(None) == ((), ())
    with pytest.raises(ValueError, match="'data_source=module:function'"):
        RewardConfig(by_data_source=("async_grpo.rewards.code_reward:run_tests",))
    with pytest.raises(ValueError, match="RewardConfig.by_data_source: reward function 'no_such_module_24:f'"):
        RewardConfig(by_data_source=("x=no_such_module_24:f",))


def test_evaluation_data_may_use_its_own_format(tmp_path: Path, chat_tokenizer) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "gt_answer": "2"}) + "\n")
    held_out = _write_parquet(tmp_path / "eval.parquet", VERL_RECORDS[:1])
    train_data = DatasetConfig(path=str(train), format="generic")
    with pytest.raises(DatasetError):  # read like the training data (generic), the verl file fails
        load_eval_prompts(EvalConfig(data=EvalDataConfig(path=str(held_out))), train_data, chat_tokenizer)
    (sample,) = load_eval_prompts(EvalConfig(data=EvalDataConfig(path=str(held_out), format="verl")), train_data,
                                  chat_tokenizer)
    assert sample.gt_answer == "2"
    with pytest.raises(ValueError, match="EvalDataConfig.prompt_field/answer_field need EvalDataConfig.format"):
        EvalDataConfig(path="x", prompt_field="q")
