"""Model loading and the packed-logprob forward shared by the trainer and the logprob worker.

Both score tokens through `TokenLogprobModel`, so they compute identical logprobs. Without
flash-attn both run packed_attention.PACKED_SDPA, which attends within each packed sample (no
[T, T] block mask). The trainer shards the model with fsdp_setup.build_training_model; the
logprob worker loads it plainly with `load_causal_lm`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from async_grpo.config.model_path import check_model_dir
from async_grpo.config.worker_options import VLLM_LORA_RANKS, PromptSharingConfig
from async_grpo.model.context_parallel import CONTEXT_SHARD_KWARG, ContextGroup, kv_repeat, shard_stream
from async_grpo.model.packed_attention import (
    PACKED_SDPA, PACKED_VARLEN, register_packed_sdpa, register_packed_varlen, varlen_kwargs,
)
from async_grpo.model.prompt_sharing import SHARED_PROMPT_LAYOUT_KWARG, SharedPromptLayout
from grpo_loss import chunked_token_logprobs
from sample_processing_utils import LogprobInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FLASH_ATTENTION_2 = "flash_attention_2"
# Attention implementations that read a packed forward's sample boundaries from the decoder's
# kwargs (packed_attention.VARLEN_KWARGS): TokenLogprobModel computes them once per forward for
# these, instead of each layer rebuilding them from position ids.
VARLEN_ATTENTIONS = (FLASH_ATTENTION_2, "flash_attention_3", PACKED_SDPA, PACKED_VARLEN)
# Attention implementations that run a shared-prompt stream (packed_attention.PACKED_SDPA reads
# its layout; PACKED_VARLEN defers such a stream to it). Others would attend across answers.
PROMPT_SHARING_ATTENTIONS = (PACKED_SDPA, PACKED_VARLEN)
# Attention implementations that run a context-parallel rank's share of a stream (they call
# context_parallel.ulysses_attention when the decoder's kwargs carry a ContextShard). Others would
# attend over this rank's tokens only.
CONTEXT_PARALLEL_ATTENTIONS = (PACKED_SDPA, PACKED_VARLEN)
# flash-attn's kernels take only these input dtypes: a float32 model fails on its first batch.
_FLASH_DTYPES = (torch.bfloat16, torch.float16)

# Dtypes a model may be loaded and run in, by the name configs use.
MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# Every linear layer of a Qwen2/Llama decoder layer: what adapter-only RL usually trains.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapters on these are refused: they would need vLLM's embedding/lm_head LoRA path and the
# tied-embedding case, neither of which this project's push or tests cover.
_UNSUPPORTED_LORA_TARGETS = ("embed_tokens", "lm_head")
# PEFT's name for the one adapter a policy trains (it appears in parameter names, not in the
# saved PEFT-format files, which drop it).
LORA_ADAPTER_NAME = "default"


@dataclass(kw_only=True, frozen=True)
class LoraConfig:
    """LoRA adapter training (model.lora): r > 0 trains only adapters on a frozen base model."""

    r: int = 0
    """Adapter rank; 0 turns LoRA off (full fine-tuning). vLLM serves ranks up to its workers'
    max_lora_rank (one of 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training (0 keeps trainer and sampler logprobs equal)."""
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    """Names of the linear layers that get adapters (matched against module names by PEFT)."""

    def __post_init__(self) -> None:
        if self.r < 0:
            raise ValueError(f"LoraConfig.r must be >= 0 (0: LoRA off), got {self.r}")
        if self.r > max(VLLM_LORA_RANKS):
            raise ValueError(f"LoraConfig.r must be <= {max(VLLM_LORA_RANKS)} (vLLM's largest LoRA rank), got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoraConfig.target_modules must name at least one module")
        bad = [m for m in self.target_modules if m in _UNSUPPORTED_LORA_TARGETS]
        if bad:
            raise ValueError(f"LoraConfig.target_modules: adapters on {bad} are not supported (decoder linear "
                             f"layers only, e.g. {list(DEFAULT_LORA_TARGETS)})")

    @property
    def enabled(self) -> bool:
        """True when the policy trains LoRA adapters rather than all weights."""
        return self.r > 0

    def peft_config(self, base_model_path: str) -> Any:
        """The peft.LoraConfig of these settings; base_model_path is recorded in adapter_config.json."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules),
            bias="none", base_model_name_or_path=str(base_model_path),
        )


