"""The whole system on a model of a realistic shape with long responses: time per stage, peak RSS per process.

    cd /work/main && .venv/bin/python -m benchmarks.realistic_run                  # Qwen2.5-0.5B shape, 3 steps x 2048 tokens
    .venv/bin/python -m benchmarks.realistic_run --preset tiny --max_tokens 32 --num_steps 2 --work_dir runs/realistic-tiny
                                                                                  # ~3-5 min: checks the plumbing
    .venv/bin/python -m benchmarks.realistic_run ... -- --weight_push_mode sharded # trainer flags go after `--`
    .venv/bin/python -m benchmarks.realistic_run --model.num_layers 2 --max_tokens 8192 --context_parallel 2 \
        --num_steps 2 --work_dir runs/realistic-cp2     # 8k-token responses, each split over the 2 ranks
    .venv/bin/python -m benchmarks.realistic_run --model.num_layers 2 --max_tokens 8192 --max_tokens_per_gpu 4224 \
        --work_dir runs/realistic-cp1                   # the same budget without the split: refused at once

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
`--max_tokens` (one longest sample per minibatch, the least memory the budget rule allows),
divided by `--context_parallel` (model.context_parallel: that many ranks split each minibatch's
tokens, so a response one rank's budget refuses trains over the group's);
gradient checkpointing on; `model.logprob_chunk_size` 256 (an lm_head chunk costs chunk x vocab x
4 bytes: 156 MB at 256 x 151,936); reference logprobs with a small k3 KL (`--kl_coef`); no
evaluation, TensorBoard or progress bar; trainer timeouts (`message_timeout_s`,
`prompt_deadline_s`, `dist_timeout_s`) of `--patience_s` (CPU decoding of 2048 tokens at 0.5B
takes many minutes). The engines are sized from the resolved trainer config: `max_model_len` =
`data.max_prompt_tokens + sampling.max_tokens`; `max_num_seqs` = the sequences that can be in
flight at once, `(max_lag + 1) x ranks / context_parallel x prompts_per_rank x n` (a group's first
rank submits its prompts); the KV cache holds all of them
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
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from async_grpo.config.run_config import ConfigError, config_to_dict, load_config, split_passthrough
from async_grpo.telemetry.metrics import read_metrics
from benchmarks.harness import (
    apply_smoke, interrupt_on_sigterm, launcher_engine_flags, load_bench_config, REPO_ROOT, setup_logging,
)
from benchmarks.process_monitor import (
    GB, KB, LogWatcher, ProcessMonitor, RunFailed, count_lines, phase_of, print_failure, process_table, run_polled,
    tail,
)
from benchmarks.realistic_parts import (
    MODEL_SPEC_FILE, SMOKE, RealisticRunConfig, cluster_sizing, final_line, median_row, model_dir_name, model_spec,
    model_writer_command, parameter_count, stage_times, step_rows, steps_table, trainer_yaml, write_gsm8k,
)

logger = logging.getLogger(__name__)
OWN_LABEL = "realistic_run.py (this benchmark)"


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
        raise RunFailed(f"async_grpo.demo_assets.tiny_model exited with {rc}; last lines of {log}:\n{tail(log)}")
    spec_path.write_text(json.dumps(spec, indent=1))
    return model_dir, False


def resolve_trainer(config: RealisticRunConfig, yaml_path: Path, run_dir: Path, model_dir: Path,
                    passthrough: list[str]) -> Any:
    """The TrainerConfig the trainer will build from the same arguments (validated here, before any
    worker starts)."""
    from async_grpo.trainer.config import TrainerConfig

    argv = ["--config", str(yaml_path), "--run_dir", str(run_dir), "--model.model_path", str(model_dir), *passthrough]
    try:
        return load_config(TrainerConfig, argv)
    except (ConfigError, ValueError) as exc:
        raise RunFailed(f"the trainer config is invalid: {exc}") from None


def prompt_lengths(trainer: Any) -> list[int]:
    """Token counts of the training prompts, loaded exactly as the trainer loads them."""
    from async_grpo.data.dataset import load_prompts
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
    monitor = ProcessMonitor(started, OWN_LABEL)
    monitor.sample("prepare")
    prepare: dict[str, float] = {}

    t = time.monotonic()
    data_path = write_gsm8k(work_dir / "gsm8k_synthetic.jsonl", config.num_problems, config.data_seed)
    yaml_path = work_dir / "trainer.yaml"
    yaml_path.write_text(yaml.safe_dump(trainer_yaml(config, data_path), sort_keys=False))
    # Before the model is written: a config the trainer refuses (a sample over the budget) stops here.
    trainer = resolve_trainer(config, yaml_path, run_dir, work_dir / model_dir_name(model_spec(config)), passthrough)
    prepare["config_s"] = time.monotonic() - t
    t = time.monotonic()
    model_dir, reused = prepare_model(config, work_dir, monitor)
    prepare["model_s"] = time.monotonic() - t
    t = time.monotonic()
    hf_config = json.loads((model_dir / "config.json").read_text())
    sizing = cluster_sizing(config, trainer, hf_config)
    if sizing.max_model_len > hf_config.get("max_position_embeddings", sizing.max_model_len):
        raise RunFailed(f"max_model_len {sizing.max_model_len} (data.max_prompt_tokens + sampling.max_tokens) exceeds "
                        f"the model's max_position_embeddings {hf_config['max_position_embeddings']}; pass "
                        f"--model.max_position_embeddings or lower --max_tokens / --max_prompt_tokens")
    lengths = prompt_lengths(trainer)
    prepare["prompts_s"] = time.monotonic() - t
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
        "--worker_start_timeout_s", str(config.worker_start_timeout_s), *launcher_engine_flags(config.smoke),
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
        "max_tokens": trainer.experience.sampling.max_tokens,
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



def main(argv: list[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    config = load_bench_config(RealisticRunConfig, own, description=__doc__)
    config = apply_smoke(config, SMOKE)
    setup_logging()
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
