"""Model loading, the packed-logprob forward, and the bundled tiny model for offline runs.

Write the tiny demo/test model (random init, seeded, Hugging Face format, no network):

    python setup_model.py write-tiny-model --out_dir runs/tiny-qwen2

Everything else here is imported by the trainer (FSDP2 wrapping) and the logprob worker (plain
model): both score tokens through `TokenLogprobModel`, so they compute identical logprobs.
Without flash-attn both run PACKED_SDPA, an attention registered with transformers here that
attends within each packed sample (no [T, T] block mask).

Trainer side, in order: `init_distributed` (torchrun env -> process group), `build_training_model`
(from_pretrained on rank 0 and a meta skeleton elsewhere, FSDP2 per decoder layer and at the
root, `copy_weights_from_rank0`), `build_optimizer`/`build_scheduler`,
then per step `gather_full_state_dict` or `local_shard_blobs` to publish weights and
`export_hf_checkpoint` to save. The logprob worker loads published weights with
`load_state_dict_into`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import math
import os
import shutil
import string
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal, Mapping

import torch
import torch.distributed as dist
from torch import nn

import weight_sync
from grpo_loss import chunked_token_logprobs
from sample_processing_utils import LogprobInput

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The tiny tokenizer covers printable ASCII plus newline: enough for math prompts and answers.
_TINY_ALPHABET = string.printable[:95] + "\n"


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    """Shape of the bundled tiny Qwen2 model (defaults: the demo model, 0.32M parameters)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen2)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 1024
    """Longest sequence (prompt + output) the model accepts."""
    tie_word_embeddings: bool = False
    """Share input embedding and lm_head weights (as Qwen2.5 0.5B/1.5B do)."""
    seed: int = 0
    """Seed of the random initialisation."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"TinyModelConfig.hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyModelConfig.num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_tiny_tokenizer():
    """A character-level tokenizer that is a byte-level BPE with no merges.

    transformers 5 loads any folder whose config says `qwen2` with `Qwen2Tokenizer` (a byte-level
    BPE) whatever the tokenizer files declare; writing ours in that same form makes the forced
    class reproduce it exactly (spaces included), in transformers and in vLLM alike.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    symbols = [EOS_TOKEN, PAD_TOKEN] + [byte_chars[ord(c)] for c in _TINY_ALPHABET]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def write_tiny_model(out_dir: str | Path, config: TinyModelConfig = TinyModelConfig()) -> Path:
    """Write a randomly initialised tiny Qwen2 causal LM and its tokenizer in HF format."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("wrote tiny Qwen2 (%d parameters) to %s", sum(p.numel() for p in model.parameters()), out)
    return out


def load_tokenizer(model_path: str | Path):
    """Load the tokenizer the way vLLM does (AutoTokenizer), so both sides tokenize identically."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


# --------------------------------------------------------------------------------------------
# Packed attention without flash-attn: causal sdpa per sample, plugged into transformers.
# --------------------------------------------------------------------------------------------

PACKED_SDPA = "packed_sdpa"
"""attn_implementation name of the packed-aware sdpa below, as registered by register_packed_sdpa.

Plain "sdpa" runs a packed stream (positions restarting, no attention_mask) as one [T, T]
attention under a block-diagonal mask that transformers materialises: T^2 work and memory.
PACKED_SDPA runs causal sdpa on each sample instead (sum of len_i^2, no mask), and defers to
plain sdpa whenever a mask is needed (padding, KV-cache decoding), so `generate` and padded
batches behave exactly as with "sdpa".
"""


@dataclass(frozen=True, slots=True)
class PackedSegments:
    """Where the samples of a (flattened) batch lie, read from its position ids."""

    starts: tuple[int, ...]
    """Offset of each sample in the flattened [B * T] token stream, ascending; starts[0] == 0."""
    lengths: tuple[int, ...]
    """Tokens in each sample; they sum to B * T."""


