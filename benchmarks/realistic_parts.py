"""realistic_run.py's pure parts: its command line, the synthetic GSM8K data, the model folder's
spec, the trainer config it runs, the engines' sizing, and the per-step / per-stage tables.
(A module of its own so that tests check them without importing the benchmark script.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from async_grpo.demo_assets.tiny_model import PRESETS, ShapeOverrides
from benchmarks.harness import REPO_ROOT
from benchmarks.process_monitor import format_table

KV_CACHE_MARGIN = 1.25  # vLLM rounds each sequence up to whole blocks and keeps some slack
MIN_KV_CACHE_BYTES = 64 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_SPEC_FILE = "realistic_run_model.json"  # written last: its presence marks a complete model folder


SMOKE = {"preset": "tiny", "max_tokens": 8, "num_steps": 1, "num_problems": 8}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class RealisticRunConfig:
    """Command line of `python -m benchmarks.realistic_run`; trainer flags go after `--`."""

    work_dir: str = str(REPO_ROOT / "runs" / "realistic")
    """Where the model, data, trainer config, logs, the run (`run/`) and report.json go."""
    preset: str = "qwen2.5-0.5b"
    """Model shape (tiny_model.PRESETS): 'qwen2.5-0.5b', 'qwen2.5-1.5b', or 'tiny' for a quick check."""
    model: ShapeOverrides = ShapeOverrides()
    """Fields replacing the preset's (tiny_model.py's --model.*). The tokenizer is the chat one
    ('bpe') unless set: data.chat_template needs its template."""
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the saved weights (the trainer's master weights are fp32 either way)."""
    num_problems: int = 16
    """Generated GSM8K-style problems in the data file."""
    data_seed: int = 0
    """Seed of the generated problems."""
    num_steps: int = 3
    """Optimizer steps (trainer num_steps)."""
    max_tokens: int = 2048
    """Response length limit (sampling.max_tokens)."""
    n: int = 2
    """Rollouts per prompt (sampling.n)."""
    prompts_per_rank: int = 1
    """Prompts each trainer rank submits per step."""
    nproc_per_node: int = 2
    """Trainer ranks."""
    max_prompt_tokens: int = 256
    """data.max_prompt_tokens (after the chat template; the generated prompts take ~60-90)."""
    max_tokens_per_gpu: int | None = None
    """Trainer minibatch budget per rank; None: max_prompt_tokens + max_tokens (one longest sample),
    divided over the context_parallel ranks that split it."""
    context_parallel: int = 1
    """model.context_parallel: ranks that split each minibatch's tokens (2: an 8k-token response
    trains where one rank's budget refuses it)."""
    max_lag: int = 1
    """Trainer max_lag (1: generation of the next step overlaps training, the system's default)."""
    gradient_checkpointing: bool = True
    """model.gradient_checkpointing."""
    logprob_chunk_size: int = 256
    """model.logprob_chunk_size (output positions per lm_head chunk in the trainer)."""
    kl_coef: float = 0.001
    """loss.kl_coef (k3 against the reference logprobs the logprob worker computes)."""
    lr: float = 1e-6
    """optim.lr."""
    seed: int = 0
    """Trainer seed (data order, sampling)."""
    dtype: str = "float32"
    """Both workers' dtype (local_cluster --dtype); fp32, as the CPU trainer computes."""
    kv_cache_memory_bytes: int | None = None
    """vLLM KV cache; None: enough for every sequence that can be in flight (see the docstring)."""
    max_num_seqs: int | None = None
    """vLLM's concurrent sequences; None: (max_lag + 1) x ranks x prompts_per_rank x n."""
    logprob_max_tokens: int | None = None
    """Logprob worker's batch budget (local_cluster --max_tokens_per_forward); None: n x max_model_len."""
    global_num_verifiers: int = 1
    """Verifier processes."""
    patience_s: float = 4 * 3600.0
    """Trainer message_timeout_s, prompt_deadline_s and dist_timeout_s."""
    worker_start_timeout_s: float = 1800.0
    """How long local_cluster waits for each worker to register (loading 0.5B into vLLM on a busy
    2-core machine takes minutes)."""
    timeout_s: float = 8 * 3600.0
    """Stop the run (and fail) after this long."""
    poll_s: float = 2.0
    """How often process memory is read."""
    malloc_mmap_threshold_bytes: int = 256 * 1024
    """glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ for every process of the run (0:
    leave glibc's defaults). glibc raises its mmap threshold dynamically up to 32 MiB, so after the
    first step most activation-sized buffers come from the heap and their freed pages stay
    resident; a fixed threshold hands them back at free. Measured with trainer_throughput (2 ranks,
    0.5B shape, benchmarks/RESULTS.md): a rank's peak 7.37 -> 6.21 GiB, its step 129 -> 142 s."""

    smoke: bool = False
    """Smoke mode: the tiny model, 8 problems, 1 step of 8-token responses (SMOKE); checks that the command still
    runs, its figures mean nothing."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"RealisticRunConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for name in ("num_problems", "num_steps", "max_tokens", "n", "prompts_per_rank", "nproc_per_node",
                     "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RealisticRunConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_tokens_per_gpu", "kv_cache_memory_bytes", "max_num_seqs", "logprob_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"RealisticRunConfig.{name} must be >= 1 or None, got {value}")
        if self.context_parallel < 1 or self.nproc_per_node % self.context_parallel:
            raise ValueError(f"RealisticRunConfig.context_parallel must be >= 1 and divide nproc_per_node="
                             f"{self.nproc_per_node}, got {self.context_parallel}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"RealisticRunConfig.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.malloc_mmap_threshold_bytes < 0:
            raise ValueError(f"RealisticRunConfig.malloc_mmap_threshold_bytes must be >= 0, got "
                             f"{self.malloc_mmap_threshold_bytes}")
        for name in ("patience_s", "worker_start_timeout_s", "timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RealisticRunConfig.{name} must be > 0, got {getattr(self, name)}")


# ---- data ------------------------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi", "Lena")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


def _problem(rng: random.Random, kind: int) -> tuple[str, str, int]:
    """(question, worked solution, final answer) of one word problem of the given kind."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if kind == 0:
        a, b = rng.randint(5, 60), rng.randint(2, 40)
        c = rng.randint(1, a + b - 1)
        r = a + b - c
        return (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to a friend. "
                f"How many {item} does {name} have now?",
                f"{name} starts with {a} and buys {b}, so {a} + {b} = {a + b}.\n"
                f"After giving away {c}: {a + b} - {c} = {r}.", r)
    if kind == 1:
        a, b = rng.randint(3, 24), rng.randint(2, 15)
        return (f"A box holds {a} {item}. How many {item} are there in {b} boxes?",
                f"Each box holds {a}, so {b} boxes hold {b} * {a} = {a * b}.", a * b)
    if kind == 2:
        a, b = rng.randint(5, 40), rng.randint(2, 6)
        return (f"{name} reads {a} pages every day. How many pages does {name} read in {b} weeks?",
                f"A week has 7 days, so {name} reads 7 * {a} = {7 * a} pages a week.\n"
                f"In {b} weeks: {b} * {7 * a} = {7 * a * b}.", 7 * a * b)
    a, b = rng.randint(3, 25), rng.randint(2, 8)
    paid = (a * b // 10 + 1) * 10 + rng.choice((0, 10, 20))
    return (f"A notebook costs ${a}. {name} buys {b} notebooks and pays with ${paid}. "
            f"How much change does {name} get?",
            f"{b} notebooks cost {b} * {a} = ${a * b}.\nThe change is {paid} - {a * b} = ${paid - a * b}.",
            paid - a * b)


def gsm8k_records(num_problems: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-style records ({"question", "answer": "<solution>\\n#### N"}), deterministic for a seed."""
    rng = random.Random(seed)
    records = []
    for i in range(num_problems):
        question, solution, answer = _problem(rng, i % 4)
        records.append({"question": question, "answer": f"{solution}\n#### {answer}"})
    return records


def write_gsm8k(path: Path, num_problems: int, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_records(num_problems, seed)))
    return path


# ---- configuration -----------------------------------------------------------------------------

def model_spec(config: RealisticRunConfig) -> dict[str, Any]:
    """What the model folder is made from; the tokenizer defaults to the chat one."""
    overrides = {k: v for k, v in dataclasses.asdict(config.model).items() if v is not None}
    overrides.setdefault("tokenizer", "bpe")
    return {"preset": config.preset, "dtype": config.model_dtype, "overrides": overrides}


def model_dir_name(spec: dict[str, Any]) -> str:
    name = f"model-{spec['preset']}-{spec['dtype']}"
    extra = {k: v for k, v in spec["overrides"].items() if not (k == "tokenizer" and v == "bpe")}
    if extra:
        name += "-" + hashlib.sha1(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:8]
    return name


def model_writer_command(spec: dict[str, Any], out_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "async_grpo.demo_assets.tiny_model", "--out_dir", str(out_dir),
               "--preset", spec["preset"], "--dtype", spec["dtype"]]
    for key, value in spec["overrides"].items():
        command += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return command


def trainer_yaml(config: RealisticRunConfig, data_path: Path) -> dict[str, Any]:
    """The trainer config this benchmark runs (flags after `--` override it)."""
    return {
        "num_steps": config.num_steps,
        "prompts_per_rank": config.prompts_per_rank,
        "max_tokens_per_gpu": config.max_tokens_per_gpu or -(-(config.max_prompt_tokens + config.max_tokens)
                                                               // config.context_parallel),
        "max_lag": config.max_lag,
        "logprob_role": "reference",
        "checkpoint_every": 0,
        "seed": config.seed,
        "prompt_deadline_s": config.patience_s,
        "message_timeout_s": config.patience_s,
        "dist_timeout_s": config.patience_s,
        "tensorboard": False,
        "progress_bar": False,
        "model": {"gradient_checkpointing": config.gradient_checkpointing,
                  "logprob_chunk_size": config.logprob_chunk_size, "context_parallel": config.context_parallel},
        "optim": {"lr": config.lr},
        "loss": {"kl_coef": config.kl_coef, "kl_estimator": "k3"},
        "sampling": {"n": config.n, "max_tokens": config.max_tokens, "temperature": 1.0},
        "data": {"path": str(data_path), "format": "gsm8k", "chat_template": True,
                 "max_prompt_tokens": config.max_prompt_tokens},
        "eval": {"every": 0},
    }


def parameter_count(hf_config: dict[str, Any]) -> int:
    """Parameters of a Qwen2 model from its config.json (q/k/v biases; lm_head only when untied)."""
    hidden, vocab, inter = hf_config["hidden_size"], hf_config["vocab_size"], hf_config["intermediate_size"]
    head_dim = hf_config.get("head_dim") or hidden // hf_config["num_attention_heads"]
    kv = (hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]) * head_dim
    q = hf_config["num_attention_heads"] * head_dim
    layer = (hidden * q + q) + 2 * (hidden * kv + kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if hf_config.get("tie_word_embeddings") else 2)
    return hf_config["num_hidden_layers"] * layer + embeddings + hidden


def kv_bytes_per_token(hf_config: dict[str, Any], dtype: str) -> int:
    """K and V of one token over all layers."""
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    return 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ClusterSizing:
    """The engines' settings, derived from the resolved trainer config."""

    max_model_len: int
    max_num_seqs: int
    kv_cache_memory_bytes: int
    logprob_max_tokens: int


def cluster_sizing(config: RealisticRunConfig, trainer: Any, hf_config: dict[str, Any]) -> ClusterSizing:
    """Engine settings for `trainer` (a TrainerConfig): room for every sequence that can be in flight."""
    experience = trainer.experience
    max_model_len = trainer.data.max_prompt_tokens + experience.sampling.max_tokens
    # Only the first rank of a context-parallel group submits prompts.
    groups = config.nproc_per_node // trainer.model.context_parallel
    in_flight = (experience.max_lag + 1) * groups * trainer.prompts_per_rank * experience.sampling.n
    max_num_seqs = config.max_num_seqs or in_flight
    kv_bytes = config.kv_cache_memory_bytes or max(
        MIN_KV_CACHE_BYTES,
        math.ceil(max_num_seqs * max_model_len * kv_bytes_per_token(hf_config, config.dtype) * KV_CACHE_MARGIN
                  / 2**20) * 2**20,
    )
    return ClusterSizing(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes,
                         logprob_max_tokens=config.logprob_max_tokens or experience.sampling.n * max_model_len)


# ---- per-step and per-stage tables ------------------------------------------------------------

STEP_COLUMNS = (  # (metrics key, column, format)
    ("timing/step_s", "step_s", "{:.2f}"),
    ("timing/wait_s", "wait_s", "{:.2f}"),
    ("timing/train_s", "train_s", "{:.2f}"),
    ("timing/push_s", "push_s", "{:.2f}"),
    ("other_s", "other_s", "{:.2f}"),
    ("timing/batcher_generate_s_mean", "gen_req_s", "{:.2f}"),
    ("timing/batcher_logprob_s_mean", "logprob_req_s", "{:.2f}"),
    ("counts/tokens", "tokens", "{:.0f}"),
    ("counts/samples", "samples", "{:.0f}"),
    ("response/length_mean", "resp_len", "{:.0f}"),
    ("response/truncated_frac", "truncated", "{:.2f}"),
    ("perf/tokens_per_s", "train_tok_s", "{:.1f}"),
    ("staleness/mean", "staleness", "{:.1f}"),
)


def step_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step: each stage's seconds (other = step - wait - train - push) and the step's sizes."""
    rows = []
    for r in records:
        row: dict[str, Any] = {"step": r["step"]}
        for key, column, _ in STEP_COLUMNS:
            if key == "other_s":
                row[column] = r["timing/step_s"] - r["timing/wait_s"] - r["timing/train_s"] - r["timing/push_s"]
            elif key in r:
                row[column] = float(r[key])
        rows.append(row)
    return rows


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    columns = [c for _, c, _ in STEP_COLUMNS if all(c in row for row in rows)]
    return {"step": "median", **{c: statistics.median(row[c] for row in rows) for c in columns}}


def stage_times(*, started: float, launched: float, exited: float, events: dict[str, float],
                records: list[dict[str, Any]], torchrun_gone: float | None, prepare: dict[str, float]) -> dict[str, Any]:
    """Wall seconds of each stage (unix times in; None where the run did not get there)."""
    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 1)

    registered = {k.removeprefix("registered:"): v for k, v in events.items() if k.startswith("registered:")}
    # The dispatchers' own "worker <name> registered" lines (seen when polled, within poll_s):
    # local_cluster waits for its workers one after the other, so its lines can come later.
    own_lines = {k.removeprefix("worker_log_registered:"): v for k, v in events.items()
                 if k.startswith("worker_log_registered:")}
    trainer_started = events.get("trainer_started")
    first_step_start = records[0]["unix_time"] - records[0]["timing/step_s"] if records else None
    last_step_end = records[-1]["unix_time"] if records else None
    return {
        "prepare_s": round(launched - started, 1),
        "prepare": {k: round(v, 1) for k, v in prepare.items()},
        "cluster_start_s": span(launched, max(registered.values()) if registered else None),
        "worker_registered_after_s": {k: span(launched, v) for k, v in sorted(own_lines.items())},
        "trainer_startup_s": span(trainer_started, first_step_start),
        "trainer_model_built_after_s": span(trainer_started, events.get("trainer_model_built")),
        "trainer_initial_push_after_s": span(trainer_started, events.get("initial_push_done")),
        "steps_s": span(first_step_start, last_step_end),
        "trainer_end_s": span(last_step_end, torchrun_gone),
        "trainer_total_s": span(trainer_started, torchrun_gone),
        "shutdown_s": span(torchrun_gone, exited),
        "total_s": round(exited - started, 1),
    }


def steps_table(rows: list[dict[str, Any]]) -> str:
    columns = [(c, fmt) for _, c, fmt in STEP_COLUMNS if any(c in row for row in rows)]
    return format_table(
        ["step", *(c for c, _ in columns)],
        [[str(row["step"]), *(fmt.format(row[c]) if c in row else "-" for c, fmt in columns)] for row in rows],
    )


def final_line(report: dict[str, Any]) -> str:
    s = report["summary"]
    return (f"realistic_run: steps={s['steps']} model={s['model']} max_tokens={s['max_tokens']} "
            f"tokens_per_step={s['tokens_per_step']:.0f} step_s_median={s['step_s_median']:.1f} "
            f"peak_total_gb={s['peak_total_gb']:.2f} machine_peak_used_gb={s['machine_peak_used_gb']:.2f} "
            f"machine_baseline_gb={s['machine_baseline_gb']:.2f} sum_of_process_peaks_gb={s['sum_of_process_peaks_gb']:.2f}")
