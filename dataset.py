"""Prompt datasets: the JSONL loader, the demo's arithmetic data, and the trainer's infinite sampler.

A prompt file is JSON Lines, one object per line, with a gold answer and the prompt given either
as token ids (the seed's format) or as text that is tokenized here with the model's tokenizer:

    {"input_token_ids": [151644, 8948, 198, ...], "gt_answer": "\\frac{1}{2}"}
    {"prompt": "3+4=", "gt_answer": "7"}

Loading is all or nothing: the first bad line fails the whole load with a DatasetError naming the
file, the line number and the problem, so a run never trains on a silently shortened dataset.
Blank lines are the one thing passed over, and they are counted (PromptFileStats, logged).

Write the demo's single-digit addition prompts, or check a prompt file against a tokenizer
(`write_arithmetic_table` writes every problem once, for an evaluation set):

    python dataset.py write-arithmetic --out data.jsonl --num_samples 1000 --seed 0
    python dataset.py check --path data.jsonl --model_path runs/tiny-qwen2 --max_prompt_tokens 16
"""

from __future__ import annotations

import json
import logging
import operator
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from run_config import load_config
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

TOKEN_IDS_FIELD = "input_token_ids"
PROMPT_TEXT_FIELD = "prompt"
ANSWER_FIELD = "gt_answer"
_KNOWN_FIELDS = frozenset((TOKEN_IDS_FIELD, PROMPT_TEXT_FIELD, ANSWER_FIELD))
# Characters of a bad line quoted in an error: enough to recognise it, never a megabyte.
_QUOTE_CHARS = 80
# Room for a long math problem with a chat template; the demo's prompts ("3+4=") need 4 tokens.
DEFAULT_MAX_PROMPT_TOKENS = 1024
ARITHMETIC_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class DatasetError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the problem."""


class PromptTokenizer(Protocol):
    """What the loader needs from a Hugging Face tokenizer."""

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], clean_up_tokenization_spaces: bool = ...) -> str: ...


@dataclass(kw_only=True, frozen=True)
class DatasetConfig:
    """Where the prompts come from and what a valid prompt is."""

    path: str
    """JSONL prompt file (see the module docstring for the record format)."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """Longest prompt accepted, in tokens; a longer one fails the load (it would not fit the
    generation engine's context next to the completion)."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (e.g. a BOS) to `prompt` texts; off by default so
    that the text, chat template included, is exactly what the model sees."""
    check_round_trip: bool = True
    """Require decode(encode(prompt)) == prompt for `prompt` texts, which catches characters a
    tokenizer silently drops (the tiny char-level tokenizer drops non-ASCII). Turn off for
    tokenizers that normalise text (some SentencePiece models)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"DatasetConfig.path must be a non-empty path string, got {self.path!r}")
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1:
            raise ValueError(f"DatasetConfig.max_prompt_tokens must be an int >= 1, got {self.max_prompt_tokens!r}")


@dataclass(slots=True)
class PromptFileStats:
    """What a load read, so that nothing it passed over goes unreported."""

    prompts: int = 0
    """Records loaded (one Sample each)."""
    from_token_ids: int = 0
    """Records that gave `input_token_ids`."""
    from_text: int = 0
    """Records that gave a `prompt` text, tokenized by the loader."""
    blank_lines: int = 0
    """Empty or whitespace-only lines, skipped."""
    ignored_fields: dict[str, int] = field(default_factory=dict)
    """Fields other than input_token_ids/prompt/gt_answer, by name: how many records carried each."""


@dataclass(slots=True)
class PromptFile:
    """A loaded prompt file: the samples in file order, and the load's counts."""

    samples: list[Sample]
    stats: PromptFileStats


def _problem(path: Path, line_no: int, message: str) -> DatasetError:
    return DatasetError(f"{path}:{line_no}: {message}")