def packed_segments(position_ids: torch.Tensor, batch_size: int) -> PackedSegments:
    """Samples of a [B, T] (or broadcastable [1, T]) position-id tensor, rows laid end to end.

    A sample starts at every row start and wherever a position is not its predecessor + 1 (a
    restart at 0 in our packed streams): the rule transformers' find_packed_sequence_indices
    uses to build its block mask, so both paths isolate exactly the same samples.
    """
    positions = position_ids.expand(batch_size, -1)
    is_start = torch.ones_like(positions, dtype=torch.bool)
    is_start[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    starts = is_start.flatten().nonzero().flatten().tolist()  # the one host sync of a forward
    ends = starts[1:] + [positions.numel()]
    return PackedSegments(starts=tuple(starts), lengths=tuple(end - start for start, end in zip(starts, ends)))


# Layout of the last position-id tensor seen, keyed on the tensor object and its in-place
# version: every decoder layer (and gradient checkpointing's recompute) receives the same tensor,
# so a forward pays packed_segments' host sync, and builds its length groups, once rather than
# once per layer. A single tuple, so threads that forward concurrently (the logprob worker) at
# worst recompute it. The dict holds length_groups per device, filled on first use.
_last_layout: tuple[torch.Tensor, int, int, PackedSegments, dict[torch.device, LengthGroups]] | None = None


def _layout_of(
    position_ids: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, int, int, PackedSegments, dict[torch.device, LengthGroups]]:
    """The cache entry for position_ids, recomputed unless given the same, unmodified tensor."""
    global _last_layout
    cached = _last_layout
    if (
        cached is not None
        and cached[0] is position_ids
        and cached[1] == position_ids._version
        and cached[2] == batch_size
    ):
        return cached
    _last_layout = (position_ids, position_ids._version, batch_size, packed_segments(position_ids, batch_size), {})
    return _last_layout


def _segments_of(position_ids: torch.Tensor, batch_size: int) -> PackedSegments:
    """packed_segments, reusing the last result when given the same, unmodified tensor."""
    return _layout_of(position_ids, batch_size)[3]


def _length_groups_of(position_ids: torch.Tensor, batch_size: int, device: torch.device) -> LengthGroups:
    """length_groups of _segments_of(position_ids, batch_size), built once per forward and device."""
    _, _, _, segments, by_device = _layout_of(position_ids, batch_size)
    if device not in by_device:
        by_device[device] = length_groups(segments, device)
    return by_device[device]


def _sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] bool: causal, and each query sees only its `window` latest keys (itself included)."""
    offsets = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return ((offsets >= 0) & (offsets < window))[None, None]


@dataclass(frozen=True, slots=True)
class LengthGroups:
    """The tokens of a packed stream reordered so that samples of equal length sit together.

    Per-sample slices would cost a full-size zero fill each in backward (SliceBackward), which
    is quadratic in the number of samples; one index_select in and one out costs O(tokens).
    """

    order: torch.Tensor
    """[B * T] long: stream positions, grouped by sample length (a permutation)."""
    inverse: torch.Tensor
    """[B * T] long: where each stream position landed in `order`."""
    groups: tuple[tuple[int, int], ...]
    """(sample length, number of samples) of each group, in `order`'s order."""


