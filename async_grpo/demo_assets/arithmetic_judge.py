"""The judge demo's judge as files: the tiny Qwen2 with a chat template that shows only the judged
text, and the judge template (sampling.reward.judge.template_path) that fills it with the prompt
and the answer run together ("3+4=7"). scripts/prepare_judge_demo.py trains the model; the chaos
test and benchmarks/judge_throughput.py serve it untrained.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

# What add_generation_prompt appends: one character of the char tokenizer's alphabet that the
# prompts "a+b=" never hold, so the model can tell where the judged text ends.
GENERATION_MARK = "?"
JUDGE_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- message['content'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + GENERATION_MARK + "' }}{%- endif %}"
)
# The judge template: no rubric (the tiny judge reads none), the prompt and the answer run together.
JUDGE_TEMPLATE = {"system": "", "user": "{prompt}{completion}"}
# The group-wise judge's template: the prompt, a newline, then the group's numbered answers
# ("Answer 1:\n7\n\nAnswer 2:\n12..."); short, as the char-level judge pays for every character.
JUDGE_GROUP_TEMPLATE = {"system": "", "user": "{prompt}\n{answers}"}


def add_judge_chat_template(model_dir: Path) -> Path:
    """Save JUDGE_CHAT_TEMPLATE in model_dir's tokenizer files; RuntimeError when it does not read back."""
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = JUDGE_CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    if load_tokenizer(model_dir).chat_template != JUDGE_CHAT_TEMPLATE:
        raise RuntimeError(f"the judge's chat template did not survive save_pretrained in {model_dir}")
    return model_dir


def write_judge_model(model_dir: Path, seed: int = 0, shape: TinyModelConfig | None = None) -> Path:
    """The random-init tiny Qwen2 (shape: TinyModelConfig's defaults when None; its seed is replaced
    by `seed`) with JUDGE_CHAT_TEMPLATE saved in its tokenizer files."""
    config = TinyModelConfig(seed=seed) if shape is None else replace(shape, seed=seed)
    write_tiny_model(model_dir, config)
    return add_judge_chat_template(Path(model_dir))


def write_judge_template(path: Path, group_wise: bool = False) -> Path:
    """JUDGE_TEMPLATE (JUDGE_GROUP_TEMPLATE when group_wise) as the YAML file
    sampling.reward.judge.template_path reads."""
    path.write_text(yaml.safe_dump(JUDGE_GROUP_TEMPLATE if group_wise else JUDGE_TEMPLATE, sort_keys=False))
    return path
