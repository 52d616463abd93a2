"""Prompt datasets: prompt files (JSONL / Parquet) and reasoning-gym tasks loaded as Samples, and the data CLI.

A prompt file is JSON Lines (`.jsonl`, `.json`, `.ndjson`: one object per line) or Parquet
(`.parquet`: one record per row), chosen by the file's suffix. Each record gives a prompt and a gold
answer in one of these layouts (`data.format`; "auto", the default, picks one from the first
record's fields and logs its choice):

    format   prompt from          gold answer (Sample.gt_answer) from
    generic  `prompt` (text)      `gt_answer`, verbatim
             or `input_token_ids` (token ids, used as given)
    gsm8k    `question`           `answer`: the text after its last `####`, commas and whitespace
                                  removed ("...\\n#### 1,000" -> "1000"), as GSM8K's graders do
    math     `problem`            `solution`: the contents of its last `\\boxed{...}` or `\\fbox{...}`
                                  (nested braces kept: "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}")
    verl     `prompt` (a list of  `reward_model.ground_truth` (text verbatim; a list or object, e.g.
             chat messages, put    code tests, as its JSON text); `data_source` picks the reward
             through the          function (sampling.reward.by_data_source), as verl's Parquet
             tokenizer's chat     files publish it
             template)

    {"input_token_ids": [151644, 8948, 198, ...], "gt_answer": "\\frac{1}{2}"}
    {"prompt": "3+4=", "gt_answer": "7"}
    {"question": "Natalia sold 48 clips ...", "answer": "... 48+24 = 72\\n#### 72"}
    {"problem": "What is $1/2 + 0$?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Natalia sold ..."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {...}}

`data.prompt_field` / `data.answer_field` rename the two fields of the chosen format for datasets
that renamed their columns (e.g. format generic, prompt_field "problem", answer_field "answer" for
a dataset that ships a bare final answer). Fields beyond the format's are ignored and counted.

A text prompt becomes token ids in three steps: `data.prompt_template` (e.g.
"{question}\\nPut your final answer in \\\\boxed{{}}.") rewrites the question; with
`data.chat_template: true` the tokenizer's chat template wraps it as the user turn (after an
optional `data.system_prompt`) and opens the assistant turn; the tokenizer encodes the result
without adding special tokens again. Plain completion (no chat template) is the default, for base
models. Pre-tokenized prompts are used as given.

Loading is all or nothing: the first bad record fails the whole load with a DatasetError naming the
file, the line (JSONL) or 0-based row (Parquet), the field and the problem, so a run never trains
on a silently shortened dataset. Passed over, and counted (PromptFileStats, logged): blank JSONL
lines, and, only with `data.missing_answer: skip`, gsm8k/math records whose answer field holds no
final answer.

The record formats' fields, detection and gold answers are prompt_record.py's; reading the files
(JSON Lines, Parquet) into records is record_files.py's; the demo's arithmetic files are
demo_assets/arithmetic_data.py's, the reasoning-gym records reasoning_gym_tasks.py's, and the
trainer's sampler is distributed_sampler.py's. Write the demo's single-digit addition prompts,
or check a prompt file against a tokenizer:

    python -m async_grpo.data.dataset write-arithmetic --out data.jsonl --num_samples 1000 --seed 0
    python -m async_grpo.data.dataset check --path data.jsonl --model_path runs/tiny-qwen2 --max_prompt_tokens 16
    python -m async_grpo.data.dataset check --path gsm8k/train.parquet --model_path /models/qwen2.5-1.5b-instruct \\
        --format gsm8k --chat_template true --show 2
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from async_grpo.config.run_config import ConfigError, exit_config_error, flattened, load_command
from async_grpo.demo_assets.arithmetic_data import WriteArithmeticConfig, write_arithmetic_dataset
from async_grpo.data.prompt_record import (
    DATA_FORMATS, FORMAT_FIELDS, GROUPING_FIELDS, MISSING_ANSWER_POLICIES, TOKEN_IDS_FIELD, DataFormat, DatasetError,
    MissingAnswerPolicy, RecordSchema, chat_messages, detect_format, gold_answer, no_answer_problem, quote,
    string_field,
)
from async_grpo.data.reasoning_gym_tasks import ReasoningGymConfig, reasoning_gym_records
from async_grpo.data.record_files import RecordFile
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)

# The one placeholder of data.prompt_template: the record's question text.
PROMPT_TEMPLATE_FIELD = "question"
# Record locations of skipped records kept for the log line; the count is always complete.
_SKIPPED_EXAMPLES = 3
# Room for a long math problem with a chat template; the demo's prompts ("3+4=") need 4 tokens.
DEFAULT_MAX_PROMPT_TOKENS = 1024


class PromptTokenizer(Protocol):
    """What the loader needs from a Hugging Face tokenizer."""

    name_or_path: str
    chat_template: str | dict[str, str] | None

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], clean_up_tokenization_spaces: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(kw_only=True, frozen=True)
class DatasetConfig:
    """Where the prompts come from, how records map to prompts and answers, and what a valid prompt is."""

    path: str
    """Prompt file: JSON Lines (.jsonl/.json/.ndjson) or Parquet (.parquet), by suffix (see the
    module docstring for the record formats); "" with format reasoning_gym (generated prompts)."""
    # The module docstring has each layout's fields and gold answer. "auto" picks generic if the
    # first record has `prompt`/`input_token_ids`/`gt_answer`, gsm8k if `question`+`answer`, math if
    # `problem`+`solution`, verl if `prompt` is a list of chat messages and `reward_model` is
    # present; none or several: an error. verl's chat-message prompts always go through the
    # tokenizer's chat template; its gold answer is `reward_model.ground_truth`.
    format: DataFormat = "auto"
    """Record layout: "generic" (`prompt` or `input_token_ids`; `gt_answer`), "gsm8k" (`question`;
    `answer` after `####`), "math" (`problem`; `solution`'s last `\\boxed{}`), "verl" (verl's
    Parquet), or "auto" from the first record's fields (docs/data.md). eval.data follows it unless
    eval.data.format is set."""
    prompt_field: str | None = None
    """Field holding the prompt text, replacing the format's own (`prompt`, `question`,
    `problem`); needs an explicit `format`."""
    answer_field: str | None = None
    """Field holding the gold answer, replacing the format's own (`gt_answer`, `answer`,
    `solution`) and read the format's way (verbatim, after `####`, last `\\boxed{}`); needs an
    explicit `format`."""
    missing_answer: MissingAnswerPolicy = "error"
    """A gsm8k/math record whose answer field holds no final answer (no `####`, no complete
    `\\boxed{}`): "error" fails the load naming the record; "skip" leaves it out, counted in
    PromptFileStats.skipped_no_answer and logged with the first few locations."""
    chat_template: bool = False
    """Wrap each text prompt in the tokenizer's chat template as the user turn, followed by the
    opening of the assistant turn (instruction/chat models). False: plain completion, the text as
    is (base models). The load fails at once if the tokenizer has no chat template."""
    system_prompt: str | None = None
    """System message placed before the user turn (needs chat_template). None: none given (some
    templates, e.g. Qwen2.5's, then write their own default)."""
    prompt_template: str | None = None
    """Python format string applied to the question text before any chat template, with the
    question as `{question}` and literal braces doubled, e.g.
    "{question}\\nPut your final answer in \\\\boxed{{}}."; None uses the question as is."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """Longest prompt accepted, in tokens (templates included); a longer one fails the load (it
    would not fit the generation engine's context next to the completion)."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (e.g. a BOS) to text prompts; off by default so
    that the text is exactly what the model sees. Must stay off with chat_template, whose
    template writes the special tokens itself (a BOS would be doubled)."""
    check_round_trip: bool = True
    """Require decode(encode(prompt)) == prompt for text prompts (after the templates), which
    catches characters a tokenizer silently drops (the tiny char-level tokenizer drops
    non-ASCII). Turn off for tokenizers that normalise text (some SentencePiece models)."""

    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """The generated tasks of format reasoning_gym (data.reasoning_gym.tasks/size/seed)."""

    def __post_init__(self) -> None:
        generated = self.format == "reasoning_gym"
        if not isinstance(self.path, str) or not (self.path or generated):
            raise ValueError(f"DatasetConfig.path must be a non-empty path string, got {self.path!r}")
        if generated and self.path:
            raise ValueError(f"DatasetConfig.path must be '' with format reasoning_gym (its prompts are generated), "
                             f"got {self.path!r}; an evaluation file needs its own eval.data.format")
        if generated and not self.reasoning_gym.tasks:
            raise ValueError("DatasetConfig.format reasoning_gym needs DatasetConfig.reasoning_gym.tasks "
                             "(e.g. --data.reasoning_gym.tasks basic_arithmetic)")
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1:
            raise ValueError(f"DatasetConfig.max_prompt_tokens must be an int >= 1, got {self.max_prompt_tokens!r}")
        if self.format not in DATA_FORMATS:
            raise ValueError(f"DatasetConfig.format must be one of {list(DATA_FORMATS)}, got {self.format!r}")
        if self.missing_answer not in MISSING_ANSWER_POLICIES:
            raise ValueError(
                f"DatasetConfig.missing_answer must be one of {list(MISSING_ANSWER_POLICIES)}, got {self.missing_answer!r}"
            )
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"DatasetConfig.{name} must be a non-empty field name or None, got {value!r}")
            if self.format == "auto":
                raise ValueError(
                    f"DatasetConfig.{name} renames a field of a format, so it needs an explicit DatasetConfig.format "
                    f"(one of {list(FORMAT_FIELDS)}), not 'auto'"
                )
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("DatasetConfig.system_prompt needs DatasetConfig.chat_template: true (a plain-completion "
                             "prompt has no system turn); put fixed text in DatasetConfig.prompt_template instead")
        if self.chat_template and self.add_special_tokens:
            raise ValueError("DatasetConfig.add_special_tokens must be false with DatasetConfig.chat_template: the chat "
                             "template writes the model's special tokens itself, so they would be added twice")
        if self.prompt_template is not None:
            _check_prompt_template(self.prompt_template)

    def fields(self, data_format: str) -> tuple[str, str]:
        """(prompt field, answer field) of a concrete format, overrides applied."""
        prompt, answer = FORMAT_FIELDS[data_format]
        return self.prompt_field or prompt, self.answer_field or answer


def _check_prompt_template(template: str) -> None:
    marker = "\x00question\x00"
    try:
        filled = template.format(**{PROMPT_TEMPLATE_FIELD: marker})
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"DatasetConfig.prompt_template {quote(template)} is not a format string whose only placeholder is "
            f"{{{PROMPT_TEMPLATE_FIELD}}} (write literal braces as {{{{ and }}}}): {type(exc).__name__}: {exc}"
        ) from None
    if marker not in filled:
        raise ValueError(f"DatasetConfig.prompt_template {quote(template)} must contain {{{PROMPT_TEMPLATE_FIELD}}}")


@dataclass(slots=True)
class PromptFileStats:
    """What a load read, so that nothing it passed over goes unreported."""

    format: str = ""
    """Format the records were read as (DatasetConfig.format, or what "auto" chose)."""
    prompts: int = 0
    """Records loaded (one Sample each)."""
    from_token_ids: int = 0
    """Records that gave `input_token_ids`."""
    from_text: int = 0
    """Records that gave a prompt text, tokenized by the loader."""
    blank_lines: int = 0
    """Empty or whitespace-only JSONL lines, skipped."""
    skipped_no_answer: int = 0
    """gsm8k/math records without a final answer, skipped under missing_answer: skip."""
    first_skipped: list[str] = field(default_factory=list)
    """Locations (file:line or file: row N) of the first few skipped records."""
    ignored_fields: dict[str, int] = field(default_factory=dict)
    """Fields the format does not read, by name: how many records carried each."""


@dataclass(slots=True)
class PromptFile:
    """A loaded prompt file: the samples in file order, and the load's counts."""

    samples: list[Sample]
    stats: PromptFileStats


class PromptEncoder:
    """Question text -> the token ids the model sees: data.prompt_template, then (with
    data.chat_template) the tokenizer's chat template, then encode."""

    def __init__(self, config: DatasetConfig, tokenizer: PromptTokenizer) -> None:
        if config.chat_template and not tokenizer.chat_template:
            raise DatasetError(
                f"data.chat_template is true but the tokenizer of {tokenizer.name_or_path!r} has no chat template "
                "(no chat_template in its tokenizer_config.json or chat_template.jinja); use data.chat_template: "
                "false (plain completion, for base models) or a model whose tokenizer defines one"
            )
        self.config = config
        self.tokenizer = tokenizer

    def text(self, question: str) -> str:
        """The prompt text the tokenizer encodes."""
        if self.config.prompt_template is not None:
            question = self.config.prompt_template.format(**{PROMPT_TEMPLATE_FIELD: question})
        if not self.config.chat_template:
            return question
        messages = [{"role": "user", "content": question}]
        if self.config.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return self._chat_text(messages)

    def _chat_text(self, messages: list[dict[str, str]]) -> str:
        try:
            # tokenize=False, then encode without special tokens: the template already writes
            # them (e.g. Llama 3's <|begin_of_text|>), and encoding would add a second BOS.
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 errors, or a template's own raise_exception(...)
            raise ValueError(
                f"the chat template of {self.tokenizer.name_or_path!r} failed: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(text, str):
            raise ValueError(f"the chat template of {self.tokenizer.name_or_path!r} returned "
                             f"{type(text).__name__}, not text")
        return text

    def message_token_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Encoded chat messages (verl's prompts): the tokenizer's chat template with the
        assistant turn opened, whatever data.chat_template says (the prompt is a conversation)."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"the prompt is a list of chat messages (verl format) but the tokenizer of "
                             f"{self.tokenizer.name_or_path!r} has no chat template")
        if self.config.prompt_template is not None or self.config.system_prompt is not None:
            raise ValueError("data.prompt_template and data.system_prompt apply to text prompts; a verl prompt is "
                             "already a list of chat messages")
        return self._encoded(self._chat_text(messages))

    def token_ids(self, question: str) -> list[int]:
        """Encoded text(question), validated; raises ValueError naming the problem."""
        return self._encoded(self.text(question))

    def _encoded(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=self.config.add_special_tokens))
        if self.config.check_round_trip:
            decoded = self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            if decoded != text:
                at = next((i for i, (a, b) in enumerate(zip(decoded, text)) if a != b), min(len(decoded), len(text)))
                lost = text[at] if at < len(text) else "end of text"
                raise ValueError(
                    f"prompt text does not survive tokenization: decode(encode(text)) differs from character {at} "
                    f"({lost!r}), which the tokenizer cannot represent (DatasetConfig.check_round_trip)"
                )
        if not ids:
            raise ValueError(f"empty prompt: {quote(text)} tokenizes to no tokens")
        _check_length(len(ids), self.config.max_prompt_tokens)
        return ids


def resolve_schema(config: DatasetConfig, first_record: dict[str, Any]) -> RecordSchema:
    """The schema config gives, detecting the format from first_record when it is "auto"."""
    data_format = detect_format(first_record) if config.format == "auto" else config.format
    return RecordSchema(data_format, *config.fields(data_format))


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


def _check_length(num_tokens: int, max_tokens: int) -> None:
    if num_tokens > max_tokens:
        raise ValueError(f"prompt has {num_tokens} tokens, more than max_prompt_tokens={max_tokens}")


def _prompt_ids(
    record: dict[str, Any], schema: RecordSchema, encoder: PromptEncoder, stats: PromptFileStats
) -> list[int]:
    config = encoder.config
    if schema.format == "verl":
        stats.from_text += 1
        return encoder.message_token_ids(chat_messages(record.get(schema.prompt_field), schema.prompt_field))
    has_ids = schema.format == "generic" and TOKEN_IDS_FIELD in record
    has_text = schema.prompt_field in record
    if has_ids and has_text:
        raise ValueError(f"ambiguous prompt: both {TOKEN_IDS_FIELD!r} and {schema.prompt_field!r} are given; keep one")
    if has_ids:
        if config.chat_template or config.prompt_template is not None:
            raise ValueError(f"field {TOKEN_IDS_FIELD!r} gives a pre-tokenized prompt, which data.chat_template and "
                             "data.prompt_template cannot apply to; give the prompt as text")
        stats.from_token_ids += 1
        return _token_ids(record[TOKEN_IDS_FIELD], len(encoder.tokenizer), config.max_prompt_tokens)
    if not has_text:
        if schema.format == "generic":
            raise ValueError(f"missing field: a record needs {TOKEN_IDS_FIELD!r} (token ids) or "
                             f"{schema.prompt_field!r} (text)")
        raise ValueError(f"missing field {schema.prompt_field!r}")
    value = record[schema.prompt_field]
    if not isinstance(value, str):
        raise ValueError(f"field {schema.prompt_field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"empty prompt: {schema.prompt_field!r} is {quote(value)}")
    stats.from_text += 1
    return encoder.token_ids(value)


def _sample_from_record(
    record: dict[str, Any], where: str, prompt_id: int, schema: RecordSchema, encoder: PromptEncoder,
    stats: PromptFileStats,
) -> Sample | None:
    """The record's Sample; None if it has no final answer and missing_answer is "skip"."""
    answer = gold_answer(record, schema)
    if answer is None:
        if encoder.config.missing_answer == "error":
            raise ValueError(no_answer_problem(schema, record[schema.answer_field]))
        stats.skipped_no_answer += 1
        if len(stats.first_skipped) < _SKIPPED_EXAMPLES:
            stats.first_skipped.append(where)
        return None
    ids = _prompt_ids(record, schema, encoder, stats)
    for name in record.keys() - schema.known_fields:
        stats.ignored_fields[name] = stats.ignored_fields.get(name, 0) + 1
    group_id, run_id = (_grouping_id(record, name) for name in GROUPING_FIELDS)
    # The whole record rides along for reward functions (rewards.RewardConfig.functions), which
    # may read any field (test cases, a rubric); the worker drops it once the rollout is scored.
    return Sample(input_token_ids=ids, gt_answer=answer, prompt_id=prompt_id, group_id=group_id,
                  run_id=0 if run_id is None else run_id, record=dict(record))


def _grouping_id(record: dict[str, Any], name: str) -> int | None:
    """An optional grouping field (group_id, run_id): an int >= 0, or None when absent."""
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"field {name!r} must be an int >= 0, got {value!r}")
    return value


def load_prompt_file(config: DatasetConfig, tokenizer: PromptTokenizer) -> PromptFile:
    """Read and validate every record of config.path; raise DatasetError at the first bad one.

    prompt_id is the sample's index in the returned list: the record's index among the file's
    records, not counting blank lines or skipped records.
    """
    path = Path(config.path)
    encoder = PromptEncoder(config, tokenizer)  # fails on a missing chat template before any reading
    if config.format == "reasoning_gym":
        return _reasoning_gym_prompts(config, encoder)
    samples: list[Sample] = []
    stats = PromptFileStats()
    schema: RecordSchema | None = None
    try:
        records = RecordFile(path)
        for where, record in records:
            try:
                if schema is None:
                    schema = _resolved_and_logged(config, record, path, where)
                    stats.format = schema.format
                sample = _sample_from_record(record, where, len(samples), schema, encoder, stats)
            except DatasetError:
                raise
            except ValueError as exc:
                raise DatasetError(f"{where}: {exc}") from None
            if sample is not None:
                samples.append(sample)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read prompt file: {exc.strerror or exc}") from None
    stats.blank_lines = records.blank_lines
    if not samples:
        raise DatasetError(f"{path}: no prompts: {_why_empty(stats)}")
    stats.prompts = len(samples)
    _log_load(path, stats)
    return PromptFile(samples=samples, stats=stats)


def _reasoning_gym_prompts(config: DatasetConfig, encoder: PromptEncoder) -> PromptFile:
    """PromptFile of the generated tasks: the question is the prompt text (templates apply), the
    answer the gold answer; the whole entry stays in Sample.record for the task's scorer."""
    stats = PromptFileStats(format="reasoning_gym")
    samples = []
    for prompt_id, record in enumerate(reasoning_gym_records(config.reasoning_gym)):
        where = f"reasoning_gym {record['data_source']} #{prompt_id}"
        try:
            ids = encoder.token_ids(string_field(record, "question"))
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}") from None
        stats.from_text += 1
        samples.append(Sample(input_token_ids=ids, gt_answer=str(record["answer"]), prompt_id=prompt_id,
                              record=record))
    stats.prompts = len(samples)
    logger.info("generated %d reasoning-gym prompts (tasks %s, seed %d)", len(samples),
                list(config.reasoning_gym.tasks), config.reasoning_gym.seed)
    return PromptFile(samples=samples, stats=stats)


def _resolved_and_logged(config: DatasetConfig, record: dict[str, Any], path: Path, where: str) -> RecordSchema:
    schema = resolve_schema(config, record)
    how = f"detected from the fields of {where}" if config.format == "auto" else "data.format"
    logger.info("reading %s as format %s (%s): prompt from %r, answer from %r",
                path, schema.format, how, schema.prompt_field, schema.answer_field)
    return schema


def _why_empty(stats: PromptFileStats) -> str:
    if stats.skipped_no_answer:
        return (f"all {stats.skipped_no_answer} records were skipped for having no final answer "
                f"(data.missing_answer: skip; first at {stats.first_skipped[0]})")
    if stats.blank_lines:
        return f"the file has only blank lines ({stats.blank_lines})"
    return "the file is empty"


def _log_load(path: Path, stats: PromptFileStats) -> None:
    logger.info(
        "loaded %d prompts from %s as %s (%d from token ids, %d from text); skipped %d blank lines; ignored fields %s",
        stats.prompts, path, stats.format, stats.from_token_ids, stats.from_text, stats.blank_lines,
        stats.ignored_fields or "none",
    )
    if stats.skipped_no_answer:
        logger.warning("skipped %d records of %s without a final answer (data.missing_answer: skip), first at %s",
                       stats.skipped_no_answer, path, ", ".join(stats.first_skipped))


def load_prompts(config: DatasetConfig, tokenizer: PromptTokenizer) -> list[Sample]:
    """The samples of `load_prompt_file` (its counts are logged)."""
    return load_prompt_file(config, tokenizer).samples


@dataclass(kw_only=True, frozen=True)
class CheckConfig:
    """Load a prompt file with a model's tokenizer, as the trainer would, and report (the `check` command)."""

    data: DatasetConfig = flattened(DatasetConfig)
    """The prompt file and how to read it: the trainer's data section, every field a top-level flag
    (--path, --format, --chat_template, ...)."""
    model_path: str
    """Model folder whose tokenizer (and chat template) encodes the prompts."""
    show: int = 1
    """Print the first N prompts as the model will see them (decoded token ids) with their gold answers."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("CheckConfig.model_path must name a model folder")
        if self.show < 0:
            raise ValueError(f"CheckConfig.show must be >= 0, got {self.show}")


def _check_command(config: CheckConfig) -> None:
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(config.model_path)
    loaded = load_prompt_file(config.data, tokenizer)
    for sample in loaded.samples[: config.show]:
        prompt = tokenizer.decode(sample.input_token_ids, clean_up_tokenization_spaces=False)
        print(f"prompt {sample.prompt_id} ({len(sample.input_token_ids)} tokens): {prompt!r}\n"
              f"  gt_answer: {sample.gt_answer!r}")
    lengths = [len(s.input_token_ids) for s in loaded.samples]
    print(f"ok: {loaded.stats}; prompt tokens min={min(lengths)} max={max(lengths)} mean={np.mean(lengths):.1f}")


_COMMANDS = {"write-arithmetic": WriteArithmeticConfig, "check": CheckConfig}
_PROG = "python -m async_grpo.data.dataset"


def main(argv: list[str] | None = None) -> None:
    try:
        command, config = load_command(_COMMANDS, list(sys.argv[1:] if argv is None else argv), _PROG)
    except ConfigError as exc:
        exit_config_error(_PROG, exc)
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
        except DatasetError as exc:  # a file that does not fit its format: one line
            exit_config_error(f"{_PROG} {command}", exc)


if __name__ == "__main__":
    main()