def _quote(text: str) -> str:
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _decode_record(raw: bytes) -> dict[str, Any]:
    """One line's JSON object; raises ValueError describing what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno}): {_quote(text.strip())}") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _token_ids(value: Any, vocab_size: int, max_tokens: int) -> list[int]:
    """Validated `input_token_ids`; raises ValueError naming the problem."""
    if not isinstance(value, list):
        raise ValueError(f"field {TOKEN_IDS_FIELD!r} must be a list of ints, got {type(value).__name__}")
    for position, token in enumerate(value):
        # bool is an int subclass in Python, but true/false in a token list is a broken file.
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"field {TOKEN_IDS_FIELD!r} must be a list of ints; item {position} is {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})")
    if not value:
        raise ValueError(f"empty prompt: {TOKEN_IDS_FIELD!r} is []")
    _check_length(len(value), max_tokens)
    return list(value)


def _text_token_ids(value: Any, tokenizer: PromptTokenizer, config: DatasetConfig) -> list[int]:
    """Tokenize a `prompt` text; raises ValueError naming the problem."""
    if not isinstance(value, str):
        raise ValueError(f"field {PROMPT_TEXT_FIELD!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"empty prompt: {PROMPT_TEXT_FIELD!r} is {_quote(value)}")
    ids = list(tokenizer.encode(value, add_special_tokens=config.add_special_tokens))
    if config.check_round_trip:
        decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if decoded != value:
            at = next((i for i, (a, b) in enumerate(zip(decoded, value)) if a != b), min(len(decoded), len(value)))
            lost = value[at] if at < len(value) else "end of text"
            raise ValueError(
                f"prompt text does not survive tokenization: decode(encode(text)) differs from character {at} "
                f"({lost!r}), which the tokenizer cannot represent (DatasetConfig.check_round_trip)"
            )
    if not ids:
        raise ValueError(f"empty prompt: {PROMPT_TEXT_FIELD!r} {_quote(value)} tokenizes to no tokens")
    _check_length(len(ids), config.max_prompt_tokens)
    return ids


def _check_length(num_tokens: int, max_tokens: int) -> None:
    if num_tokens > max_tokens:
        raise ValueError(f"prompt has {num_tokens} tokens, more than max_prompt_tokens={max_tokens}")


def _answer(record: dict[str, Any]) -> str:
    if ANSWER_FIELD not in record:
        raise ValueError(f"missing field {ANSWER_FIELD!r}")
    answer = record[ANSWER_FIELD]
    if not isinstance(answer, str):
        raise ValueError(f"field {ANSWER_FIELD!r} must be a string, got {type(answer).__name__} {answer!r}")
    if not answer.strip():
        raise ValueError(f"field {ANSWER_FIELD!r} is empty")
    return answer


def _sample_from_record(
    record: dict[str, Any], prompt_id: int, tokenizer: PromptTokenizer, config: DatasetConfig, stats: PromptFileStats
) -> Sample:
    has_ids, has_text = TOKEN_IDS_FIELD in record, PROMPT_TEXT_FIELD in record
    if has_ids and has_text:
        raise ValueError(f"ambiguous prompt: both {TOKEN_IDS_FIELD!r} and {PROMPT_TEXT_FIELD!r} are given; keep one")
    if not has_ids and not has_text:
        raise ValueError(f"missing field: a record needs {TOKEN_IDS_FIELD!r} (token ids) or {PROMPT_TEXT_FIELD!r} (text)")
    answer = _answer(record)
    if has_ids:
        ids = _token_ids(record[TOKEN_IDS_FIELD], len(tokenizer), config.max_prompt_tokens)
        stats.from_token_ids += 1
    else:
        ids = _text_token_ids(record[PROMPT_TEXT_FIELD], tokenizer, config)
        stats.from_text += 1
    for name in record.keys() - _KNOWN_FIELDS:
        stats.ignored_fields[name] = stats.ignored_fields.get(name, 0) + 1
    return Sample(input_token_ids=ids, gt_answer=answer, prompt_id=prompt_id)


def load_prompt_file(config: DatasetConfig, tokenizer: PromptTokenizer) -> PromptFile:
    """Read and validate every line of config.path; raise DatasetError at the first bad one.

    prompt_id is the record's index among the file's records (blank lines do not count).
    """
    path = Path(config.path)
    samples: list[Sample] = []
    stats = PromptFileStats()
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    stats.blank_lines += 1
                    continue
                try:
                    samples.append(_sample_from_record(_decode_record(raw), len(samples), tokenizer, config, stats))
                except ValueError as exc:
                    raise _problem(path, line_no, str(exc)) from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read prompt file: {exc.strerror or exc}") from None
    if not samples:
        detail = f"has only blank lines ({stats.blank_lines})" if stats.blank_lines else "is empty"
        raise DatasetError(f"{path}: no prompts: the file {detail}")
    stats.prompts = len(samples)
    logger.info(
        "loaded %d prompts from %s (%d from token ids, %d from text); skipped %d blank lines; ignored fields %s",
        stats.prompts, path, stats.from_token_ids, stats.from_text, stats.blank_lines, stats.ignored_fields or "none",
    )
    return PromptFile(samples=samples, stats=stats)


def load_prompts(config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Sample]:
    """The samples of `load_prompt_file` (its counts are logged)."""
    return load_prompt_file(config, tokenizer).samples


def write_arithmetic_dataset(
    path: str | Path,
    num_samples: int,
    seed: int,
    max_operand: int = 9,
    min_operand: int = 0,
    operators: tuple[str, ...] = ("+",),
) -> Path:
    """Write `num_samples` prompts such as {"prompt": "3+4=", "gt_answer": "7"} as JSONL.

    Operands are drawn uniformly from [min_operand, max_operand], operators uniformly from
    `operators` (any of + - *), all from `seed`. The defaults give the demo's single-digit sums.
    The file is written to a temporary name first, so a reader never sees half of it.
    """
    if num_samples < 1:
        raise ValueError(f"write_arithmetic_dataset: num_samples must be >= 1, got {num_samples}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"write_arithmetic_dataset: need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}"
        )
    unknown = [op for op in operators if op not in ARITHMETIC_OPERATORS]
    if not operators or unknown:
        raise ValueError(
            f"write_arithmetic_dataset: operators must be a non-empty subset of {sorted(ARITHMETIC_OPERATORS)}, "
            f"got {list(operators)}"
        )
    rng = random.Random(seed)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for _ in range(num_samples):
            a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
            op = rng.choice(operators)
            f.write(json.dumps({PROMPT_TEXT_FIELD: f"{a}{op}{b}=", ANSWER_FIELD: str(ARITHMETIC_OPERATORS[op](a, b))}) + "\n")
    os.replace(partial, out)
    logger.info("wrote %d arithmetic prompts to %s", num_samples, out)
    return out


def write_arithmetic_table(
    path: str | Path, max_operand: int = 9, min_operand: int = 0, operators: tuple[str, ...] = ("+",)
) -> Path:
    """Write every problem `a op b` with a, b in [min_operand, max_operand] exactly once, as JSONL.

    An evaluation set that covers the task instead of sampling it: the defaults give the 100
    single-digit sums "0+0=" ... "9+9=", in that order (operator, then a, then b), so two
    evaluations always see the same prompts. Written to a temporary name first, like
    write_arithmetic_dataset.
    """
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"write_arithmetic_table: need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}"
        )
    unknown = [op for op in operators if op not in ARITHMETIC_OPERATORS]
    if not operators or unknown or len(set(operators)) != len(operators):
        raise ValueError(
            f"write_arithmetic_table: operators must be distinct members of {sorted(ARITHMETIC_OPERATORS)}, "
            f"got {list(operators)}"
        )
    operands = range(min_operand, max_operand + 1)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for op in operators:
            for a in operands:
                for b in operands:
                    record = {PROMPT_TEXT_FIELD: f"{a}{op}{b}=", ANSWER_FIELD: str(ARITHMETIC_OPERATORS[op](a, b))}
                    f.write(json.dumps(record) + "\n")
    os.replace(partial, out)
    logger.info("wrote %d arithmetic problems to %s", len(operators) * len(operands) ** 2, out)
    return out


class InfiniteDistributedSampler:
    """Endless prompt indices for one data-parallel rank: each epoch a fresh seeded permutation,
    dealt round-robin to the ranks, so the ranks' shards of an epoch are disjoint.

    The last `num_items % world_size` indices of each epoch's permutation are dropped, so every
    rank draws exactly `num_items // world_size` per epoch and no index repeats within an epoch;
    since each epoch permutes afresh, the dropped ones differ from epoch to epoch.

    Every rank draws the same number of indices per step, so epoch and position are the same on
    all ranks: one rank's state_dict() resumes them all exactly where they were.
    """

    def __init__(self, num_items: int, rank: int, world_size: int, seed: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"InfiniteDistributedSampler: world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"InfiniteDistributedSampler: rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(num_items, int) or num_items < world_size:
            raise ValueError(
                f"InfiniteDistributedSampler: num_items ({num_items!r}) must be an int >= world_size ({world_size}), "
                "so that every rank gets at least one item per epoch"
            )
        self.num_items = num_items
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = num_items // world_size
        self._epoch = 0
        self._position = 0
        self._shard = self._epoch_shard(0)

    @property
    def epoch(self) -> int:
        """Epoch the next index comes from (0-based)."""
        return self._epoch

    def _epoch_shard(self, epoch: int) -> list[int]:
        permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
        return permutation[self.rank : self.per_rank * self.world_size : self.world_size].tolist()

    def _next_index(self) -> int:
        if self._position == self.per_rank:
            self._epoch += 1
            self._position = 0
            self._shard = self._epoch_shard(self._epoch)
        index = self._shard[self._position]
        self._position += 1
        return index

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self._next_index()

    def next_batch(self, k: int) -> list[int]:
        """The next k indices of this rank (crossing into the next epoch when one runs out)."""
        if k < 0:
            raise ValueError(f"InfiniteDistributedSampler.next_batch: k must be >= 0, got {k}")
        return [self._next_index() for _ in range(k)]

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable position: the epoch, the indices already drawn from it, and the
        settings that must match on resume."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_items": self.num_items,
            "world_size": self.world_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict(); refuses one taken with another dataset size, world size or seed."""
        for name in ("num_items", "world_size", "seed"):
            if state.get(name) != getattr(self, name):
                raise ValueError(
                    f"InfiniteDistributedSampler.load_state_dict: {name} is {state.get(name)!r} in the saved state "
                    f"but {getattr(self, name)!r} here; resuming would draw different data"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"InfiniteDistributedSampler.load_state_dict: epoch must be an int >= 0, got {epoch!r}")
        if not isinstance(position, int) or not 0 <= position <= self.per_rank:
            raise ValueError(
                f"InfiniteDistributedSampler.load_state_dict: position must be in [0, {self.per_rank}], got {position!r}"
            )
        self._epoch, self._position = epoch, position
        self._shard = self._epoch_shard(epoch)


