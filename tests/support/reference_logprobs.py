"""The per-sample reference logprobs the engine, worker and trainer tests compare with: a plain
Hugging Face forward of one sample alone (no packing, no padding, no chunked lm_head: none of the
code under test), the full logits' log_softmax at the positions that predict its output tokens."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def hf_model(model_dir: str | Path, adapter: str | Path | None = None) -> torch.nn.Module:
    """The checkpoint in model_dir as a plain HF causal LM (float32, eager attention, eval mode);
    with `adapter`, that PEFT LoRA folder loaded over it (PeftModel.from_pretrained)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def reference_logprobs(model: torch.nn.Module | str | Path, prompt: list[int], output: list[int], *,
                       grad: bool = False) -> torch.Tensor:
    """[len(output)] log p(output[j] | prompt + output[:j]) under `model` (a causal LM, or a
    checkpoint folder loaded with hf_model), from one forward of prompt + output, in float32.
    grad=True keeps the autograd graph (a training reference); by default none is built."""
    if not isinstance(model, torch.nn.Module):
        model = hf_model(model)
    with contextlib.nullcontext() if grad else torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0].float()
    # Output token j sits at len(prompt) + j and is predicted by the position before it.
    predicting = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return predicting.gather(1, torch.tensor(output)[:, None])[:, 0]
