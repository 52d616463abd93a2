"""The bundled tiny model: a seeded, random-init Qwen2 and its byte-level tokenizer, for offline runs.

No model hub is reachable in tests or the demo, so they write this model to a folder and load it
through the same `from_pretrained` path a user's checkpoint takes (setup_model.load_causal_lm):

    python tiny_model.py --out_dir runs/tiny-qwen2 [--seed 0] [--tie_word_embeddings true]
"""

from __future__ import annotations

import logging
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

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


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
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


@dataclass(kw_only=True, frozen=True)
class WriteTinyModelConfig:
    """Command line of `python tiny_model.py`."""

    out_dir: str = ""
    """Folder to write the checkpoint and tokenizer to."""
    model: TinyModelConfig = TinyModelConfig()
    """Shape and seed of the model (--model.seed, --model.hidden_size, ...)."""

    def __post_init__(self) -> None:
        if not self.out_dir:
            raise ValueError("WriteTinyModelConfig.out_dir must be set (--out_dir)")


def main(argv: list[str] | None = None) -> None:
    from run_config import load_config

    config = load_config(WriteTinyModelConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_tiny_model(config.out_dir, config.model)


if __name__ == "__main__":
    main()
