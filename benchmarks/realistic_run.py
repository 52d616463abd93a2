"""The whole system on a model of a realistic shape with long responses: time per stage, peak RSS per process.

    cd /work/main && .venv/bin/python benchmarks/realistic_run.py                  # Qwen2.5-0.5B shape, 3 steps x 2048 tokens
    .venv/bin/python benchmarks/realistic_run.py --preset tiny --max_tokens 32 --num_steps 2 --work_dir runs/realistic-tiny
                                                                                  # ~3-5 min: checks the plumbing
    .venv/bin/python benchmarks/realistic_run.py ... -- --weight_push_mode sharded # trainer flags go after `--`

What runs: `local_cluster.py`, exactly as the demo starts it (a private Ray head on 127.0.0.1, one
vLLM generation worker, one logprob worker computing reference logprobs, `torchrun
--nproc_per_node=2 trainer_core.py` with FSDP2 on gloo, weight pushes through the registries), for
`--num_steps` steps on:
- a random-weight model of `--preset`'s shape (tiny_model.py; default `qwen2.5-0.5b`: hidden 896,
  24 layers, vocab 151,936, tied embeddings, 494M parameters, fp32, the chat tokenizer), written
  to `<work_dir>/model-<preset>-<dtype>[-<overrides hash>]` and reused when already there;
- `--num_problems` generated GSM8K-style word problems (`<work_dir>/gsm8k_synthetic.jsonl`,
  `question` / `answer` ending in `#### N`, deterministic for a `--data_seed`), trained with
  `data.format: gsm8k` and `data.chat_template: true`;
- long responses: `sampling.max_tokens` 2048. A random-weight model rarely emits EOS, so nearly
  every response runs to the limit (`response/truncated_frac` ~ 1).

Sizing (defaults fit the 2-core, 24 GiB CPU machine): 2 ranks x `--prompts_per_rank` 1 x `--n` 2
samples per step; the trainer's `max_tokens_per_gpu` defaults to `--max_prompt_tokens` +
`--max_tokens` (one longest sample per minibatch, the least memory the budget rule allows);
gradient checkpointing on; `model.logprob_chunk_size` 256 (an lm_head chunk costs chunk x vocab x
4 bytes: 156 MB at 256 x 151,936); reference logprobs with a small k3 KL (`--kl_coef`); no
evaluation, TensorBoard or progress bar; trainer timeouts (`message_timeout_s`,
`prompt_deadline_s`, `dist_timeout_s`) of `--patience_s` (CPU decoding of 2048 tokens at 0.5B
takes many minutes). The engines are sized from the resolved trainer config: `max_model_len` =
`data.max_prompt_tokens + sampling.max_tokens`; `max_num_seqs` = the sequences that can be in
flight at once, `(max_lag + 1) x ranks x prompts_per_rank x n`; the KV cache holds all of them
(from the model's layers, KV heads and head size, x1.25); the logprob worker's batch budget holds
one group (`n x max_model_len`). Trainer flags after `--` override the generated
`<work_dir>/trainer.yaml` (flags win), and the sizing follows them.

Measured:
- Peak RSS of every process of the run. Every `--poll_s` seconds the benchmark walks its own process
  tree (local_cluster.py owns the Ray head, so GCS, raylet and every Ray worker are descendants;
  torchrun and its ranks; the dispatchers; vLLM's engine core under the generation actor;
  verifier processes) and reads `/proc/<pid>/status`: `VmHWM` (the kernel's exact peak RSS of the
  process; only its last ~poll_s before exit can be missed), and the polled maxima of `RssAnon`
  (private memory) and `RssShmem` (shared memory: Ray's object store, /dev/shm). Processes are
  labelled by their title and command line (trainer ranks by RANK in their environment); the
  phase of the run when a process's VmHWM last rose is kept. RSS counts shared pages in every
  process that maps them, so the sum of the per-process peaks overstates the run's footprint:
  `peak_total_gb` is the largest coincident (same poll) total of the tree's private memory
  (sum of RssAnon) plus the largest shared memory of any one process (the processes share one
  Ray object store); the machine's used memory (MemTotal - MemAvailable, other jobs included) is
  reported beside it with its value before the run.
- Time per stage: preparation (model, data, config check), cluster start (launch until every
  worker registered), trainer start-up (torchrun until step 0 starts), the steps, the trainer's end
  (final checkpoint: `checkpoint_every: 0` still writes one at the end, model and full optimizer
  state) and shutdown; per step from metrics.jsonl: `timing/step_s` = `wait_s` (for rollouts) +
  `train_s` + `push_s` + the rest, the mean generate and logprob request times of the batcher,
  tokens trained (`counts/tokens`), mean response length and the truncated fraction, and the
  median over steps.

Printed: a per-process table (peak RSS, peak private, peak shared, phase at peak), a per-step
table, the stage times; the LAST line is
`realistic_run: steps=... model=... max_tokens=... tokens_per_step=... step_s_median=... peak_total_gb=...`
(then the machine's peak used memory and the sum of per-process peaks). Everything, with the
memory timeline, goes to `<work_dir>/report.json`. A failed run (non-zero exit, missing steps,
timeout) prints the last lines of its logs and exits 1. GB here is 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from metrics import read_metrics  # noqa: E402
from run_config import ConfigError, config_to_dict, load_config, split_passthrough  # noqa: E402
from tiny_model import PRESETS, ShapeOverrides  # noqa: E402

logger = logging.getLogger("realistic_run")

KB = 1024  # /proc reports kB (KiB)
GB = 1e9
KV_CACHE_MARGIN = 1.25  # vLLM rounds each sequence up to whole blocks and keeps some slack
MIN_KV_CACHE_BYTES = 64 * 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODEL_SPEC_FILE = "realistic_run_model.json"  # written last: its presence marks a complete model folder
LOG_TAIL_LINES = 40
PEAK_TOLERANCE_KB = 32 * 1024  # "phase at peak": the first phase within this (or the fraction below) of the peak
PEAK_TOLERANCE_FRAC = 0.02
STOP_GRACE_S = 180.0  # local_cluster stops the trainer (30 s grace), dispatchers (30 s each), Ray
_ASCTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass(kw_only=True, frozen=True)
class RealisticRunConfig:
    """Command line of `python benchmarks/realistic_run.py`; trainer flags go after `--`."""

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
    """Trainer minibatch budget; None: max_prompt_tokens + max_tokens (one longest sample)."""
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
    command = [sys.executable, str(REPO_ROOT / "tiny_model.py"), "--out_dir", str(out_dir),
               "--preset", spec["preset"], "--dtype", spec["dtype"]]
    for key, value in spec["overrides"].items():
        command += [f"--model.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return command


def trainer_yaml(config: RealisticRunConfig, data_path: Path) -> dict[str, Any]:
    """The trainer config this benchmark runs (flags after `--` override it)."""
    return {
        "num_steps": config.num_steps,
        "prompts_per_rank": config.prompts_per_rank,
        "max_tokens_per_gpu": config.max_tokens_per_gpu or config.max_prompt_tokens + config.max_tokens,
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
                  "logprob_chunk_size": config.logprob_chunk_size},
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
    max_model_len = trainer.data.max_prompt_tokens + trainer.sampling.max_tokens
    in_flight = (trainer.max_lag + 1) * config.nproc_per_node * trainer.prompts_per_rank * trainer.sampling.n
    max_num_seqs = config.max_num_seqs or in_flight
    kv_bytes = config.kv_cache_memory_bytes or max(
        MIN_KV_CACHE_BYTES,
        math.ceil(max_num_seqs * max_model_len * kv_bytes_per_token(hf_config, config.dtype) * KV_CACHE_MARGIN
                  / 2**20) * 2**20,
    )
    return ClusterSizing(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes,
                         logprob_max_tokens=config.logprob_max_tokens or trainer.sampling.n * max_model_len)


# ---- processes -------------------------------------------------------------------------------

IDLE_RAY_WORKER = "Ray idle worker"
UNKNOWN_RANK = "trainer rank ?"
_RAY_TITLES = {  # ray:: process titles (the actor class; Ray appends the running method)
    "GenerationWorkerActor": "generation worker actor",
    "LogprobWorkerActor": "logprob worker actor",
    "RegistryActor": "registry actor",
    "ExperienceBatcherActor": "experience batcher actor",
    "VerifierPoolActor": "verifier pool actor",
    "VerifierShardActor": "verifier shard actor",
    "IDLE": IDLE_RAY_WORKER,
    "DashboardAgent": "Ray dashboard agent",
    "RuntimeEnvAgent": "Ray runtime-env agent",
}
_SCRIPT_LABELS = (  # (substring of the command line, label), first match wins
    ("torch.distributed.run", "torchrun"),  # before trainer_core.py, which its command line names
    ("local_cluster.py", "local_cluster.py (Ray head driver)"),
    ("tiny_model.py", "prepare: model writer (tiny_model.py)"),
    ("gcs_server", "Ray GCS server"),
    ("dashboard/dashboard.py", "Ray dashboard head"),
    ("log_monitor.py", "Ray log monitor"),
    ("autoscaler/_private/monitor.py", "Ray monitor"),
)


def is_weak_label(label: str) -> bool:
    """A label that a later look at the process may improve: a Ray worker before its actor
    arrives, a process seen before its title was set (named after its executable), a trainer rank
    before its RANK was read."""
    return label in (IDLE_RAY_WORKER, UNKNOWN_RANK) or "(under " in label


def process_label(cmdline: str, *, rank: str | None = None, parent_label: str = "", anchor: str = "",
                  own: bool = False) -> str:
    """A readable role for a process of the run, from its command line (Ray workers: their title).

    parent_label: the parent process's label; anchor: the nearest ancestor's label that is not
    weak (is_weak_label), used to name helper processes (compilers, ...).
    """
    if own:
        return "realistic_run.py (this benchmark)"
    for needle, label in _SCRIPT_LABELS[:1]:
        if needle in cmdline:
            return label
    if "trainer_core.py" in cmdline:
        return f"trainer rank {rank}" if rank is not None else UNKNOWN_RANK
    if "worker_dispatcher.py" in cmdline:
        mode = re.search(r"--mode[= ](\w+)", cmdline)
        return f"dispatcher ({mode.group(1) if mode else '?'})"
    if "EngineCore" in cmdline:
        return "vLLM EngineCore"
    if cmdline.startswith("ray::"):
        title = re.split(r"[.\s]", cmdline[len("ray::"):], maxsplit=1)[0]
        return _RAY_TITLES.get(title, f"Ray actor {title}")
    first = cmdline.split(" ", 1)[0]
    if os.path.basename(first) == "raylet":
        return "raylet"
    for needle, label in _SCRIPT_LABELS[1:]:
        if needle in cmdline:
            return label
    if "multiprocessing.forkserver" in cmdline:
        if parent_label.startswith("forkserver of "):
            return "verifier process" if "verifier" in parent_label else f"process forked by {parent_label[14:]}"
        return f"forkserver of {anchor or parent_label}"
    if "multiprocessing.resource_tracker" in cmdline:
        return f"resource tracker of {anchor or parent_label}"
    return f"{os.path.basename(first)[:40]} (under {anchor or parent_label or '?'})"


def parse_status(text: str) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status (VmHWM, VmRSS, RssAnon, RssFile, RssShmem, ...) or /proc/meminfo."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0])
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process is gone (or not ours)
        return None


def _environ_rank(pid: int) -> str | None:
    text = _read(f"/proc/{pid}/environ")
    if text is None:
        return None
    for entry in text.split("\0"):
        if entry.startswith("RANK="):
            return entry[len("RANK="):]
    return None


@dataclass
class ProcessRecord:
    """What the monitor keeps of one process."""

    pid: int
    label: str
    cmdline: str
    first_seen_s: float
    last_seen_s: float
    anchor: str = ""  # the label itself, or the nearest ancestor's that is not weak
    peak_rss_kb: int = 0  # VmHWM, the kernel's own high-water mark
    peak_anon_kb: int = 0  # polled max of RssAnon
    peak_shmem_kb: int = 0  # polled max of RssShmem
    rises: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (VmHWM, phase) when it rose

    @property
    def phase_at_peak(self) -> str:
        """The phase in which VmHWM first came within PEAK_TOLERANCE of its final value (later
        rises by a few MB, e.g. at shutdown, do not move it)."""
        near = self.peak_rss_kb - max(PEAK_TOLERANCE_KB, PEAK_TOLERANCE_FRAC * self.peak_rss_kb)
        return next((phase for hwm, phase in self.rises if hwm >= near), "")

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "label": self.label, "cmdline": self.cmdline[:300],
                "peak_rss_gb": round(self.peak_rss_kb * KB / GB, 3), "peak_anon_gb": round(self.peak_anon_kb * KB / GB, 3),
                "peak_shmem_gb": round(self.peak_shmem_kb * KB / GB, 3), "phase_at_peak": self.phase_at_peak,
                "first_seen_s": round(self.first_seen_s, 1), "last_seen_s": round(self.last_seen_s, 1)}


def merge_rows(records: list[ProcessRecord]) -> list[dict[str, Any]]:
    """One row per process, largest peak first. Processes sharing a label get #1, #2 (by start
    order); helper processes still weakly labelled (compilers, ...) are merged into one row per
    label: peaks are the largest of them, `count` says how many."""
    by_label: dict[str, list[ProcessRecord]] = {}
    for record in sorted(records, key=lambda r: (r.first_seen_s, r.pid)):
        by_label.setdefault(record.label, []).append(record)
    rows = []
    for label, group in by_label.items():
        if len(group) > 1 and "(under " in label:
            top = max(group, key=lambda r: r.peak_rss_kb)
            row = top.as_dict()
            row.update(label=f"{label} x{len(group)}", count=len(group),
                       peak_anon_gb=round(max(r.peak_anon_kb for r in group) * KB / GB, 3),
                       peak_shmem_gb=round(max(r.peak_shmem_kb for r in group) * KB / GB, 3))
            rows.append(row)
            continue
        for i, record in enumerate(group, 1):
            row = record.as_dict()
            row["label"] = label if len(group) == 1 else f"{label} #{i}"
            row["count"] = 1
            rows.append(row)
    rows.sort(key=lambda r: -r["peak_rss_gb"])
    return rows


class ProcessMonitor:
    """Peak memory of every process in this process's tree, and coincident totals, per poll.

    The run's total at one poll is the tree's private memory (sum of RssAnon) plus the largest
    shared memory (RssShmem) of any one process: the processes share one object store, whose
    pages RSS counts in each process that touched them.
    """

    def __init__(self, started: float) -> None:
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(os.getpid())
        self.started = started
        self.records: dict[int, ProcessRecord] = {}
        meminfo = parse_status(_read("/proc/meminfo") or "")
        self.mem_total_kb = meminfo["MemTotal"]
        self.baseline_used_kb = meminfo["MemTotal"] - meminfo["MemAvailable"]
        self.peak_used_kb = self.baseline_used_kb
        self.peak_total_kb = 0
        self.peak_total_phase = ""
        self.peak_total_at_s = 0.0
        self.peak_tree_anon_kb = 0
        self.timeline: list[list[float]] = []  # [t_s, tree private GB, largest shared GB, machine used GB]
        self.poll_cpu_s = 0.0

    def sample(self, phase: str) -> None:
        cpu0 = time.process_time()
        now = time.monotonic() - self.started
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except self._psutil.Error:
            processes = [self._root]
        processes.sort(key=lambda proc: proc.pid)  # parents first, mostly (pids are allocated upwards)
        tree_anon = max_shmem = 0
        for proc in processes:
            status = _read(f"/proc/{proc.pid}/status")
            if status is None:
                continue
            record = self._identify(proc, now)
            if record is None:
                continue
            fields = parse_status(status)
            record.last_seen_s = now
            hwm = fields.get("VmHWM", 0)
            if hwm > record.peak_rss_kb:
                record.peak_rss_kb = hwm
                record.rises.append((hwm, phase))
            record.peak_anon_kb = max(record.peak_anon_kb, fields.get("RssAnon", 0))
            record.peak_shmem_kb = max(record.peak_shmem_kb, fields.get("RssShmem", 0))
            tree_anon += fields.get("RssAnon", 0)
            max_shmem = max(max_shmem, fields.get("RssShmem", 0))
        meminfo = parse_status(_read("/proc/meminfo") or "")
        used = meminfo["MemTotal"] - meminfo["MemAvailable"]
        self.peak_used_kb = max(self.peak_used_kb, used)
        self.peak_tree_anon_kb = max(self.peak_tree_anon_kb, tree_anon)
        if tree_anon + max_shmem > self.peak_total_kb:
            self.peak_total_kb, self.peak_total_phase, self.peak_total_at_s = tree_anon + max_shmem, phase, now
        self.timeline.append([round(now, 1), round(tree_anon * KB / GB, 3), round(max_shmem * KB / GB, 3),
                              round(used * KB / GB, 3)])
        self.poll_cpu_s += time.process_time() - cpu0

    def _identify(self, proc: Any, now: float) -> ProcessRecord | None:
        """The process's record, its label refreshed (a weak label never replaces a strong one)."""
        record = self.records.get(proc.pid)
        try:
            cmdline = " ".join(proc.cmdline()) or proc.name()
            parent = self.records.get(proc.ppid())
        except self._psutil.Error:
            return record
        if record is not None and record.cmdline == cmdline and not is_weak_label(record.label):
            return record
        label = process_label(
            cmdline, rank=_environ_rank(proc.pid) if "trainer_core.py" in cmdline else None,
            parent_label=parent.label if parent else "", anchor=parent.anchor if parent else "",
            own=proc.pid == os.getpid(),
        )
        if record is None:
            record = ProcessRecord(pid=proc.pid, label=label, cmdline=cmdline, first_seen_s=now, last_seen_s=now)
            self.records[proc.pid] = record
        elif is_weak_label(label) and not is_weak_label(record.label):
            return record
        record.label, record.cmdline = label, cmdline
        record.anchor = record.label if not is_weak_label(label) else (parent.anchor if parent else "")
        return record

    def table_rows(self) -> list[dict[str, Any]]:
        return merge_rows(list(self.records.values()))


