"""Random-init Qwen2 checkpoints and their tokenizers, written to a folder for offline runs.

No model hub is reachable in tests, the demo or the benchmarks, so they write a model here and
load it through the same `from_pretrained` path a user's checkpoint takes
(setup_model.load_causal_lm, setup_model.load_tokenizer):

    python -m async_grpo.demo_assets.tiny_model --out_dir runs/tiny-qwen2 [--model.seed 0] [--model.tie_word_embeddings true]
    python -m async_grpo.demo_assets.tiny_model --out_dir /dev/shm/qwen2.5-0.5b --preset qwen2.5-0.5b [--dtype bfloat16]
    python -m async_grpo.demo_assets.tiny_model --out_dir /tmp/shallow --preset qwen2.5-0.5b --model.num_layers 2

Presets (`PRESETS`):
- `tiny` (the default): the demo model, hidden 128, 2 layers, a character-level tokenizer,
  0.32M parameters.
- `qwen2.5-0.5b` (494M parameters) and `qwen2.5-1.5b` (1.54B): the shapes of Qwen2.5-0.5B and
  Qwen2.5-1.5B with random weights and a byte-level BPE tokenizer trained here
  (`build_chat_tokenizer`: Qwen's pre-tokenizer, special tokens and ChatML template; a small
  vocabulary, while the model keeps Qwen's 151,936 embedding rows, as the real checkpoints have
  more rows than their tokenizer has tokens).

`--model.<field>` overrides one field of the preset, e.g. `--model.num_layers 2` keeps the real
width and vocabulary in a shallow model. `--dtype` picks the saved weights' dtype: float32 (the
default, like the demo model; what the trainer's fp32 master weights load losslessly) or bfloat16
(half the file; the dtype Qwen ships). The weights are drawn in fp32 in either case, so the bf16
file holds the fp32 draw rounded, and the same seed gives the same model.

Memory and time: the model is drawn once in RAM in fp32 (4 bytes per parameter: 2.0 GB for
qwen2.5-0.5b, 6.2 GB for qwen2.5-1.5b) and safetensors writes it to one model.safetensors straight
from the tensors' memory. Writing qwen2.5-0.5b in fp32 peaked at 2.9 GB RSS (1.5x its weights;
the interpreter, torch and transformers take ~0.4 GB) and took 34 s on the 2-core machine;
bfloat16 adds nothing to the peak (each tensor is cast in turn and its fp32 copy freed).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import string
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2Config
    from transformers.modeling_utils import PreTrainedModel

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The tiny tokenizer covers printable ASCII plus newline: enough for math prompts and answers.
_TINY_ALPHABET = string.printable[:95] + "\n"

# Qwen's special tokens. The chat tokenizer follows Qwen2.5-Instruct: a turn ends with IM_END,
# which is its eos token; ENDOFTEXT is the document separator, used as bos and padding.
ENDOFTEXT = EOS_TOKEN
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# ChatML as Qwen2.5's tokenizer_config.json writes it (the branch without tools): a system turn
# (the default one when the conversation has none), each message as
# <|im_start|>role\ncontent<|im_end|>\n, and with add_generation_prompt the opening of the
# assistant's turn.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX): words with their
# leading space, every digit on its own, punctuation runs, newlines. transformers 5 loads any
# `qwen2` folder's tokenizer as Qwen2Tokenizer, which rebuilds this exact pipeline around the
# saved vocabulary and merges, so training with it makes the forced class reproduce ours.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Upper bound of the chat tokenizer's vocabulary. The generated corpus has a few hundred distinct
# words, so training stops earlier, at about a thousand tokens; the model's embedding keeps
# the preset's vocab_size rows either way.
_CHAT_TOKENIZER_MAX_VOCAB = 4096
_CORPUS_DOCUMENTS = 20_000  # ~3 MB of text: trains in about 2 s on one core
_CORPUS_SEED = 0

QWEN2_5_VOCAB_SIZE = 151_936

TokenizerKind = Literal["char", "bpe"]
WeightDtype = Literal["float32", "bfloat16"]
_WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True, frozen=True)
class TinyModelConfig:
    """Shape of a random-init Qwen2 model (defaults: the bundled demo model, 0.32M parameters)."""

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
    vocab_size: int | None = None
    """Rows of the embedding and lm_head; None: the tokenizer's size. Qwen2.5: 151,936."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding (Qwen2.5: 1e6)."""
    tokenizer: TokenizerKind = "char"
    """'char': printable ASCII, one token per character (the demo); 'bpe': the chat tokenizer
    (build_chat_tokenizer), a byte-level BPE with Qwen's special tokens and ChatML template."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"TinyModelConfig.hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyModelConfig.num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"TinyModelConfig.vocab_size must be >= 1 or None, got {self.vocab_size}")
        if not self.rope_theta > 0:
            raise ValueError(f"TinyModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.tokenizer not in ("char", "bpe"):
            raise ValueError(f"TinyModelConfig.tokenizer must be 'char' or 'bpe', got {self.tokenizer!r}")


# Shapes of published checkpoints, from their config.json (Qwen/Qwen2.5-0.5B: hidden 896,
# 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied, rope_theta 1e6, 32768
# positions; Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960). Qwen2.5's
# bias on q/k/v and none on o_proj is transformers' Qwen2 architecture itself.
PRESETS: dict[str, TinyModelConfig] = {
    "tiny": TinyModelConfig(),
    "qwen2.5-0.5b": TinyModelConfig(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
        max_position_embeddings=32768, tie_word_embeddings=True, vocab_size=QWEN2_5_VOCAB_SIZE,
        rope_theta=1_000_000.0, tokenizer="bpe",
    ),
    "qwen2.5-1.5b": TinyModelConfig(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
        max_position_embeddings=32768, tie_word_embeddings=True, vocab_size=QWEN2_5_VOCAB_SIZE,
        rope_theta=1_000_000.0, tokenizer="bpe",
    ),
}


@dataclass(kw_only=True, frozen=True)
class ShapeOverrides:
    """Fields that replace a preset's (None: keep the preset's). Same names as TinyModelConfig."""

    hidden_size: int | None = None
    """Width of the residual stream."""
    num_layers: int | None = None
    """Decoder layers."""
    num_heads: int | None = None
    """Attention heads."""
    num_kv_heads: int | None = None
    """Key/value heads."""
    intermediate_size: int | None = None
    """MLP width."""
    max_position_embeddings: int | None = None
    """Longest sequence the model accepts."""
    tie_word_embeddings: bool | None = None
    """Share input embedding and lm_head weights."""
    seed: int | None = None
    """Seed of the random initialisation."""
    vocab_size: int | None = None
    """Rows of the embedding and lm_head."""
    rope_theta: float | None = None
    """Base of the rotary position embedding."""
    tokenizer: TokenizerKind | None = None
    """'char' or 'bpe'."""


def model_shape(preset: str = "tiny", overrides: ShapeOverrides = ShapeOverrides()) -> TinyModelConfig:
    """The named preset with every field set in `overrides` replaced."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    changes = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)}
    return dataclasses.replace(PRESETS[preset], **{k: v for k, v in changes.items() if v is not None})


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


