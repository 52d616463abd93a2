"""The offline model builder: presets with real checkpoints' shapes, the chat tokenizer, the CLI.

The full-size presets are only built on the meta device here (shapes and parameter counts, no
memory); what is written to disk and loaded back is a scaled-down Qwen2.5 (real vocabulary and
tied embeddings, one narrow layer: ~10M parameters).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from async_grpo.demo_assets import tiny_model
from async_grpo.demo_assets.tiny_model import (
    CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, PRESETS, ShapeOverrides, TinyModelConfig, build_chat_tokenizer,
    build_model, model_shape, write_tiny_model,
)
from setup_model import load_causal_lm, load_tokenizer
from support.paths import REPO_ROOT

# One narrow layer with Qwen2.5's vocabulary and tied embeddings: 151,936 x 64 embedding rows.
SMALL_QWEN = ShapeOverrides(num_layers=1, hidden_size=64, num_heads=4, intermediate_size=128)
ROUND_TRIP_TEXTS = (
    "Natalia sold 48 clips in April, and then she sold half as many clips in May.",
    "Compute $\\frac{3}{4} + \\frac{1}{6}$. The answer is $\\boxed{\\frac{11}{12}}$.\n#### 72",
    "  leading spaces,\ttabs,\n\nblank lines and trailing space ",
    "unicode: ünïcödé, 漢字, emoji 🙂, Ελληνικά",
    f"special tokens inline: {IM_START}user\nhi{IM_END}{ENDOFTEXT}",
)


def qwen2_parameter_count(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                          tied: bool) -> int:
    """Qwen2's parameters by hand: q/k/v projections with bias, o_proj without, a SwiGLU MLP (three
    matrices), two RMSNorm gains per layer, a final norm, the embedding and (untied) lm_head."""
    head_dim = hidden // heads
    kv_width = kv_heads * head_dim
    attention = (hidden * hidden + hidden) + 2 * (hidden * kv_width + kv_width) + hidden * hidden
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * per_layer + hidden + embeddings


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def small_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("small-qwen"), model_shape("qwen2.5-0.5b", SMALL_QWEN))


def test_presets_have_the_published_shapes() -> None:
    small = PRESETS["qwen2.5-0.5b"]
    assert (small.hidden_size, small.num_layers, small.num_heads, small.num_kv_heads, small.intermediate_size) == (
        896, 24, 14, 2, 4864)
    assert (small.vocab_size, small.tie_word_embeddings, small.rope_theta, small.max_position_embeddings) == (
        151_936, True, 1e6, 32768)
    large = PRESETS["qwen2.5-1.5b"]
    assert (large.hidden_size, large.num_layers, large.num_heads, large.num_kv_heads, large.intermediate_size) == (
        1536, 28, 12, 2, 8960)
    assert (large.vocab_size, large.tie_word_embeddings, large.rope_theta) == (151_936, True, 1e6)
    assert small.tokenizer == large.tokenizer == "bpe"
    assert PRESETS["tiny"] == TinyModelConfig() == model_shape()


@pytest.mark.parametrize("preset, published", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)])
def test_parameter_count_matches_the_closed_form(preset: str, published: int, chat_tokenizer) -> None:
    shape = PRESETS[preset]
    with torch.device("meta"):
        model = build_model(shape, chat_tokenizer)
    counted = sum(p.numel() for p in model.parameters())  # tied: the shared matrix counts once
    by_hand = qwen2_parameter_count(shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
                                    shape.intermediate_size, shape.vocab_size, tied=True)
    assert counted == by_hand == published  # Qwen's model cards: 0.49B and 1.54B
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config = model.config
    assert config.vocab_size == 151_936 and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 32768
    assert config.eos_token_id == chat_tokenizer.convert_tokens_to_ids(IM_END)
    assert config.bos_token_id == config.pad_token_id == chat_tokenizer.convert_tokens_to_ids(ENDOFTEXT)


def test_scaled_preset_writes_and_loads_through_from_pretrained(small_qwen_dir: Path) -> None:
    model = load_causal_lm(small_qwen_dir)
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151_936, 64, 1)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.rope_parameters["rope_theta"] == 1e6
    assert sum(p.numel() for p in model.parameters()) == qwen2_parameter_count(64, 1, 4, 2, 128, 151_936, tied=True)
    with safe_open(str(small_qwen_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    generation = json.loads((small_qwen_dir / "generation_config.json").read_text())
    tokenizer = load_tokenizer(small_qwen_dir)
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(IM_END),
                                          tokenizer.convert_tokens_to_ids(ENDOFTEXT)]


def test_chat_tokenizer_round_trips_on_the_loading_path(small_qwen_dir: Path, chat_tokenizer) -> None:
    loaded = load_tokenizer(small_qwen_dir)  # what vLLM and the trainer use (transformers forces Qwen2Tokenizer)
    assert len(loaded) == len(chat_tokenizer) < 151_936
    assert (loaded.eos_token, loaded.pad_token) == (IM_END, ENDOFTEXT)
    for text in ROUND_TRIP_TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == chat_tokenizer(text)["input_ids"], text
        assert loaded.decode(ids) == text
    for special in (ENDOFTEXT, IM_START, IM_END):
        assert len(loaded(special)["input_ids"]) == 1
    digits = loaded.convert_ids_to_tokens(loaded("12345")["input_ids"])
    assert digits == list("12345")  # Qwen's pre-tokenizer: one token per digit


def test_chat_template_renders_chatml(small_qwen_dir: Path) -> None:
    tokenizer = load_tokenizer(small_qwen_dir)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    user = [{"role": "user", "content": "What is 3+4?"}]
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Reason step by step."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
    ]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        "<|im_start|>system\nReason step by step.<|im_end|>\n"
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
    )


@pytest.mark.system
def test_chat_tokenizer_training_is_deterministic_across_processes() -> None:
    probe = "from async_grpo.demo_assets import tiny_model; print(tiny_model.build_chat_tokenizer().backend_tokenizer.to_str())"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                          timeout=300)
    assert done.stdout.strip() == build_chat_tokenizer().backend_tokenizer.to_str()


def test_bfloat16_file_holds_the_rounded_fp32_draw(tmp_path: Path, small_qwen_dir: Path) -> None:
    bf16_dir = write_tiny_model(tmp_path / "bf16", model_shape("qwen2.5-0.5b", SMALL_QWEN), dtype="bfloat16")
    with safe_open(str(small_qwen_dir / "model.safetensors"), framework="pt") as fp32, \
            safe_open(str(bf16_dir / "model.safetensors"), framework="pt") as bf16:
        assert set(fp32.keys()) == set(bf16.keys())
        for name in fp32.keys():
            assert bf16.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(bf16.get_tensor(name), fp32.get_tensor(name).to(torch.bfloat16)), name
    assert load_causal_lm(bf16_dir, dtype=torch.bfloat16).config.vocab_size == 151_936


def test_tiny_default_is_the_demo_model(tiny_model_dir: Path) -> None:
    """conftest's tiny_model_dir (write_tiny_model's defaults) is still the char-level demo model."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (98, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (4, 2, 256)
    assert not config["tie_word_embeddings"] and config["rope_parameters"]["rope_theta"] == 10000.0
    assert (config["eos_token_id"], config["pad_token_id"]) == (0, 1)
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.convert_ids_to_tokens(tokenizer("3+4=")["input_ids"]) == list("3+4=")
    assert sum(p.numel() for p in load_causal_lm(tiny_model_dir).parameters()) == qwen2_parameter_count(
        128, 2, 4, 2, 256, 98, tied=False)


def test_cli_default_writes_the_same_files_as_write_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    tiny_model.main(["--out_dir", str(tmp_path / "cli")])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_cli_preset_with_overrides(tmp_path: Path) -> None:
    tiny_model.main(["--out_dir", str(tmp_path / "cli"), "--preset", "qwen2.5-1.5b", "--model.num_layers", "1",
                     "--model.hidden_size", "48", "--model.num_heads", "4", "--model.intermediate_size", "96",
                     "--model.seed", "3", "--dtype", "bfloat16"])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (1, 48, 96)
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (2, 151_936, True)
    assert config["dtype"] == "bfloat16"


def test_overrides_replace_only_what_they_set() -> None:
    assert {f.name for f in dataclasses.fields(ShapeOverrides)} == {f.name for f in dataclasses.fields(TinyModelConfig)}
    shallow = model_shape("qwen2.5-0.5b", ShapeOverrides(num_layers=2, tie_word_embeddings=False))
    assert shallow == dataclasses.replace(PRESETS["qwen2.5-0.5b"], num_layers=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="unknown model preset"):
        model_shape("qwen9-900b")
    with pytest.raises(ValueError, match="not divisible"):
        model_shape("qwen2.5-0.5b", ShapeOverrides(num_heads=5))
