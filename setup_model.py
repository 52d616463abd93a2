"""Model loading, the packed-logprob forward, and the bundled tiny model for offline runs.

Write the tiny demo/test model (random init, seeded, Hugging Face format, no network):

    python setup_model.py write-tiny-model --out_dir runs/tiny-qwen2

Everything else here is imported by the trainer (FSDP2 wrapping) and the logprob worker (plain
model): both score tokens through `TokenLogprobModel`, so they compute identical logprobs.
"""

from __future__ import annotations

import argparse
import logging
import string
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from grpo_loss import chunked_token_logprobs
from sample_processing_utils import LogprobInput

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The tiny tokenizer covers printable ASCII plus newline: enough for math prompts and answers.
_TINY_ALPHABET = string.printable[:95] + "\n"


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    """Shape of the bundled tiny Qwen2 model (defaults: the demo model, ~0.5M parameters)."""

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


def default_attn_implementation(device: torch.device) -> str:
    """flash_attention_2 on CUDA when flash-attn imports (fast packed batches), else sdpa."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            logger.warning("flash-attn not importable on CUDA; falling back to sdpa")
    return "sdpa"


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
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation=attn, use_safetensors=True
    )
    return model.to(device)


class TokenLogprobModel(nn.Module):
    """Wraps a causal LM: packed inputs in, logprobs (and entropy) of the output tokens out.

    The decoder runs on the whole packed stream with `use_cache=False`: transformers isolates
    packed samples (positions restarting at 0, no attention mask) only without a KV cache. Only
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