_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Randy",
          "Joy", "Maria", "Carlos", "Aisha", "Liam", "Sofia", "Noah", "Mei", "Omar", "Priya", "Lucas", "Emma",
          "Hiro", "Fatima", "Jonas", "Zoe", "Ivan", "Chloe", "Diego")
_ITEMS = ("apples", "clips", "marbles", "books", "pencils", "cookies", "stickers", "eggs", "shirts", "candies",
          "tickets", "flowers", "cards", "stamps", "oranges", "bottles", "boxes", "coins", "shells", "toys")
_VERBS = ("buys", "finds", "receives", "collects", "bakes", "makes", "wins", "picks")
_UNITS = (("miles", "hour"), ("pages", "day"), ("dollars", "week"), ("liters", "minute"), ("meters", "second"))
_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _math_document(rng: random.Random, kind: int) -> str:
    """One generated GSM8K- or MATH-style problem with a worked solution."""
    a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(1, 99)
    name, other, item, verb = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_VERBS)
    if kind == 0:
        return (f"{name} has {a} {item}. {name} {verb} {b} more {item} and gives {c} to {other}. "
                f"How many {item} does {name} have now?\n{name} starts with {a} {item}. After that, "
                f"{name} has {a} + {b} = {a + b} {item}. Giving {c} away leaves {a + b} - {c} = {a + b - c}.\n"
                f"#### {a + b - c}")
    if kind == 1:
        total = Fraction(a, b) + Fraction(c, a)
        frac = f"\\frac{{{total.numerator}}}{{{total.denominator}}}"
        return (f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{a}}}$.\nWe write both fractions over a common "
                f"denominator and simplify: the sum is ${frac}$. The answer is $\\boxed{{{frac}}}$.")
    if kind == 2:
        return (f"Solve for $x$: ${c}x + {a} = {c * b + a}$.\nSubtracting {a} from both sides gives "
                f"${c}x = {c * b}$. Dividing by {c}, we get $x = {b}$. Therefore, the final answer is $\\boxed{{{b}}}$.")
    if kind == 3:
        amount, per = rng.choice(_UNITS)
        return (f"A machine moves {c} {amount} per {per}. How many {amount} does it move in {b} {per}s?\n"
                f"In each {per} it moves {c} {amount}, so in {b} {per}s it moves {c} \\times {b} = {c * b} {amount}.\n"
                f"#### {c * b}")
    if kind == 4:
        return (f"What is the remainder when {a * b + c} is divided by {b}?\nSince {a * b + c} = {a} \\cdot {b} + {c}, "
                f"the remainder is {c % b}. The answer is $\\boxed{{{c % b}}}$.")
    return f"{a}+{b}={a + b}\n{a}*{c}={a * c}\n{a}-{c}={a - c}\n$\\sqrt{{{a * a}}} = {a}$"


