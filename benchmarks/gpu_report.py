"""One command for the GPU figures, written as one markdown table.

    python -m benchmarks.gpu_report                              # on a CUDA machine
    python -m benchmarks.gpu_report --out runs/gpu_report.md --presets qwen2.5-0.5b
    python -m benchmarks.gpu_report --smoke true                 # plumbing check, any machine (CPU too)

In order, each as its own process (a failure is a row, not the end of the report):

1. the gpu test tier (`scripts/test.sh --gpu`): passed / failed / skipped, with the skip reasons;
2. benchmarks.trainer_throughput at each preset (qwen2.5-0.5b, qwen2.5-1.5b) with 16,384 packed
   tokens per minibatch, once per attention implementation (the trainer's default, then
   packed_varlen: torch's flash-attention varlen kernel): tokens/s and MFU against the GPU's dense
   bf16 datasheet peak (trainer_throughput.GPU_PEAK_BF16_TFLOPS, by device name, with its source).
   Gradient checkpointing is on for a row whose trainer-rank estimate without it
   (placement.trainer_bytes, the launcher's plan) exceeds the card's memory less the plan's
   margin, so every row is sized to fit one card; the row's notes say which and why;
3. benchmarks.logprob_batching: the batched / one-sample-per-forward throughput ratio, through
   LogprobWorkers where Ray is installed, else `--engine model` (TokenLogprobModel alone);
4. the weight push: the trainer side's first hop, a device-to-host copy of the first preset's
   bf16 weights into pinned memory (GB/s, best of WEIGHT_COPY_REPS against the same bytes'
   device-to-device copy measured in this run); vLLM's NCCL push to an engine needs vLLM and a
   second GPU (tests/weights/test_gpu_weight_transfer.py checks it where they exist).

Parts whose requirements are missing here (the GPU machine has torch and transformers, no Ray,
no vLLM, no flash-attn) are rows that say "skipped" and why. Without CUDA (and outside smoke
mode) it stops at once with one line. The table goes to --out and to stdout; the last line is
`gpu_report: rows=N skipped=M failed=F out=PATH`, and the exit status is 1 when any row failed
(a part that exits non-zero or runs past --part_timeout_s), so a caller cannot read a broken
report as a pass.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from async_grpo.launch.placement import SAFETY_FRACTION, GiB, ModelShape, RunShape, trainer_bytes
from async_grpo.demo_assets.tiny_model import PRESETS, build_chat_tokenizer, build_tiny_tokenizer, hf_config
from benchmarks.harness import (
    apply_smoke, load_bench_config, parse_summary_line, REPO_ROOT, setup_logging, summary_line,
)

logger = logging.getLogger("benchmarks.gpu_report")

TOKENS_PER_MINIBATCH = 16384  # the shape: 16k packed tokens per rank
BYTES_PER_BF16 = 2
WEIGHT_COPY_REPS = 5  # timings of the weight copy; the fastest counts (the copy itself does not vary)
DIAGNOSTIC_CHARS = 300  # the end of a failed part's last line, in its row
NO_CUDA = "gpu_report: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine"
FAILED_EXIT = 1  # the exit status when any row failed
TIMED_OUT = 124  # a part's status when it ran past part_timeout_s (timeout(1)'s)

SMOKE = {"presets": ("tiny",), "attn_implementations": ("",), "steps": 1, "warmup": 0, "tokens_per_rank": 256}
"""Sizes of the smoke mode: the tiny model, one step, the default attention only (logprob_batching
runs its own smoke)."""


@dataclass(kw_only=True, frozen=True)
class ReportConfig:
    """What the report runs: the command line of `benchmarks/gpu_report.py`."""

    out: str = "runs/gpu_report.md"
    """Where the markdown table is written (its folder is created)."""
    presets: tuple[str, ...] = ("qwen2.5-0.5b", "qwen2.5-1.5b")
    """Model shapes for trainer_throughput (tiny_model.PRESETS)."""
    attn_implementations: tuple[str, ...] = ("", "packed_varlen")
    """Attention implementations for trainer_throughput; '' is the trainer's default."""
    tokens_per_rank: int = TOKENS_PER_MINIBATCH
    """Packed tokens per minibatch in trainer_throughput."""
    warmup: int = 2
    """trainer_throughput's untimed steps."""
    steps: int = 5
    """trainer_throughput's timed steps (median reported)."""
    run_tests: bool = True
    """Run the gpu test tier first."""
    run_logprob_batching: bool = True
    """Run benchmarks.logprob_batching (when Ray is importable)."""
    part_timeout_s: float = 1800.0
    """Longest any one part may run before it is a failed row."""
    gpu_memory_gib: float = 0.0
    """Card memory the gradient-checkpointing choice fits each trainer_throughput row into; 0: GPU 0's
    own (without CUDA, smoke mode: no limit, checkpointing off)."""
    smoke: bool = False
    """Smoke mode (SMOKE): the tiny model, one step, on any device; checks the plumbing, figures mean nothing."""

    def __post_init__(self) -> None:
        if not self.presets:
            raise ValueError("ReportConfig.presets must name at least one preset")
        unknown = [p for p in self.presets if p not in PRESETS]
        if unknown:
            raise ValueError(f"ReportConfig.presets: unknown {unknown}; known: {sorted(PRESETS)}")
        if self.tokens_per_rank < 2 or self.steps < 1 or self.warmup < 0:
            raise ValueError("ReportConfig: tokens_per_rank >= 2, steps >= 1 and warmup >= 0 required")
        if self.part_timeout_s <= 0:
            raise ValueError(f"ReportConfig.part_timeout_s must be > 0, got {self.part_timeout_s}")
        if self.gpu_memory_gib < 0:
            raise ValueError(f"ReportConfig.gpu_memory_gib must be >= 0, got {self.gpu_memory_gib}")