# ---- the run's progress and stages -------------------------------------------------------------

def line_time(line: str) -> float | None:
    """Unix time of a log line starting with logging's asctime (local time), else None."""
    match = _ASCTIME.match(line)
    if not match:
        return None
    return datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


_EVENTS = (  # (regex on a log line, event name; {0} = the first group)
    (re.compile(r"Ray head at "), "ray_head_started"),
    (re.compile(r"(\S+) worker registered"), "registered:{0}"),
    (re.compile(r"starting trainer: "), "trainer_started"),
    (re.compile(r"FSDP2 model from "), "trainer_model_built"),
    (re.compile(r"pushed weights v0 "), "initial_push_done"),
    (re.compile(r"^worker (\S+) registered$"), "worker_log_registered:{0}"),
    (re.compile(r"checkpoint written: "), "checkpoint_written"),
    (re.compile(r"training finished at step"), "training_finished"),
    (re.compile(r"local cluster stopped"), "cluster_stopped"),
)


class LogWatcher:
    """Follows growing logs (a fixed one plus any matching a glob) and records when each event
    first appeared: the line's own timestamp, or when it was read for lines without one."""

    def __init__(self, path: Path, extra_glob: tuple[Path, str] | None = None) -> None:
        self.path = path
        self.extra_glob = extra_glob
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.events: dict[str, float] = {}

    def poll(self) -> None:
        paths = [self.path]
        if self.extra_glob is not None:
            folder, pattern = self.extra_glob
            paths += sorted(folder.glob(pattern))
        for path in paths:
            self._read_new(path)

    def _read_new(self, path: Path) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return
        self._offsets[path] = offset + len(chunk)
        lines = (self._partial.get(path, "") + chunk.decode(errors="replace")).split("\n")
        self._partial[path] = lines.pop()
        for line in lines:
            self.feed(line)

    def feed(self, line: str, now: float | None = None) -> None:
        line = line.rstrip("\r")
        for pattern, name in _EVENTS:
            match = pattern.search(line)
            if match:
                self.events.setdefault(name.format(*match.groups()), line_time(line) or now or time.time())


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def phase_of(watcher: LogWatcher, steps_done: int, num_steps: int, cluster_running: bool) -> str:
    """The run's phase, from what the logs and metrics.jsonl show so far."""
    events = watcher.events
    if not cluster_running:
        return "prepare" if "ray_head_started" not in events else "shutdown"
    if "trainer_started" not in events:
        return "cluster start"
    if steps_done >= num_steps:
        return "final checkpoint" if "training_finished" not in events else "shutdown"
    if steps_done > 0 or "initial_push_done" in events:
        return f"step {steps_done}"
    return "trainer start-up (first push)" if "trainer_model_built" in events else "trainer start-up (model load)"


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


