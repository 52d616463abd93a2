"""Out of the trainer: a LoRA policy's adapter (model.lora) under PEFT names, and its config.

A LoRA policy pushes only its adapter: gathered to rank 0 (`gather_adapter`) or as every rank's
own pieces (`local_adapter_blobs`), named as adapter_model.safetensors stores them, with the
adapter_config.json text (`adapter_config_json`) that tells a worker how to apply it. The files
and the STABLE marker are adapter_files.py's. Trainer side; peft is imported only for LoRA runs.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

from async_grpo.weights.hf_checkpoint import hf_name, unwrap_causal_lm
from async_grpo.weights.trainer_gather import cast_dtype, gather_to_main, local_piece
from async_grpo.weights.update import TensorBlob, tensor_to_blob
from setup_model import LORA_ADAPTER_NAME

_ADAPTER_NAME = LORA_ADAPTER_NAME


def _peft_model(model: nn.Module) -> Any:
    """The PeftModel inside a TokenLogprobModel (or the model itself); TypeError if not one."""
    from peft import PeftModel

    inner = unwrap_causal_lm(model)
    if not isinstance(inner, PeftModel):
        raise TypeError(f"expected a LoRA (PEFT) policy, got {type(inner).__name__}: is model.lora.r set?")
    return inner


def is_lora_model(model: nn.Module) -> bool:
    """True when the policy carries PEFT adapters (fsdp_setup wrapped it under model.lora)."""
    # A PeftModel exists only once peft is imported: a full-weights run never imports it (~0.14
    # CPU-s of every trainer rank's start).
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(unwrap_causal_lm(model), peft.PeftModel)


def adapter_named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters (DTensors under FSDP) by their PEFT-format names, as
    adapter_model.safetensors stores them (the adapter name dropped: 'base_model.model.model.
    layers.0.self_attn.q_proj.lora_A.weight'). PEFT's own get_peft_model_state_dict does the
    naming, so the files match what PeftModel.save_pretrained would write."""
    from peft import get_peft_model_state_dict

    peft_model = _peft_model(model)
    trainable = {hf_name(name): p for name, p in model.named_parameters() if p.requires_grad}
    return get_peft_model_state_dict(peft_model, state_dict=trainable)


def adapter_config_json(model: nn.Module) -> str:
    """adapter_config.json of the policy's adapter, as PeftModel.save_pretrained writes it
    (inference_mode true; sets as sorted lists)."""
    import json

    config = copy.deepcopy(_peft_model(model).peft_config[_ADAPTER_NAME])
    config.inference_mode = True
    values = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.dumps(values, indent=2, sort_keys=True)


def gather_adapter(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of the adapter tensors under PEFT names on rank 0 (None elsewhere).
    Collective, like gather_full_state_dict; adapters are small (a few MB for r=16 on 7B)."""
    return gather_to_main(adapter_named_tensors(model), dtype)


def local_adapter_blobs(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, TensorBlob]:
    """This rank's own piece of every adapter tensor (no communication), cut along its DTensor
    placement's dim, under PEFT names. Adapter parameters are all FSDP-sharded, so every rank
    contributes a piece of each (possibly empty); iter_assembled over all ranks' dicts rebuilds
    gather_adapter."""
    blobs: dict[str, TensorBlob] = {}
    with torch.no_grad():
        for name, tensor in adapter_named_tensors(model).items():
            local, dim, offset = local_piece(name, tensor.detach())
            piece = local.to(cast_dtype(local, dtype))
            blobs[name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset, shard_dim=dim)
    return blobs