def chat_tokenizer_corpus(num_documents: int = _CORPUS_DOCUMENTS, seed: int = _CORPUS_SEED) -> list[str]:
    """Generated math text (word problems, LaTeX solutions, arithmetic, chat phrases): the same
    list for the same arguments, on any machine (Python's `random` with a fixed seed)."""
    rng = random.Random(seed)
    documents = []
    for i in range(num_documents):
        text = _math_document(rng, i % 6)
        if i % 10 == 0:
            text = f"system\n{DEFAULT_SYSTEM_PROMPT}\nuser\n{text}\n{_INSTRUCTION}\nassistant\n"
        documents.append(text)
    return documents


@functools.cache
def _chat_tokenizer_json() -> str:
    """The trained chat tokenizer, serialised (training is deterministic; done once per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_CHAT_TOKENIZER_MAX_VOCAB,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        # Every byte is a token, so any text (any script, emoji) encodes and round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(chat_tokenizer_corpus(), trainer)
    return tokenizer.to_str()


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here, laid out as Qwen2.5-Instruct's tokenizer.

    Qwen's normaliser (NFC), pre-tokenizer and byte-level decoder; the special tokens
    <|endoftext|> (bos, padding), <|im_start|> and <|im_end|> (eos: the end of a chat turn); and
    the ChatML chat template (CHATML_TEMPLATE). Its vocabulary is small (see
    _CHAT_TOKENIZER_MAX_VOCAB) but it tokenizes like Qwen's: each digit is its own token.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_chat_tokenizer_json()),
        bos_token=None, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _build_tokenizer(kind: TokenizerKind) -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer() if kind == "char" else build_chat_tokenizer()


def hf_config(config: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """The transformers Qwen2Config of `config` with `tokenizer`'s special token ids."""
    from transformers import Qwen2Config

    vocab_size = len(tokenizer) if config.vocab_size is None else config.vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"TinyModelConfig.vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    bos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def build_model(config: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """The randomly initialised Qwen2ForCausalLM of `config` (fp32, on the current default device).

    Under `with torch.device("meta"):` this builds the skeleton only: shapes and parameter
    counts without memory.
    """
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(hf_config(config, tokenizer))
    if config.tokenizer == "bpe":
        # Generation stops at the end of a chat turn or of a document, as Qwen2.5-Instruct's
        # generation_config.json says.
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    return model


def write_tiny_model(out_dir: str | Path, config: TinyModelConfig = TinyModelConfig(),
                     *, dtype: WeightDtype = "float32") -> Path:
    """Write a randomly initialised Qwen2 causal LM (one model.safetensors) and its tokenizer in HF format."""
    if dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"write_tiny_model: dtype must be one of {sorted(_WEIGHT_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(config.tokenizer)
    model = build_model(config, tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    if dtype != "float32":
        model.to(_WEIGHT_DTYPES[dtype])  # one tensor at a time: peak is the fp32 model plus one tensor
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    logger.info("wrote Qwen2 (%d parameters, %s) to %s", num_parameters, dtype, out)
    return out


@dataclass(kw_only=True, frozen=True)
class WriteTinyModelConfig:
    """Command line of `python -m async_grpo.demo_assets.tiny_model`."""

    out_dir: str = ""
    """Folder to write the checkpoint and tokenizer to."""
    preset: str = "tiny"
    """Model shape: 'tiny' (the demo model), 'qwen2.5-0.5b' or 'qwen2.5-1.5b' (see PRESETS)."""
    model: ShapeOverrides = ShapeOverrides()
    """Fields that replace the preset's (--model.seed, --model.num_layers, ...)."""
    dtype: WeightDtype = "float32"
    """Dtype of the saved weights: float32 or bfloat16 (drawn in fp32 either way)."""

    def __post_init__(self) -> None:
        if not self.out_dir:
            raise ValueError("WriteTinyModelConfig.out_dir must be set (--out_dir)")
        if self.preset not in PRESETS:
            raise ValueError(f"WriteTinyModelConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"WriteTinyModelConfig.dtype must be one of {sorted(_WEIGHT_DTYPES)}, got {self.dtype!r}")


# Every linear layer of a Qwen2 decoder block: what the LoRA tests and benchmarks adapt.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ADAPTER_INIT_SCALE = 0.3  # large enough that the adapter visibly changes greedy tokens


def write_random_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter on LORA_TARGETS with random nonzero A and B (a fresh PEFT adapter has B = 0,
    i.e. no effect), saved with save_pretrained to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(_ADAPTER_INIT_SCALE * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    from async_grpo.config.run_config import load_config

    config = load_config(WriteTinyModelConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_tiny_model(config.out_dir, model_shape(config.preset, config.model), dtype=config.dtype)


if __name__ == "__main__":
    main()