# ---- output ----------------------------------------------------------------------------------

def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def process_table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        ["process", "peak RSS GB", "peak private GB", "peak shared GB", "phase at peak", "pid"],
        [[r["label"], f"{r['peak_rss_gb']:.2f}", f"{r['peak_anon_gb']:.2f}", f"{r['peak_shmem_gb']:.2f}",
          r["phase_at_peak"], str(r["pid"])] for r in rows],
    )


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


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")


def first_errors(path: Path, limit: int = 5) -> list[str]:
    """The first distinct `SomethingError: message` lines of a log (the root cause usually comes
    before torchrun's and local_cluster's own summaries), rank prefixes dropped."""
    seen: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return seen
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if _ERROR_LINE.search(line) and "ChildFailedError" not in line and line not in seen:
            seen.append(line)
            if len(seen) == limit:
                break
    return seen


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


# ---- the benchmark ---------------------------------------------------------------------------

class RunFailed(RuntimeError):
    """The run did not complete; the message names the logs to read."""


def interrupt_on_sigterm() -> None:
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def run_polled(command: list[str], log: Path, monitor: ProcessMonitor, *, timeout_s: float,
               phase: Callable[[], str], on_poll: Callable[[], None] = lambda: None, poll_s: float = 2.0,
               new_session: bool = False) -> int:
    """Run `command` (output to `log`), sampling the process tree every poll_s; its exit code.

    On timeout or interruption the child gets SIGTERM (local_cluster then stops everything it
    started), and SIGKILL after STOP_GRACE_S.
    """
    deadline = time.monotonic() + timeout_s
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   start_new_session=new_session)
        try:
            while process.poll() is None:
                on_poll()
                monitor.sample(phase())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{Path(command[1]).name} still running after {timeout_s:.0f} s")
                try:
                    process.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
            on_poll()
            return process.returncode
        except BaseException:
            if process.poll() is None:
                logger.warning("stopping %s (SIGTERM, then SIGKILL after %.0f s)", Path(command[1]).name, STOP_GRACE_S)
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            raise