def apply_lora(causal_lm: nn.Module, lora: LoraConfig, base_model_path: str | Path) -> nn.Module:
    """Wrap a causal LM with PEFT LoRA adapters (in place): the base weights are frozen, only the
    adapters train. Returns the PeftModel; on a meta-device model the adapters are meta too."""
    from peft import get_peft_model

    if not lora.enabled:
        raise ValueError("apply_lora: LoraConfig.r is 0 (LoRA off)")
    return get_peft_model(causal_lm, lora.peft_config(str(base_model_path)), adapter_name=LORA_ADAPTER_NAME)


@dataclass(kw_only=True, frozen=True)
class ModelConfig(PromptSharingConfig):
    """Which checkpoint to train and how to run it; `share_prompts` is declared in
    worker_options.PromptSharingConfig, which the logprob workers read too."""

    model_path: str
    """Hugging Face checkpoint folder (safetensors), loaded with from_pretrained."""
    logprob_chunk_size: int = 1024
    """Output tokens per lm_head chunk in chunked_token_logprobs (bounds the logits' memory)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (non-reentrant) to save activation memory."""
    attn_implementation: str | None = None
    """PACKED_SDPA, 'sdpa', 'eager', 'flash_attention_2', ...; None picks default_attn_implementation(device)."""
    mixed_precision: bool = True
    """On CUDA, compute in bf16 with fp32 master weights and fp32 gradient reduction. CPU: fp32."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after forward (ZeRO-3); False keeps them until backward."""
    # For a tiny model the per-layer collectives cost more than its compute (benchmarks/RESULTS.md,
    # "One FSDP unit for a tiny model, jemalloc on the generation path").
    fsdp_per_layer_min_params: int = 10_000_000
    """Models with at least this many parameters get one FSDP unit per decoder layer; smaller ones a
    single unit, gathered whole when a forward starts and kept through its backward. 0: always per
    layer."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (lora.r > 0): only they train and are pushed; the base stays frozen."""
    # What does not run with it yet is refused at load (TrainerConfig; docs/training.md).
    context_parallel: int = 1
    """Ranks that split each minibatch's tokens (Ulysses, async_grpo/model/context_parallel.py), for
    samples longer than one rank's activations hold: a group's minibatch holds up to this x
    max_tokens_per_gpu tokens. Must divide the world size and the attention heads; not with
    share_prompts."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("ModelConfig.model_path must be set")
        if self.fsdp_per_layer_min_params < 0:
            raise ValueError(f"ModelConfig.fsdp_per_layer_min_params must be >= 0, got {self.fsdp_per_layer_min_params}")
        if self.logprob_chunk_size <= 0:
            raise ValueError(f"ModelConfig.logprob_chunk_size must be > 0, got {self.logprob_chunk_size}")
        if self.attn_implementation is not None and not self.attn_implementation:
            raise ValueError("ModelConfig.attn_implementation must be None or a non-empty name")
        if self.share_prompts and self.attn_implementation is not None:
            check_prompt_sharing(self.attn_implementation, "ModelConfig.attn_implementation")
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        if self.context_parallel < 1:
            raise ValueError(f"ModelConfig.context_parallel must be >= 1, got {self.context_parallel}")
        if self.context_parallel == 1:
            return
        if self.share_prompts:
            raise ValueError("ModelConfig.share_prompts cannot run with context_parallel > 1 (a shared prompt's "
                             "answers would need its keys on every rank): turn one off")
        if self.attn_implementation is not None:
            check_context_parallel(self.attn_implementation, "ModelConfig.attn_implementation")


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer the way vLLM does (AutoTokenizer), so both sides tokenize identically."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(model_path, weights=False)))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what makes two tokenizers interchangeable for scoring each other's tokens:
    the token -> id map and the special tokens. Models that share it can score each other's
    samples token by token (a teacher and its student)."""
    import hashlib
    import json

    content = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
               "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}}
    return hashlib.sha256(json.dumps(content, ensure_ascii=False).encode()).hexdigest()


