"""A chat tokenizer for the data tests (tests/data/test_dataset.py,
tests/data/test_dataset_formats.py): the tiny model's char-level tokenizer given ChatML markers and
a ChatML template written here, as a user's instruct model carries them (independent of
async_grpo.demo_assets.tiny_model's own chat tokenizer, whose template adds Qwen's default system
prompt)."""

from __future__ import annotations

import shutil
from pathlib import Path

from setup_model import load_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Qwen's ChatML layout, without Qwen's default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_chat_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model's tokenizer with ChatML markers as special tokens (ids 98, 99) and the ChatML
    template, saved in `out` next to the model's config like a user's instruct model; returns out."""
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    shutil.copy(tiny_model_dir / "config.json", out / "config.json")
    return out