def prepare_model(config: RealisticRunConfig, work_dir: Path, monitor: ProcessMonitor) -> tuple[Path, bool]:
    """The model folder (written by tiny_model.py unless a complete one with the same spec is there)."""
    spec = model_spec(config)
    model_dir = work_dir / model_dir_name(spec)
    spec_path = model_dir / MODEL_SPEC_FILE
    if spec_path.is_file() and json.loads(spec_path.read_text()) == spec and (model_dir / "config.json").is_file():
        logger.info("reusing the model in %s", model_dir)
        return model_dir, True
    spec_path.unlink(missing_ok=True)
    command = model_writer_command(spec, model_dir)
    logger.info("writing the model: %s", " ".join(command[1:]))
    log = work_dir / "model_writer.log"
    rc = run_polled(command, log, monitor, timeout_s=config.timeout_s, phase=lambda: "prepare", poll_s=config.poll_s)
    if rc != 0:
        raise RunFailed(f"tiny_model.py exited with {rc}; last lines of {log}:\n{tail(log)}")
    spec_path.write_text(json.dumps(spec, indent=1))
    return model_dir, False


def resolve_trainer(config: RealisticRunConfig, yaml_path: Path, run_dir: Path, model_dir: Path,
                    passthrough: list[str]) -> Any:
    """The TrainerConfig the trainer will build from the same arguments (validated here, before any
    worker starts)."""
    from trainer_core import TrainerConfig

    argv = ["--config", str(yaml_path), "--run_dir", str(run_dir), "--model.model_path", str(model_dir), *passthrough]
    try:
        return load_config(TrainerConfig, argv)
    except (ConfigError, ValueError) as exc:
        raise RunFailed(f"the trainer config is invalid: {exc}") from None