def default_attn_implementation(device: torch.device, compute_dtype: torch.dtype = torch.bfloat16,
                                share_prompts: bool = False, context_parallel: int = 1) -> str:
    """flash_attention_2 on CUDA when flash-attn imports and the model computes in bf16/fp16
    (and prompts are not shared nor tokens split over ranks: flash-attn runs neither), else
    PACKED_SDPA (registered on demand).

    Both cost sum(len_i^2) on packed streams; plain "sdpa" would cost T^2 (see packed_attention.PACKED_SDPA).
    compute_dtype: what the attention inputs are in (bf16 under the trainer's mixed precision).
    """
    if device.type == "cuda" and compute_dtype in _FLASH_DTYPES and not share_prompts and context_parallel == 1:
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            logger.warning("flash-attn not importable on CUDA; falling back to %s", PACKED_SDPA)
    register_packed_sdpa()
    return PACKED_SDPA


def training_compute_dtype(device: torch.device, mixed_precision: bool) -> torch.dtype:
    """What the trainer computes in: bf16 on CUDA under ModelConfig.mixed_precision (fp32 master
    weights), else fp32. fsdp_setup builds the model so; weight pushes default to it."""
    return torch.bfloat16 if device.type == "cuda" and mixed_precision else torch.float32


def check_attn_dtype(attn_implementation: str | None, compute_dtype: torch.dtype, where: str) -> None:
    """Raise ValueError if an attention implementation that runs flash-attention kernels
    (flash_attention_2, or PACKED_VARLEN: torch's flash-attention varlen kernel) is asked for with
    a dtype those kernels cannot run (float32).

    where: the config field that asked for it, named in the error.
    """
    if attn_implementation in (FLASH_ATTENTION_2, PACKED_VARLEN) and compute_dtype not in _FLASH_DTYPES:
        kernels = "flash-attn" if attn_implementation == FLASH_ATTENTION_2 else "torch's flash-attention varlen kernel"
        raise ValueError(
            f"{where}={attn_implementation!r} needs bf16 or fp16 compute, but the model computes in "
            f"{str(compute_dtype).removeprefix('torch.')}: {kernels} does not run float32 models "
            f"(use {PACKED_SDPA!r}, or model.mixed_precision on a GPU)"
        )


def check_prompt_sharing(attn_implementation: str | None, where: str) -> None:
    """Raise ValueError unless `attn_implementation` runs shared-prompt streams (where: the field
    that chose it, named in the error)."""
    if attn_implementation not in PROMPT_SHARING_ATTENTIONS:
        raise ValueError(
            f"share_prompts needs {where} to be one of {list(PROMPT_SHARING_ATTENTIONS)}, got "
            f"{attn_implementation!r}: other attention implementations would let answers attend to each other"
        )


def check_context_parallel(attn_implementation: str | None, where: str) -> None:
    """Raise ValueError unless `attn_implementation` runs a context-parallel rank's share of a
    stream (where: the field that chose it, named in the error)."""
    if attn_implementation not in CONTEXT_PARALLEL_ATTENTIONS:
        raise ValueError(
            f"context parallelism needs {where} to be one of {list(CONTEXT_PARALLEL_ATTENTIONS)}, got "
            f"{attn_implementation!r}: other attention implementations would see this rank's tokens only"
        )


