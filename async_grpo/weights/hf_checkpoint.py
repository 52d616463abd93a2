"""The policy's weights under Hugging Face names, and Hugging Face folders on disk.

Both ends of every transport name tensors as HF checkpoints do (`hf_tensors`: the trainer's
wrapper prefix dropped, each tied tensor once), so the engines load the names they loaded from
the checkpoint. `write_hf_folder` writes a loadable folder (config, one safetensors file, the
source's tokenizer files). Shared by both sides.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from setup_model import TokenLogprobModel

def write_safetensors(state_dict: Mapping[str, torch.Tensor], path: Path) -> Path:
    """Write tensors to a safetensors file atomically (temp name, then rename), with the 'pt'
    format tag that transformers' loader checks."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


# Attribute prefix of the causal LM inside TokenLogprobModel; HF checkpoint names lack it.
_WRAPPER_PREFIX = "causal_lm."
# Files copied verbatim from the source checkpoint on export: everything a tokenizer (and
# generation defaults) may be made of, but never weights or config, which export writes itself.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
WEIGHTS_FILE = "model.safetensors"  # a single-file checkpoint, as from_pretrained and vLLM expect


def hf_name(name: str) -> str:
    """Checkpoint name of a parameter of TokenLogprobModel (or of a bare causal LM)."""
    return name.removeprefix(_WRAPPER_PREFIX)


def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers under HF names, each tied tensor once.

    state_dict lists a tied tensor under every name; only the first is kept, which for a causal
    LM is 'model.embed_tokens.weight' (the input embedding is registered before lm_head), the
    name tied HF checkpoints store. safetensors refuses to save one tensor twice anyway.
    """
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[hf_name(name)] = tensor
    return tensors


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a TokenLogprobModel (or the model itself)."""
    return model.causal_lm if isinstance(model, TokenLogprobModel) else model


def inference_config(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> Any:
    """A copy of the model's HF config as a saved folder stores it: KV cache on (training turned
    it off; inference engines want it back) and the dtype of the saved tensors."""
    config = copy.deepcopy(unwrap_causal_lm(model).config)
    config.use_cache = True
    config.dtype = next(iter(weights.values())).dtype
    return config


def write_hf_folder(weights: Mapping[str, torch.Tensor], config: Any, out: Path, source_model_path: str) -> None:
    """config.json, model.safetensors and the source's tokenizer files: a loadable HF folder."""
    config.save_pretrained(out)
    write_safetensors(dict(weights), out / WEIGHTS_FILE)
    source = Path(source_model_path)
    for file_name in TOKENIZER_FILES:
        if (source / file_name).is_file():
            shutil.copy2(source / file_name, out / file_name)