def prompt_lengths(trainer: Any) -> list[int]:
    """Token counts of the training prompts, loaded exactly as the trainer loads them."""
    from dataset import load_prompts
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(trainer.model.model_path)
    try:
        return [len(s.input_token_ids) for s in load_prompts(trainer.data, tokenizer)]
    except ValueError as exc:  # DatasetError: a prompt over data.max_prompt_tokens, no chat template, ...
        raise RunFailed(f"the training prompts do not load as the trainer would load them: {exc}") from None


def run(config: RealisticRunConfig, passthrough: list[str]) -> dict[str, Any]:
    started_wall, started = time.time(), time.monotonic()
    work_dir = Path(config.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    run_dir = work_dir / "run"
    if config.malloc_mmap_threshold_bytes:  # read by glibc at each child's start; children inherit it
        for variable in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
            os.environ[variable] = str(config.malloc_mmap_threshold_bytes)
    monitor = ProcessMonitor(started)
    monitor.sample("prepare")
    prepare: dict[str, float] = {}

    t = time.monotonic()
    model_dir, reused = prepare_model(config, work_dir, monitor)
    prepare["model_s"] = time.monotonic() - t
    t = time.monotonic()
    data_path = write_gsm8k(work_dir / "gsm8k_synthetic.jsonl", config.num_problems, config.data_seed)
    yaml_path = work_dir / "trainer.yaml"
    yaml_path.write_text(yaml.safe_dump(trainer_yaml(config, data_path), sort_keys=False))
    trainer = resolve_trainer(config, yaml_path, run_dir, model_dir, passthrough)
    hf_config = json.loads((model_dir / "config.json").read_text())
    sizing = cluster_sizing(config, trainer, hf_config)
    if sizing.max_model_len > hf_config.get("max_position_embeddings", sizing.max_model_len):
        raise RunFailed(f"max_model_len {sizing.max_model_len} (data.max_prompt_tokens + sampling.max_tokens) exceeds "
                        f"the model's max_position_embeddings {hf_config['max_position_embeddings']}; pass "
                        f"--model.max_position_embeddings or lower --max_tokens / --max_prompt_tokens")
    lengths = prompt_lengths(trainer)
    prepare["data_and_config_s"] = time.monotonic() - t
    monitor.sample("prepare")
    logger.info("prompts: %d, %d-%d tokens; engines: %s", len(lengths), min(lengths), max(lengths), sizing)

    if run_dir.exists():
        shutil.rmtree(run_dir)  # metrics.jsonl appends, and a checkpoint there would be resumed from
    command = [
        sys.executable, str(REPO_ROOT / "local_cluster.py"), "--model_path", str(model_dir), "--run_dir", str(run_dir),
        "--nproc_per_node", str(config.nproc_per_node), "--dtype", config.dtype,
        "--kv_cache_memory_bytes", str(sizing.kv_cache_memory_bytes), "--max_model_len", str(sizing.max_model_len),
        "--max_num_seqs", str(sizing.max_num_seqs), "--max_tokens_per_forward", str(sizing.logprob_max_tokens),
        "--global_num_verifiers", str(config.global_num_verifiers),
        "--worker_start_timeout_s", str(config.worker_start_timeout_s),
        "--", "--config", str(yaml_path), *passthrough,
    ]
    log = work_dir / "local_cluster.log"
    logger.info("running: %s (log: %s)", " ".join(command[1:]), log)
    watcher = LogWatcher(log, (run_dir, "*.log"))  # *_worker.log and run.log (every INFO line)
    metrics_path = run_dir / "metrics.jsonl"
    torchrun_gone: list[float] = []

    def on_poll() -> None:
        watcher.poll()
        alive = [r for r in monitor.records.values() if r.label == "torchrun"]
        if alive and not torchrun_gone and all(not Path(f"/proc/{r.pid}").exists() for r in alive):
            torchrun_gone.append(started_wall + max(r.last_seen_s for r in alive))

    cluster_state = {"running": False}

    def phase() -> str:
        return phase_of(watcher, count_lines(metrics_path), trainer.num_steps, cluster_state["running"])

    launched = time.time()
    cluster_state["running"] = True
    failure = ""
    try:
        rc = run_polled(command, log, monitor, timeout_s=config.timeout_s, phase=phase, on_poll=on_poll,
                        poll_s=config.poll_s, new_session=True)
        if rc != 0:
            failure = f"local_cluster.py exited with {rc}"
    except TimeoutError as exc:
        failure = str(exc)
    exited = time.time()
    cluster_state["running"] = False
    monitor.sample("shutdown")
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    if not failure and len(records) < trainer.num_steps:
        failure = f"metrics.jsonl has {len(records)} of {trainer.num_steps} steps"
    if not torchrun_gone:
        torchrun_gone.append(exited)

    rows = step_rows(records)
    processes = monitor.table_rows()
    report: dict[str, Any] = {
        "status": "failed" if failure else "ok",
        "failure": failure,
        "command": " ".join([sys.executable, *sys.argv]),
        "config": config_to_dict(config),
        "trainer_config": config_to_dict(trainer),
        "model_dir": str(model_dir),
        "model_reused": reused,
        "model_parameters": parameter_count(hf_config),
        "prompt_tokens": {"count": len(lengths), "min": min(lengths), "max": max(lengths),
                          "mean": round(statistics.mean(lengths), 1)},
        "cluster": dataclasses.asdict(sizing),
        "stages": stage_times(started=started_wall, launched=launched, exited=exited, events=watcher.events,
                              records=records, torchrun_gone=torchrun_gone[0], prepare=prepare),
        "steps": rows,
        "steps_median": median_row(rows) if rows else {},
        "processes": processes,
        "memory": {
            "peak_total_gb": round(monitor.peak_total_kb * KB / GB, 3),
            "peak_total_phase": monitor.peak_total_phase,
            "peak_total_at_s": round(monitor.peak_total_at_s, 1),
            "peak_tree_private_gb": round(monitor.peak_tree_anon_kb * KB / GB, 3),
            "sum_of_process_peaks_gb": round(sum(r["peak_rss_gb"] for r in processes), 3),
            "machine_total_gb": round(monitor.mem_total_kb * KB / GB, 3),
            "machine_baseline_used_gb": round(monitor.baseline_used_kb * KB / GB, 3),
            "machine_peak_used_gb": round(monitor.peak_used_kb * KB / GB, 3),
            "poll_s": config.poll_s,
            "polls": len(monitor.timeline),
            "poll_cpu_s": round(monitor.poll_cpu_s, 2),
            "timeline_columns": ["t_s", "tree_private_gb", "largest_shared_gb", "machine_used_gb"],
            "timeline": monitor.timeline,
        },
        "logs": {"local_cluster": str(log), "run_dir": str(run_dir),
                 "workers": sorted(str(p) for p in run_dir.glob("*_worker.log"))},
    }
    report["summary"] = {
        "steps": len(records),
        "model": model_dir.name.removeprefix("model-"),
        "max_tokens": trainer.sampling.max_tokens,
        "tokens_per_step": report["steps_median"].get("tokens", 0.0),
        "step_s_median": report["steps_median"].get("step_s", 0.0),
        "peak_total_gb": report["memory"]["peak_total_gb"],
        "machine_peak_used_gb": report["memory"]["machine_peak_used_gb"],
        "machine_baseline_gb": report["memory"]["machine_baseline_used_gb"],
        "sum_of_process_peaks_gb": report["memory"]["sum_of_process_peaks_gb"],
    }
    (work_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict[str, Any]) -> None:
    memory, stages = report["memory"], report["stages"]
    print(f"\nPeak memory per process (GB = 1e9 bytes; RSS = VmHWM; private = RssAnon, shared = RssShmem, "
          f"polled every {memory['poll_s']} s):")
    print(process_table(report["processes"]))
    print(f"\npeak total {memory['peak_total_gb']:.2f} GB (private memory of all processes + the largest shared, "
          f"same poll; "
          f"{memory['peak_total_phase']}, t={memory['peak_total_at_s']:.0f} s); sum of per-process peaks "
          f"{memory['sum_of_process_peaks_gb']:.2f} GB; machine used {memory['machine_baseline_used_gb']:.2f} GB "
          f"before -> {memory['machine_peak_used_gb']:.2f} GB peak of {memory['machine_total_gb']:.2f} GB "
          f"(other jobs included)")
    if report["steps"]:
        print("\nPer step (seconds; gen_req_s / logprob_req_s: mean per prompt request, concurrent; tokens: trained, "
              "all ranks):")
        print(steps_table([*report["steps"], report["steps_median"]]))
    print("\nStages (wall seconds):")
    for key, value in stages.items():
        print(f"  {key}: {value}")
    if not any("verifier" in r["label"] for r in report["processes"]):
        all_cut = report["steps"] and all(row.get("truncated") == 1.0 for row in report["steps"])
        print("\nno verifier process was seen" + (
            ": every response was cut off at max_tokens and scored sampling.truncated_reward without "
            "verification (a random-weight model rarely ends its turn)" if all_cut else ""))
    p = report["prompt_tokens"]
    c = report["cluster"]
    print(f"\nprompts {p['count']} ({p['min']}-{p['max']} tokens, mean {p['mean']}); engines: max_model_len "
          f"{c['max_model_len']}, max_num_seqs {c['max_num_seqs']}, KV cache {c['kv_cache_memory_bytes'] / 2**20:.0f} MiB, "
          f"logprob budget {c['logprob_max_tokens']} tokens; report: {Path(report['logs']['run_dir']).parent / 'report.json'}")


def print_failure(report: dict[str, Any], program: str) -> None:
    """To stderr: the tail of every log of a failed run, the first errors found in them, the failure."""
    paths = [Path(p) for p in [report["logs"]["local_cluster"], *report["logs"]["workers"]]]
    for path in paths:
        print(f"\n---- last lines of {path} ----\n{tail(path)}", file=sys.stderr)
    errors = [f"  {path.name}: {line}" for path in paths for line in first_errors(path)]
    if errors:
        print("\nfirst errors in the logs:\n" + "\n".join(errors), file=sys.stderr)
    print(f"\n{program}: FAILED: {report['failure']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = load_config(RealisticRunConfig, own, description=__doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interrupt_on_sigterm()
    try:
        report = run(config, passthrough)
    except (RunFailed, TimeoutError) as exc:
        print(f"realistic_run: FAILED: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if report["status"] != "ok":
        print_failure(report, "realistic_run")
        return 1
    print(final_line(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