def load_causal_lm(
    model_path: str | Path,
    *,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a Hugging Face causal LM from safetensors with from_pretrained."""
    from transformers import AutoModelForCausalLM

    check_model_dir(model_path)
    attn = attn_implementation or default_attn_implementation(device)
    _register(attn)  # from_pretrained rejects names missing from AttentionInterface
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=attn, use_safetensors=True
    )
    return model.to(device)


def _register(attn_implementation: str) -> None:
    """Register our own attention implementations with transformers before a model names one."""
    if attn_implementation == PACKED_SDPA:
        register_packed_sdpa()
    elif attn_implementation == PACKED_VARLEN:
        register_packed_sdpa()  # PACKED_VARLEN defers to it where a mask is needed
        register_packed_varlen()


def meta_causal_lm(model_path: str | Path, *, attn_implementation: str) -> nn.Module:
    """The checkpoint's architecture with every parameter and buffer on the meta device.

    No memory and no initialisation: the trainer's ranks other than 0 build this, shard it, and
    fill it with copy_weights_from_rank0. Same config, same modules, same names as from_pretrained.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _register(attn_implementation)
    config = AutoConfig.from_pretrained(str(check_model_dir(model_path)))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


class TokenLogprobModel(nn.Module):
    """Wraps a causal LM: packed inputs in, logprobs (and entropy) of the output tokens out.

    The decoder runs on the whole packed stream with `use_cache=False`: transformers isolates
    packed samples (positions restarting at 0, no attention mask) only without a KV cache; with
    PACKED_SDPA or flash_attention_2 each sample's attention costs its own length squared. Only
    positions that predict output tokens go through the lm_head, in chunks (grpo_loss).
    This module is the FSDP root in training, so its forward drives FSDP2's unshard hooks.
    causal_lm may be a PEFT LoRA model (ModelConfig.lora): PeftModel forwards get_decoder and
    get_output_embeddings to the wrapped model, whose linear layers then carry the adapters.
    With a `context` group (ModelConfig.context_parallel > 1; fsdp_setup builds it) every rank of
    the group receives the same inputs, runs the decoder on its share of the stream and returns
    the logprobs of the output tokens it scores (async_grpo.model.context_parallel.local_batch
    cuts the loss's tensors to match).
    """

    def __init__(self, causal_lm: nn.Module, logprob_chunk_size: int = 1024,
                 context: ContextGroup | None = None) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.logprob_chunk_size = logprob_chunk_size
        self.context = context
        if context is not None:
            config = causal_lm.config
            kv_repeat(config.num_attention_heads, config.num_key_value_heads, context.size)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        output_indices: torch.Tensor,
        shared_prompts: SharedPromptLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/position_ids: [T]; targets/output_indices: [O] (LogprobInput's fields).
        Returns ([O] logprobs of the targets, [O] entropy at the positions that predict them).

        With a varlen-aware attention (VARLEN_ATTENTIONS) the samples' boundaries are computed
        here, once, and every layer receives them (cu_seq_lens_q/k, max_length_q/k). A stream
        whose answers share their prompts (shared_prompts) passes its layout down instead, which
        only PROMPT_SHARING_ATTENTIONS honour.
        """
        decoder = self.causal_lm.get_decoder()
        if self.context is not None and self.context.size > 1:
            return self._split_forward(decoder, input_ids, position_ids, targets, output_indices, shared_prompts)
        position_ids = position_ids.unsqueeze(0)
        if shared_prompts is not None:
            check_prompt_sharing(self.attn_implementation(), "the model's attn_implementation")
            packed: dict[str, Any] = {SHARED_PROMPT_LAYOUT_KWARG: shared_prompts}
        elif self.attn_implementation() in VARLEN_ATTENTIONS:
            packed = varlen_kwargs(position_ids)
        else:
            packed = {}
        hidden = decoder(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids, use_cache=False, **packed
        ).last_hidden_state[0]
        return chunked_token_logprobs(
            hidden[output_indices], self.causal_lm.get_output_embeddings(), targets, self.logprob_chunk_size,
        )

    def _split_forward(self, decoder: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       targets: torch.Tensor, output_indices: torch.Tensor,
                       shared_prompts: SharedPromptLayout | None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward on this rank's share of the stream: ([O_local] logprobs, [O_local] entropy)."""
        if shared_prompts is not None:
            raise ValueError("a shared-prompt stream cannot be split over ranks (ModelConfig.share_prompts "
                             "with context_parallel > 1)")
        check_context_parallel(self.attn_implementation(), "the model's attn_implementation")
        shard = shard_stream(position_ids, self.context, varlen_kwargs(position_ids))
        mine = shard.positions
        hidden = decoder(
            input_ids=input_ids[mine].unsqueeze(0), position_ids=position_ids[mine].unsqueeze(0), use_cache=False,
            **{CONTEXT_SHARD_KWARG: shard},
        ).last_hidden_state[0]
        scored, rows = shard.scored_here(output_indices)
        return chunked_token_logprobs(
            hidden[rows], self.causal_lm.get_output_embeddings(), targets[scored], self.logprob_chunk_size,
        )

    def attn_implementation(self) -> str | None:
        """The attention implementation the causal LM runs (its config's)."""
        return getattr(self.causal_lm.config, "_attn_implementation", None)

    def score(self, inputs: LogprobInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward on a LogprobInput, moving it to the model's device."""
        device = next(self.parameters()).device
        return self(
            inputs.input_ids.to(device),
            inputs.position_ids.to(device),
            inputs.targets.to(device),
            inputs.output_indices.to(device),
            inputs.shared_prompts,
        )