def length_groups(segments: PackedSegments, device: torch.device) -> LengthGroups:
    """Group the samples of `segments` by length, as index tensors on `device`."""
    by_length: dict[int, list[int]] = {}
    for start, length in zip(segments.starts, segments.lengths):
        by_length.setdefault(length, []).append(start)
    pieces, groups = [], []
    for length, starts in by_length.items():
        offsets = torch.arange(length, dtype=torch.long)
        pieces.append((torch.tensor(starts, dtype=torch.long)[:, None] + offsets[None, :]).flatten())
        groups.append((length, len(starts)))
    order = torch.cat(pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return LengthGroups(order=order.to(device), inverse=inverse.to(device), groups=tuple(groups))


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry for PACKED_SDPA: causal sdpa on each packed sample.

    query: [B, H, T, D]; key, value: [B, H_kv, T, D] (H_kv divides H: GQA is left to sdpa's
    enable_gqa or transformers' repeat_kv, as plain sdpa does). kwargs carry what the decoder
    layer forwards, position_ids [B or 1, T] among them. Returns ([B, T, H, D], None) like
    transformers' sdpa_attention_forward, which it defers to when there is a mask to honour,
    no position ids, a KV cache (queries and keys differ in length) or non-causal attention.
    Samples of equal length share one batched sdpa call.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2] or not causal:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, length, head_dim = query.shape
    segments = _segments_of(position_ids, batch)
    if len(segments.starts) == batch and (sliding_window is None or length <= sliding_window):
        # One sample per row: exactly plain causal sdpa.
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)

    # [B, H, T, D] -> [B * T, H, D]: undoes the decoder's transpose, a view in the usual layout.
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], head_dim) for t in (query, key, value))
    plan = _length_groups_of(position_ids, batch, query.device)
    group_sizes = [segment_length * count for segment_length, count in plan.groups]
    q_groups, k_groups, v_groups = (torch.split(t.index_select(0, plan.order), group_sizes) for t in (q, k, v))
    outputs = []
    for (segment_length, count), q_group, k_group, v_group in zip(plan.groups, q_groups, k_groups, v_groups):
        # [n * L, H, D] -> [n, H, L, D]
        q_group, k_group, v_group = (g.view(count, segment_length, g.shape[1], head_dim).transpose(1, 2)
                                     for g in (q_group, k_group, v_group))
        mask = None
        if sliding_window is not None and segment_length > sliding_window:
            mask = _sliding_window_mask(segment_length, sliding_window, query.device)
        group_out, _ = sdpa_attention_forward(
            module, q_group, k_group, v_group, mask, dropout=dropout, scaling=scaling, **kwargs
        )  # [n, L, H, D]
        outputs.append(group_out.reshape(count * segment_length, heads, head_dim))
    return torch.cat(outputs).index_select(0, plan.inverse).view(batch, length, heads, head_dim), None


def packed_sdpa_mask(
    *,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    config=None,
    **kwargs,
) -> torch.Tensor | None:
    """AttentionMaskInterface entry for PACKED_SDPA: no mask for a whole, unpadded causal forward.

    That case (every query and key of the sequence present, no padding mask: training and
    logprob forwards) is where transformers would build the [T, T] block mask of a packed
    stream; packed_sdpa_attention gets the samples from position_ids instead. Anything else
    (padding, a KV cache, bidirectional models) gets transformers' own sdpa mask.
    """
    from transformers.masking_utils import sdpa_mask

    whole_causal_forward = (
        attention_mask is None
        and q_length == kv_length
        and isinstance(q_offset, int) and q_offset == 0
        and isinstance(kv_offset, int) and kv_offset == 0
        and getattr(config, "is_causal", True)
    )
    if whole_causal_forward:
        return None
    return sdpa_mask(
        q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        attention_mask=attention_mask, config=config, **kwargs,
    )


def register_packed_sdpa() -> None:
    """Register PACKED_SDPA with transformers' attention and mask interfaces (idempotent).

    from_pretrained(attn_implementation=PACKED_SDPA) validates the name against
    AttentionInterface, so this must run first in every process (load_causal_lm does it).
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def default_attn_implementation(device: torch.device) -> str:
    """flash_attention_2 on CUDA when flash-attn imports, else PACKED_SDPA (registered on demand).

    Both cost sum(len_i^2) on packed streams; plain "sdpa" would cost T^2 (see _packed_sdpa_attention).
    """
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            logger.warning("flash-attn not importable on CUDA; falling back to %s", PACKED_SDPA)
    register_packed_sdpa()
    return PACKED_SDPA


def load_causal_lm(
    model_path: str | Path,
    *,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a Hugging Face causal LM from safetensors with from_pretrained."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation or default_attn_implementation(device)
    if attn == PACKED_SDPA:
        register_packed_sdpa()  # from_pretrained rejects names missing from AttentionInterface
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=attn, use_safetensors=True
    )
    return model.to(device)


def meta_causal_lm(model_path: str | Path, *, attn_implementation: str) -> nn.Module:
    """The checkpoint's architecture with every parameter and buffer on the meta device.

    No memory and no initialisation: the trainer's ranks other than 0 build this, shard it, and
    fill it with copy_weights_from_rank0. Same config, same modules, same names as from_pretrained.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if attn_implementation == PACKED_SDPA:
        register_packed_sdpa()
    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