@dataclass(slots=True)
class Row:
    """One line of the report."""

    part: str
    """Which measurement (gpu tier, trainer_throughput ..., logprob batching, weight push)."""
    figures: str
    """The figures, or '' when skipped or failed."""
    status: str = "ok"
    """'ok', 'skipped: <why>' or 'failed: <why>'."""
    notes: str = ""
    """Settings and sources behind the figures."""


@dataclass(slots=True)
class Report:
    rows: list[Row] = field(default_factory=list)

    def markdown(self, header: str) -> str:
        lines = [header, "", "| part | figures | status | notes |", "|---|---|---|---|"]
        lines += [f"| {r.part} | {r.figures} | {r.status} | {r.notes} |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def count(self, prefix: str) -> int:
        return sum(r.status.startswith(prefix) for r in self.rows)

    def failed_parts(self) -> list[str]:
        """The parts of the rows that failed, in report order."""
        return [r.part for r in self.rows if r.status.startswith("failed")]


def _run(command: list[str], timeout_s: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a part; 124 and what it printed when it timed out."""
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        return TIMED_OUT, _text(error.stdout), _text(error.stderr)
    return done.returncode, done.stdout, done.stderr


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _failure(status: int, stdout: str, stderr: str, config: ReportConfig) -> str:
    """A failed row's status: a timeout as such, else the exit status and the output's last line."""
    if status == TIMED_OUT:
        return f"failed: timed out after {config.part_timeout_s:g} s (--part_timeout_s)"
    return f"failed: exit {status}: {_cell(_last_line(stderr or stdout))}"


def _cell(text: str) -> str:
    """Text fit for a table cell: its end (errors end with the cause), no pipes."""
    return text[-DIAGNOSTIC_CHARS:].replace("|", "/")


def gpu_tier_row(config: ReportConfig) -> Row:
    part = "gpu test tier (scripts/test.sh --gpu)"
    if not torch.cuda.is_available():  # smoke mode on a CPU: test.sh --gpu refuses to run without CUDA
        return Row(part=part, figures="", status="skipped: no CUDA device (scripts/test.sh --gpu needs one)")
    status, stdout, stderr = _run(["bash", "scripts/test.sh", "--gpu"], config.part_timeout_s)
    # pytest's closing line, e.g. "===== 3 passed, 4 skipped in 51.20s =====".
    closing = re.findall(r"^=+ (.+) in [\d.]+s(?: \([\d:]+\))? =+$", stdout, flags=re.MULTILINE)
    figures = closing[-1] if closing else _cell(_last_line(stdout + stderr))
    notes = sorted(set(re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.+)", stdout)))
    notes += re.findall(r"^(\d+ gpu tests deselected: .+)$", stdout, flags=re.MULTILINE)
    state = "ok" if status == 0 else _failure(status, stdout, stderr, config)
    return Row(part=part, figures=figures, status=state, notes="; ".join(notes))


def _preset_shape(preset: str) -> ModelShape:
    """The memory estimate's view of a preset (its tokenizer fixes the vocabulary of 'tiny')."""
    shape = PRESETS[preset]
    tokenizer = build_tiny_tokenizer() if shape.tokenizer == "char" else build_chat_tokenizer()
    return ModelShape.from_hf_config(hf_config(shape, tokenizer).to_dict())


def card_memory_bytes(config: ReportConfig) -> int | None:
    """The memory each trainer_throughput row must fit: --gpu_memory_gib, else GPU 0's; None without CUDA."""
    if config.gpu_memory_gib:
        return int(config.gpu_memory_gib * GiB)
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def checkpointing_choice(preset: str, tokens_per_rank: int, memory_bytes: int | None) -> tuple[bool, str]:
    """(gradient checkpointing on, why): on when the launcher's trainer-rank estimate without it
    exceeds the card's memory less the margin the plan leaves on a shared GPU (SAFETY_FRACTION)."""
    if memory_bytes is None:
        return False, "gradient checkpointing off (no card memory to fit)"
    shape = _preset_shape(preset)
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=tokens_per_rank)
    without = trainer_bytes(shape, run)
    usable = memory_bytes * (1 - SAFETY_FRACTION)
    if without <= usable:
        return False, f"gradient checkpointing off (estimate {without / GiB:.1f} GiB fits {usable / GiB:.1f} GiB)"
    with_it = trainer_bytes(shape, RunShape(trainer_ranks=1, max_tokens_per_gpu=tokens_per_rank,
                                            gradient_checkpointing=True))
    fits = "fits" if with_it <= usable else "still exceeds"
    return True, (f"gradient checkpointing on (estimate {without / GiB:.1f} GiB without it exceeds "
                  f"{usable / GiB:.1f} GiB; {with_it / GiB:.1f} GiB with it {fits})")


def throughput_row(config: ReportConfig, preset: str, attn: str, memory_bytes: int | None) -> Row:
    part = f"trainer_throughput {preset}, attn {attn or 'default'}"
    checkpointing, why = checkpointing_choice(preset, config.tokens_per_rank, memory_bytes)
    command = [sys.executable, "-m", "benchmarks.trainer_throughput", "--preset", preset,
               "--tokens_per_rank", str(config.tokens_per_rank), "--warmup", str(config.warmup),
               "--steps", str(config.steps), "--gradient_checkpointing", str(checkpointing).lower()]
    if attn:
        command += ["--attn_implementation", attn]
    if not torch.cuda.is_available():
        command += ["--peak_tflops", "1.0"]  # smoke on a CPU: no datasheet peak; the figure means nothing
    status, stdout, stderr = _run(command, config.part_timeout_s)
    _, figures = parse_summary_line(_last_line(stdout))
    if status != 0 or "tokens_per_s" not in figures:
        return Row(part=part, figures="", status=_failure(status, stdout, stderr, config), notes=why)
    shown = (f"{float(figures['tokens_per_s']):,.0f} tokens/s, MFU {float(figures['mfu']):.3f}, "
             f"step {float(figures['step_s']):.3f} s (min {float(figures['step_s_min']):.3f}, "
             f"max {float(figures['step_s_max']):.3f}), peak memory {float(figures['peak_mem_gib_max_rank']):.1f} GiB")
    notes = (f"{why}; {figures['tokens_per_step']} packed tokens/step, {figures['compute_dtype']}, attn {figures['attn']}, "
             f"peak {figures['peak_tflops']} TFLOPS ({figures['peak_source']}), measured {figures['compute_dtype']} matmul "
             f"{figures['matmul_tflops']} TFLOPS, median of {figures['steps']} steps after {figures['warmup']}")
    return Row(part=part, figures=shown, notes=notes)


def logprob_row(config: ReportConfig) -> Row:
    part = "logprob batching (benchmarks.logprob_batching)"
    if not config.run_logprob_batching:
        return Row(part=part, figures="", status="skipped: --run_logprob_batching false")
    # Without Ray (the GPU machine) the model's side of the ratio: TokenLogprobModel directly.
    engine = "worker" if importlib.util.find_spec("ray") is not None else "model"
    command = [sys.executable, "-m", "benchmarks.logprob_batching", "--engine", engine]
    status, stdout, stderr = _run(command + (["--smoke", "true"] if config.smoke else []), config.part_timeout_s)
    _, figures = parse_summary_line(_last_line(stdout))
    if status != 0 or "speedup" not in figures:
        return Row(part=part, figures="", status=_failure(status, stdout, stderr, config))
    return Row(part=part, figures=f"batched / one-per-forward: {figures['speedup']} (wider model), "
                                  f"{figures.get('tiny_speedup', '?')} (tiny)",
               notes=f"engine {engine} ({'LogprobWorker' if engine == 'worker' else 'TokenLogprobModel, no Ray'}), "
                     f"attn {figures.get('attn', '?')}, by budget {figures.get('speedup_by_budget', '?')}, "
                     f"max abs diff {figures.get('max_abs_diff', '?')}")


def _best_copy_s(source: torch.Tensor, target: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(WEIGHT_COPY_REPS):
        if source.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        if source.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def preset_params(preset: str) -> int:
    """Parameters of a tiny_model preset, tied embeddings counted once (Qwen2: biased q/k/v, two
    norms per layer, a final norm); qwen2.5-0.5b gives Qwen2.5-0.5B's 494,032,768. A preset whose
    vocabulary comes from its tokenizer (tiny) counts no embedding."""
    shape = PRESETS[preset]
    d, heads, intermediate = shape.hidden_size, shape.num_heads, shape.intermediate_size
    kv = shape.num_kv_heads * (d // heads)
    per_layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * intermediate + 2 * d
    embeddings = (shape.vocab_size or 0) * d * (1 if shape.tie_word_embeddings else 2)
    return shape.num_layers * per_layer + d + embeddings


def weight_push_rows(config: ReportConfig) -> list[Row]:
    preset = config.presets[0]
    nbytes = preset_params(preset) * BYTES_PER_BF16
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    weights = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    copy_s = _best_copy_s(weights, host)
    local_s = _best_copy_s(weights, torch.empty_like(weights))
    gbps, local_gbps = nbytes / copy_s / 1e9, nbytes / local_s / 1e9
    rows = [Row(part=f"weight push, trainer side: {device.type}->host copy of {preset} bf16 weights",
                figures=f"{gbps:.3g} GB/s ({nbytes / 1e9:.3g} GB in {copy_s * 1e3:.3g} ms); "
                        f"{gbps / local_gbps:.3f} of an on-{device.type} copy ({local_gbps:.3g} GB/s)",
                notes=f"best of {WEIGHT_COPY_REPS}; pinned host memory; the object-store push's first hop")]
    missing = [what for what, ok in (("vLLM", importlib.util.find_spec("vllm") is not None),
                                     ("a second GPU", torch.cuda.device_count() >= 2)) if not ok]
    rows.append(Row(part="weight push, vLLM NCCL engine (trainer rank 0 -> engine)", figures="",
                    status=f"skipped: needs {' and '.join(missing)}" if missing else "skipped: see the gpu tier",
                    notes="tests/weights/test_gpu_weight_transfer.py runs vLLM's NCCL sender against a "
                          "receiver process"))
    return rows


def build_report(config: ReportConfig) -> Report:
    report = Report()
    if config.run_tests:
        report.rows.append(gpu_tier_row(config))
    memory = card_memory_bytes(config)
    for preset in config.presets:
        for attn in config.attn_implementations:
            logger.info("trainer_throughput %s attn %s", preset, attn or "default")
            report.rows.append(throughput_row(config, preset, attn, memory))
    report.rows.append(logprob_row(config))
    report.rows.extend(weight_push_rows(config))
    return report


def _header(config: ReportConfig) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: figures mean nothing)"
    return (f"## GPU report: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f"\n\nCommand: python -m benchmarks.gpu_report{' --smoke true' if config.smoke else ''}")


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(ReportConfig, argv, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging(logging.INFO)
    if not config.smoke and not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        sys.exit(2)
    report = build_report(config)
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report.markdown(_header(config))
    out.write_text(text)
    print(text, flush=True)
    for part in report.failed_parts():
        logger.error("failed row: %s", part)
    print(summary_line("gpu_report", {"rows": len(report.rows), "skipped": report.count("skipped"),
                                      "failed": report.count("failed"), "out": out}), flush=True)
    if report.count("failed"):
        sys.exit(FAILED_EXIT)


if __name__ == "__main__":
    main()