@dataclass(kw_only=True, frozen=True)
class WriteArithmeticConfig:
    """`python dataset.py write-arithmetic`: write the demo's addition prompts as JSONL."""

    out: str = ""
    """File to write."""
    num_samples: int = 0
    """Prompts to write."""
    seed: int = 0
    """Seed of the operands and operators."""
    min_operand: int = 0
    """Smallest operand."""
    max_operand: int = 9
    """Largest operand."""
    operators: str = "+"
    """Operators to draw from, e.g. '+-*'."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("WriteArithmeticConfig.out must be set (--out)")
        if self.num_samples < 1:
            raise ValueError(f"WriteArithmeticConfig.num_samples must be >= 1 (--num_samples), got {self.num_samples}")


@dataclass(kw_only=True, frozen=True)
class CheckConfig:
    """`python dataset.py check`: load a prompt file with a model's tokenizer and report."""

    path: str = ""
    """Prompt file (JSONL) to check."""
    model_path: str = ""
    """Model folder whose tokenizer encodes the prompts."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """Longest prompt allowed, in tokens."""

    def __post_init__(self) -> None:
        if not self.path or not self.model_path:
            raise ValueError("CheckConfig needs --path and --model_path")


def _check_command(config: CheckConfig) -> None:
    from setup_model import load_tokenizer

    dataset_config = DatasetConfig(path=config.path, max_prompt_tokens=config.max_prompt_tokens)
    loaded = load_prompt_file(dataset_config, load_tokenizer(config.model_path))
    lengths = [len(s.input_token_ids) for s in loaded.samples]
    print(f"ok: {loaded.stats}; prompt tokens min={min(lengths)} max={max(lengths)} mean={np.mean(lengths):.1f}")


_COMMANDS = {"write-arithmetic": WriteArithmeticConfig, "check": CheckConfig}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in _COMMANDS:
        raise SystemExit(f"usage: python dataset.py {{{','.join(_COMMANDS)}}} [--flag value ...] (--help per command)")
    command = args.pop(0)
    config = load_config(_COMMANDS[command], args, description=_COMMANDS[command].__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if isinstance(config, WriteArithmeticConfig):
        out = write_arithmetic_dataset(
            config.out, config.num_samples, config.seed, max_operand=config.max_operand,
            min_operand=config.min_operand, operators=tuple(config.operators),
        )
        print(f"wrote {config.num_samples} prompts to {out}")
    else:
        try:
            _check_command(config)
        except DatasetError as exc:
            raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