def copy_weights_from_rank0(
    causal_lm: nn.Module, full_weights: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Collective: every rank's (FSDP-sharded) model takes rank 0's weights and buffers.

    Rank 0 passes its full, unsharded parameters by name (the dict is emptied as they are sent,
    so each full tensor is freed once broadcast); the others pass None. Each tensor is broadcast
    whole in turn (peak extra memory: one full tensor) and every rank keeps its own dim-0 rows.
    Buffers (rotary frequencies, ...) are replicated, so they are broadcast as is: on a rank that
    built a meta skeleton they hold garbage until then.
    """
    rank = dist.get_rank()
    if (full_weights is not None) != (rank == 0):
        raise ValueError(f"copy_weights_from_rank0: rank {rank} must pass full weights iff it is rank 0")
    with torch.no_grad():
        for name, param in causal_lm.named_parameters():
            local, offset = _local_piece(name, param)
            if rank == 0:
                full = full_weights.pop(name)
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(f"weight {name}: full shape {tuple(full.shape)} != sharded {tuple(param.shape)}")
                whole = full.to(device=device, dtype=param.dtype)
            else:
                whole = torch.empty(param.shape, dtype=param.dtype, device=device)
            dist.broadcast(whole, src=0)
            if rank != 0:
                local.copy_(whole[offset : offset + local.shape[0]])
        for buffer in causal_lm.buffers():
            dist.broadcast(buffer, src=0)


class TokenLogprobModel(nn.Module):
    """Wraps a causal LM: packed inputs in, logprobs (and entropy) of the output tokens out.

    The decoder runs on the whole packed stream with `use_cache=False`: transformers isolates
    packed samples (positions restarting at 0, no attention mask) only without a KV cache; with
    PACKED_SDPA or flash_attention_2 each sample's attention costs its own length squared. Only
    positions that predict output tokens go through the lm_head, in chunks (grpo_loss).
    This module is the FSDP root in training, so its forward drives FSDP2's unshard hooks.
    """

    def __init__(self, causal_lm: nn.Module, logprob_chunk_size: int = 1024) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.logprob_chunk_size = logprob_chunk_size

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        output_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/position_ids/labels: [T]; output_indices: [O]. Returns ([O] logprobs, [O] entropy)."""
        decoder = self.causal_lm.get_decoder()
        hidden = decoder(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False
        ).last_hidden_state[0]
        return chunked_token_logprobs(
            hidden[output_indices],
            self.causal_lm.get_output_embeddings(),
            labels[output_indices],
            self.logprob_chunk_size,
        )

    def score(self, inputs: LogprobInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward on a LogprobInput, moving it to the model's device."""
        device = next(self.parameters()).device
        return self(
            inputs.input_ids.to(device),
            inputs.position_ids.to(device),
            inputs.labels.to(device),
            inputs.output_indices.to(device),
        )


# --------------------------------------------------------------------------------------------
# Training setup: configs, process group, FSDP2 model, optimizer, schedule.
# --------------------------------------------------------------------------------------------

# Attribute prefix of the causal LM inside TokenLogprobModel; HF checkpoint names lack it.
_WRAPPER_PREFIX = "causal_lm."
# Files copied verbatim from the source checkpoint on export: everything a tokenizer (and
# generation defaults) may be made of, but never weights or config, which export writes itself.
_TOKENIZER_FILES = (
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
_WEIGHTS_FILE = "model.safetensors"  # a single-file checkpoint, as from_pretrained and vLLM expect
_SCHEDULES = ("constant", "cosine")


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate (reached at the end of warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (not to biases or norm gains)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup: step s (0-based) uses lr * (s + 1) / warmup_steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: 'constant' keeps lr; 'cosine' decays to lr * min_lr_ratio at total_steps."""
    total_steps: int = 1000
    """Step at which the cosine schedule reaches its floor (it stays there afterwards)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each step; math.inf measures without clipping."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"OptimConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ValueError(f"OptimConfig.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"OptimConfig.schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.total_steps ({self.total_steps}) must exceed warmup_steps "
                f"({self.warmup_steps}) for the cosine schedule"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"OptimConfig.max_grad_norm must be > 0, got {self.max_grad_norm}")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """Which checkpoint to train and how to run it."""

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

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("ModelConfig.model_path must be set")
        if self.logprob_chunk_size <= 0:
            raise ValueError(f"ModelConfig.logprob_chunk_size must be > 0, got {self.logprob_chunk_size}")
        if self.attn_implementation is not None and not self.attn_implementation:
            raise ValueError("ModelConfig.attn_implementation must be None or a non-empty name")


@dataclass(frozen=True, slots=True)
class DistInfo:
    """This process's place in the training job, as init_distributed found it."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of training processes."""
    local_rank: int
    """Rank on this node; picks the CUDA device."""
    device: torch.device
    """Device this rank computes on (cuda:local_rank, or cpu)."""
    backend: str
    """Process-group backend: 'nccl' on CUDA, 'gloo' on CPU."""

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs and writes files."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    """An integer from the environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


def init_distributed(timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the default process group from torchrun's environment.

    Without torchrun (no WORLD_SIZE) this makes a one-process group over an in-memory store, so
    FSDP2 and the collective helpers below work unchanged. timeout_s bounds every collective: a
    rank that died makes the others raise instead of waiting forever. Idempotent.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if dist.is_initialized():
        return DistInfo(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
            device=device, backend=dist.get_backend(),
        )
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    logger.info("rank %d/%d (local %d) joined on %s with %s", rank, world_size, local_rank, device, backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def build_training_model(model_config: ModelConfig, dist_info: DistInfo) -> TokenLogprobModel:
    """Load the HF model (rank 0 reads it, the others receive their shards) and shard it with
    FSDP2: one group per decoder layer, then the root.

    The root group is the TokenLogprobModel wrapper, not the causal LM: its forward reads
    lm_head's weight directly (chunked logprobs), which is gathered only while the root's
    forward runs. Parameters stay fp32; on CUDA the compute copies are bf16.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    attn = model_config.attn_implementation or default_attn_implementation(dist_info.device)
    # Only rank 0 reads the checkpoint (on CPU; fully_shard moves each shard to the device); the
    # other ranks build a parameter-less skeleton and receive their shards from it, so host
    # memory holds one full copy per node's rank 0, not one per rank.
    full_weights: dict[str, torch.Tensor] | None = None
    if dist_info.rank == 0:
        causal_lm = load_causal_lm(model_config.model_path, dtype=torch.float32, attn_implementation=attn)
        full_weights = {name: p.detach() for name, p in causal_lm.named_parameters()}
    else:
        causal_lm = meta_causal_lm(model_config.model_path, attn_implementation=attn)
    causal_lm.config.use_cache = False
    if model_config.gradient_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    causal_lm.train()
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    if dist_info.device.type == "cuda" and model_config.mixed_precision:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    for layer in causal_lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=model_config.reshard_after_forward)
    model = TokenLogprobModel(causal_lm, logprob_chunk_size=model_config.logprob_chunk_size)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if dist_info.rank != 0:
        model.to_empty(device=dist_info.device)
    if dist_info.world_size > 1:
        copy_weights_from_rank0(causal_lm, full_weights, dist_info.device)
    del full_weights
    logger.info(
        "FSDP2 model from %s: %d parameters over %d ranks",
        model_config.model_path, sum(p.numel() for p in model.parameters()), dist_info.world_size,
    )
    return model


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying biases and norm gains only hurts."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of config.lr at 0-based optimizer step `step` (see OptimConfig)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant or cosine (lr_factor); call scheduler.step() after each step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, config=config))


# --------------------------------------------------------------------------------------------
# Weights out (gather, shards, checkpoint) and in (plain model).
# --------------------------------------------------------------------------------------------


def _hf_name(name: str) -> str:
    """Checkpoint name of a parameter of TokenLogprobModel (or of a bare causal LM)."""
    return name.removeprefix(_WRAPPER_PREFIX)


def _hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
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
        tensors[_hf_name(name)] = tensor
    return tensors


def _is_main_process() -> bool:
    """Rank 0, or the only process when no process group exists (e.g. the logprob worker)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathers a DTensor (collective), returns a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gather_full_state_dict(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Full, unsharded CPU copies of every weight under HF names, on rank 0; None elsewhere.

    Collective: every rank must call it (each tensor is all-gathered in turn, so peak extra
    memory is one full tensor). dtype casts the copies (e.g. bf16 for inference); None keeps them.
    """
    main = _is_main_process()
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in _hf_tensors(model).items():
            full = _full_tensor(tensor.detach())
            if main:
                state[name] = full.to(device="cpu", dtype=dtype if dtype is not None else full.dtype, copy=True)
    return state if main else None


def fsdp_shard_extent(dim0_size: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """(dim-0 offset, row count) of one FSDP2 shard: torch.chunk's split, trailing shards empty.

    torch.chunk cuts ceil(n / k)-row pieces, so with n=5, k=4 the rows are 2, 2, 1, 0.
    """
    rows_per_shard = -(-dim0_size // num_shards)
    offset = min(shard_index * rows_per_shard, dim0_size)
    return offset, min(rows_per_shard, dim0_size - offset)


def _local_piece(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's dim-0 piece of a parameter and its row offset in the full tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"weight {name}: only 1-D FSDP meshes sharded on dim 0 are supported, got {placements}")
    local = tensor.to_local()
    offset, rows = fsdp_shard_extent(tensor.shape[0], mesh.size(), mesh.get_local_rank())
    if local.shape[0] != rows:
        raise RuntimeError(f"weight {name}: local shard has {local.shape[0]} rows, torch.chunk layout says {rows}")
    return local, offset


def local_shard_blobs(model: nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, weight_sync.TensorBlob]:
    """This rank's own dim-0 piece of every weight (no communication), as weight_sync blobs.

    weight_sync.assemble_state_dict over all ranks' dicts rebuilds gather_full_state_dict.
    A plain (unsharded) model yields whole tensors at offset 0.
    """
    blobs: dict[str, weight_sync.TensorBlob] = {}
    with torch.no_grad():
        for name, tensor in _hf_tensors(model).items():
            local, offset = _local_piece(name, tensor.detach())
            piece = local.to(dtype) if dtype is not None else local
            blobs[name] = weight_sync.tensor_to_blob(piece, global_shape=tuple(tensor.shape), dim0_offset=offset)
    return blobs


def _unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a TokenLogprobModel (or the model itself)."""
    return model.causal_lm if isinstance(model, TokenLogprobModel) else model


def export_hf_checkpoint(model: nn.Module, out_dir: str | Path, source_model_path: str | Path) -> Path | None:
    """Save the (FSDP) model as a Hugging Face checkpoint folder; collective, rank 0 writes.

    Writes config.json (the model's config, KV cache re-enabled for generation, dtype of the
    saved tensors), a single model.safetensors, and the tokenizer files of source_model_path.
    Returns the folder on rank 0, None elsewhere; all ranks return after the files exist.
    """
    state = gather_full_state_dict(model)
    out: Path | None = None
    if state is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(_unwrap_causal_lm(model).config)
        config.use_cache = True  # training turned it off; inference engines want it back
        config.dtype = next(iter(state.values())).dtype
        config.save_pretrained(out)
        weight_sync.write_safetensors(state, out / _WEIGHTS_FILE)
        source = Path(source_model_path)
        for file_name in _TOKENIZER_FILES:
            if (source / file_name).is_file():
                shutil.copy2(source / file_name, out / file_name)
        logger.info("exported %d tensors to %s", len(state), out)
    if dist.is_initialized():
        dist.barrier()
    return out


def load_state_dict_into(causal_lm: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full HF-named tensors into a plain HF model, in place (strict).

    Tied embeddings take one tensor ('model.embed_tokens.weight'), which updates lm_head too;
    an extra 'lm_head.weight' for a tied model is reported as unexpected. Raises KeyError naming
    missing and unexpected keys, ValueError on a shape mismatch; nothing is copied on error.
    """
    targets = _hf_tensors(causal_lm)
    missing = sorted(targets.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - targets.keys())
    if missing or unexpected:
        raise KeyError(f"load_state_dict_into: missing keys {missing}, unexpected keys {unexpected}")
    for name, target in targets.items():
        if tuple(state_dict[name].shape) != tuple(target.shape):
            raise ValueError(
                f"load_state_dict_into: {name} has shape {tuple(state_dict[name].shape)}, "
                f"model expects {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(state_dict[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("write-tiny-model", help="write the random-init tiny Qwen2 + tokenizer")
    tiny.add_argument("--out_dir", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tie_word_embeddings", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "write-tiny-model":
        write_tiny_model(args.out_dir, TinyModelConfig(seed=args.seed, tie_word_embeddings=args.tie_word_embeddings))


if __name__ == "__main__":
    main()
