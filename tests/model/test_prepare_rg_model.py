"""scripts/prepare_rg_model.py: its config is checked, its warm-up prompts are seeded and match the
configs it serves, and a tiny warm-up writes a safetensors model that loads and differs from the
random initialisation."""

from __future__ import annotations

import importlib.util
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from async_grpo.data.reasoning_gym_tasks import ReasoningGymConfig, reasoning_gym_records
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from setup_model import load_causal_lm, load_tokenizer
from support.paths import REPO_ROOT


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("prepare_rg_model", REPO_ROOT / "scripts" / "prepare_rg_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the config's annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("field, value", [("prompt_template", "{q}="), ("warmup_steps", 0),
                                          ("warmup_batch_size", 0), ("warmup_lr", 0.0),
                                          ("read_fraction", 1.5), ("read_fraction", -0.1), ("report_samples", -1),
                                          ("read_marker", "="), ("read_marker", "??")])
def test_bad_config_names_the_field(script: ModuleType, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"PrepareRgModelConfig.{field}"):
        script.PrepareRgModelConfig(out_dir="x", **{field: value})


def test_warmup_prompts_are_seeded_and_in_the_trained_format(script: ModuleType) -> None:
    args = script.PrepareRgModelConfig(out_dir="x", seed=0)
    first, again = script.warmup_prompts(args), script.warmup_prompts(args)
    assert first == again
    assert first != script.warmup_prompts(script.PrepareRgModelConfig(out_dir="x", seed=1))
    assert all(p.startswith("Calculate ") and p.endswith(".=") for p in first)
    # Warm-up prompts are drawn with a seed of their own, not the training configs' seed 0 (the
    # same sums recur, as there are only 121, but not the same sequence).
    training = reasoning_gym_records(ReasoningGymConfig(tasks=("basic_arithmetic",), size=len(first), seed=0,
                                                        options=args.options))
    assert first != [args.prompt_template.format(question=r["question"]) for r in training]


def test_random_answers_cover_exactly_the_tasks_answer_range(script: ModuleType) -> None:
    """MAX_ANSWER is written by hand: check it against the answers reasoning-gym generates."""
    config = ReasoningGymConfig(tasks=("basic_arithmetic",), size=2000, seed=0, options=script.DEFAULT_OPTIONS)
    answers = {int(r["answer"]) for r in reasoning_gym_records(config)}
    assert min(answers) == 0 and max(answers) == script.MAX_ANSWER


def test_tiny_warmup_writes_a_loadable_changed_model(script: ModuleType, tmp_path: Path) -> None:
    argv = ["--out_dir", str(tmp_path / "a"), "--warmup_steps", "2", "--warmup_batch_size", "4", "--report_samples", "0"]
    script.main(argv)
    model_dir = tmp_path / "a" / "model"
    assert (model_dir / "model.safetensors").is_file()
    warmed = load_causal_lm(model_dir)  # the real loading path the recipes use
    initial = load_file(write_tiny_model(tmp_path / "init", TinyModelConfig(seed=0)) / "model.safetensors")
    saved = load_file(model_dir / "model.safetensors")
    assert saved.keys() == initial.keys()
    assert any(not torch.equal(saved[k], initial[k]) for k in saved), "the warm-up left every weight unchanged"
    loaded = dict(warmed.state_dict())
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    # Seeded: the same command writes the same weights.
    script.main(["--out_dir", str(tmp_path / "b"), "--warmup_steps", "2", "--warmup_batch_size", "4",
                 "--report_samples", "0"])
    again = load_file(tmp_path / "b" / "model" / "model.safetensors")
    assert all(torch.equal(saved[k], again[k]) for k in saved)


def test_reading_examples_give_the_operands_never_the_sum(script: ModuleType) -> None:
    """Reading examples are the question with the marker, answered with the operands as the
    question writes them (parsed here from the question text, not from the metadata the script
    reads), and never with the sum (the skill GRPO must find)."""
    args = script.PrepareRgModelConfig(out_dir="x", read_fraction=0.5)
    records = script.warmup_records(args)
    assert len(records) == 1000
    for record in records:
        prompt, completion = script.reading_example(record, "?")
        match = re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", record["question"])
        assert match, record["question"]
        assert prompt == record["question"] + "?"
        assert completion == f"{match.group(1)},{match.group(2)}"
        assert completion != record["answer"]


def test_read_fraction_mixes_reading_examples_into_each_batch(script: ModuleType, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's batches hold reading prompts ("?") at about read_fraction, the rest "=" prompts
    answered with a number in 0..MAX_ANSWER; read_fraction 0 gives no reading prompt."""
    seen: dict[float, list[tuple[str, str]]] = {}

    def record_batches(model_dir, make_batch, steps, lr, seed, **kwargs) -> None:
        tokenizer = load_tokenizer(tiny_dir)
        rng = random.Random(seed)
        seen[fraction] = [(tokenizer.decode(s.input_token_ids), tokenizer.decode(s.output_token_ids[:-1]))
                          for _ in range(steps) for s in make_batch(tokenizer, rng)]

    tiny_dir = write_tiny_model(tmp_path / "m", TinyModelConfig(seed=0))
    monkeypatch.setattr(script, "supervised_warm_up", record_batches)
    for fraction in (0.0, 0.5):
        args = script.PrepareRgModelConfig(out_dir="x", read_fraction=fraction, warmup_steps=20)
        script.warm_up(tiny_dir, script.warmup_records(args), args)
    assert not any(prompt.endswith("?") for prompt, _ in seen[0.0])
    reading = [(p, c) for p, c in seen[0.5] if p.endswith("?")]
    answering = [(p, c) for p, c in seen[0.5] if p.endswith("=")]
    assert len(reading) + len(answering) == 20 * 64
    assert 0.4 < len(reading) / (20 * 64) < 0.6
    assert all(re.fullmatch(r"\d+,\d+", c) for _, c in reading)
    assert all(0 <= int(c) <= script.MAX_ANSWER for _, c in answering)


def test_starting_accuracy_counts_each_distinct_question_once(script: ModuleType, tmp_path: Path) -> None:
    """With a scripted decoder (reads the operands back only when the first is even; answers every
    sum right greedily and wrong when sampled, except for sums of 0 + b), the report's shares are the
    counts worked out here from the questions themselves."""
    model_dir = write_tiny_model(tmp_path / "m", TinyModelConfig(seed=0))
    def scripted(model, tok, prompt: list[int], sample: bool, max_new_tokens: int = 4) -> str:
        a, b = map(int, re.findall(r"\d+", tok.decode(prompt)))
        if tok.decode(prompt).endswith("?"):
            return f"{a},{b}" if a % 2 == 0 else "x"
        return str(a + b) if not sample or a == 0 else "-1"

    args = script.PrepareRgModelConfig(out_dir="x", report_samples=3)
    records = script.warmup_records(args)
    pairs = {tuple(map(int, re.findall(r"\d+", r["question"]))) for r in records}
    report = script.starting_accuracy(model_dir, records, args, complete=scripted)
    assert report["questions"] == len(pairs) == 121  # every sum of two numbers 0-10 occurs
    assert report["reads_operands"] == sum(a % 2 == 0 for a, _ in pairs) / len(pairs)
    assert report["sum_greedy"] == 1.0
    assert report["sum_sampled"] == sum(a == 0 for a, _ in pairs) / len(pairs)
