"""benchmarks/realistic_run.py's pure helpers (in benchmarks/realistic_parts.py and
process_monitor.py): data, trainer config and engine sizing, process labels, memory bookkeeping,
stage times. No Ray, vLLM or torchrun here (the benchmark itself runs
the whole system)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from async_grpo.config.run_config import load_config
from async_grpo.data.dataset import DatasetConfig, load_prompts
from async_grpo.data.prompt_record import extract_gsm8k_answer
from async_grpo.demo_assets.tiny_model import PRESETS, build_chat_tokenizer, build_model, hf_config
from async_grpo.trainer.config import TrainerConfig
from benchmarks import process_monitor as pm
from benchmarks import realistic_parts as rr


def test_gsm8k_records_are_deterministic_well_formed_and_correct() -> None:
    records = rr.gsm8k_records(12, seed=3)
    assert records == rr.gsm8k_records(12, seed=3)
    assert records != rr.gsm8k_records(12, seed=4)
    for record in records:
        assert set(record) == {"question", "answer"}
        answer = extract_gsm8k_answer(record["answer"])
        assert answer is not None and answer.isdigit()
        # The worked solution's last number is the final answer.
        solution = record["answer"].rsplit("####", 1)[0]
        assert solution.rstrip(".\n $").split()[-1].lstrip("$") == answer


def test_generated_prompts_load_with_the_chat_template_within_the_budget(tmp_path: Path) -> None:
    path = rr.write_gsm8k(tmp_path / "data.jsonl", 16, seed=0)
    data = DatasetConfig(path=str(path), format="gsm8k", chat_template=True, max_prompt_tokens=256)
    samples = load_prompts(data, build_chat_tokenizer())
    assert len(samples) == 16
    assert all(0 < len(s.input_token_ids) <= 128 for s in samples)


def test_default_trainer_config_resolves_and_fits_the_sample_budget(tmp_path: Path) -> None:
    config = rr.RealisticRunConfig()
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(rr.trainer_yaml(config, tmp_path / "data.jsonl")))
    trainer = load_config(TrainerConfig, ["--config", str(path), "--model.model_path", "m"])
    experience = trainer.experience
    assert experience.sampling.max_tokens == 2048 and experience.sampling.n == 2 and trainer.prompts_per_rank == 1
    assert experience.max_tokens_per_gpu == trainer.data.max_prompt_tokens + experience.sampling.max_tokens == 2304
    assert trainer.model.gradient_checkpointing and trainer.model.logprob_chunk_size == 256
    assert experience.logprob_role == "reference" and trainer.loss.kl_coef > 0
    assert trainer.data.format == "gsm8k" and trainer.data.chat_template
    assert trainer.eval.every == 0 and not trainer.tensorboard and not trainer.progress_bar
    # Flags after `--` win, and the engines follow them.
    trainer = load_config(TrainerConfig, ["--config", str(path), "--model.model_path", "m",
                                          "--sampling.max_tokens", "1024", "--max_lag", "0"])
    qwen = hf_config(PRESETS["qwen2.5-0.5b"], build_chat_tokenizer()).to_dict()
    sizing = rr.cluster_sizing(config, trainer, qwen)
    assert sizing.max_model_len == 256 + 1024
    assert sizing.max_num_seqs == 1 * 2 * 1 * 2
    assert sizing.logprob_max_tokens == 2 * sizing.max_model_len
    assert sizing.kv_cache_memory_bytes >= 4 * sizing.max_model_len * 24 * 2 * 2 * 64 * 4


def test_engine_sizing_holds_every_sequence_in_flight() -> None:
    trainer = SimpleNamespace(data=SimpleNamespace(max_prompt_tokens=256), prompts_per_rank=1,
                              experience=SimpleNamespace(sampling=SimpleNamespace(max_tokens=2048, n=2), max_lag=1),
                              model=SimpleNamespace(context_parallel=1))
    qwen = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24}
    assert rr.kv_bytes_per_token(qwen, "float32") == 2 * 24 * 2 * 64 * 4
    sizing = rr.cluster_sizing(rr.RealisticRunConfig(), trainer, qwen)
    assert sizing.max_num_seqs == 8  # (max_lag + 1) x 2 ranks x 1 prompt x 2 rollouts
    assert sizing.kv_cache_memory_bytes >= 8 * 2304 * 24576 * rr.KV_CACHE_MARGIN
    assert sizing.kv_cache_memory_bytes % 2**20 == 0
    tiny = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    assert rr.cluster_sizing(rr.RealisticRunConfig(max_tokens=32), trainer, tiny).kv_cache_memory_bytes == rr.MIN_KV_CACHE_BYTES
    explicit = rr.RealisticRunConfig(kv_cache_memory_bytes=2**30, max_num_seqs=3, logprob_max_tokens=999)
    sizing = rr.cluster_sizing(explicit, trainer, qwen)
    assert (sizing.kv_cache_memory_bytes, sizing.max_num_seqs, sizing.logprob_max_tokens) == (2**30, 3, 999)


def test_context_parallel_trains_8k_responses_that_one_ranks_budget_refuses(tmp_path: Path) -> None:
    """--context_parallel 2 at 8192-token responses: each rank's budget is half the longest sample
    (256 + 8192 = 8448 -> 4224), which the trainer accepts with cp 2 and refuses with cp 1."""
    config = rr.RealisticRunConfig(max_tokens=8192, context_parallel=2)
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(rr.trainer_yaml(config, tmp_path / "data.jsonl")))
    trainer = load_config(TrainerConfig, ["--config", str(path), "--model.model_path", "m"])
    assert (trainer.model.context_parallel, trainer.experience.max_tokens_per_gpu) == (2, 4224)
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu=4224 is below .* = 8448"):
        load_config(TrainerConfig, ["--config", str(path), "--model.model_path", "m", "--model.context_parallel", "1"])
    qwen = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 2}
    assert rr.cluster_sizing(config, trainer, qwen).max_num_seqs == 4  # 2 steps x 1 group x 1 prompt x 2 rollouts
    with pytest.raises(ValueError, match="context_parallel must be >= 1 and divide nproc_per_node=2"):
        rr.RealisticRunConfig(context_parallel=3)


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-0.5b"])
def test_parameter_count_matches_the_model(preset: str) -> None:
    shape = PRESETS[preset]
    tokenizer = build_chat_tokenizer()
    with torch.device("meta"):
        model = build_model(shape, tokenizer)
    count = rr.parameter_count(hf_config(shape, tokenizer).to_dict())
    assert count == sum(p.numel() for p in model.parameters())
    if preset == "qwen2.5-0.5b":
        assert count == 494_032_768


def test_model_folder_names_and_writer_command(tmp_path: Path) -> None:
    spec = rr.model_spec(rr.RealisticRunConfig())
    assert spec == {"preset": "qwen2.5-0.5b", "dtype": "float32", "overrides": {"tokenizer": "bpe"}}
    assert rr.model_dir_name(spec) == "model-qwen2.5-0.5b-float32"
    shallow = rr.model_spec(load_config(rr.RealisticRunConfig, ["--model.num_layers", "2",
                                                                "--model.tie_word_embeddings", "false"]))
    assert rr.model_dir_name(shallow).startswith("model-qwen2.5-0.5b-float32-")
    command = rr.model_writer_command(shallow, tmp_path)
    assert command[-6:] == ["--model.num_layers", "2", "--model.tie_word_embeddings", "false", "--model.tokenizer", "bpe"]


@pytest.mark.parametrize("cmdline, kwargs, label", [
    ("ray::GenerationWorkerActor.generate", {}, "generation worker actor"),
    ("ray::LogprobWorkerActor", {}, "logprob worker actor"),
    ("ray::logprob-worker-0:LogprobWorkerActor", {}, "logprob worker actor"),
    ("ray::generation-registry:RegistryActor.status", {}, "registry actor"),
    ("ray::RegistryActor.register", {}, "registry actor"),
    ("ray::ExperienceBatcherActor.next_message", {}, "experience batcher actor"),
    ("ray::IDLE", {}, pm.IDLE_RAY_WORKER),
    ("ray::SomethingNew", {}, "Ray actor SomethingNew"),
    ("VLLM::EngineCore", {}, "vLLM EngineCore"),
    ("/v/python -m torch.distributed.run --nproc_per_node=2 /r/trainer_core.py --x", {}, "torchrun"),
    ("/v/python -u /r/trainer_core.py --ray_address a", {"rank": "1"}, "trainer rank 1"),
    ("/v/python -u /r/trainer_core.py --ray_address a", {}, pm.UNKNOWN_RANK),
    ("/v/python /r/worker_dispatcher.py --model_path m --mode logprob", {}, "dispatcher (logprob)"),
    ("/v/python /r/local_cluster.py --model_path m", {}, "local_cluster.py (Ray head driver)"),
    ("/v/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", {}, "raylet"),
    ("/v/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", {}, "Ray GCS server"),
    ("/v/python -c from multiprocessing.forkserver import main; main(1)",
     {"parent_label": "verifier pool actor", "anchor": "verifier pool actor"}, "forkserver of verifier pool actor"),
    ("/v/python -c from multiprocessing.forkserver import main; main(1)",
     {"parent_label": "forkserver of verifier pool actor"}, "verifier process"),
    ("/usr/bin/cc1plus -quiet x.cpp", {"parent_label": "g++ (under vLLM EngineCore)", "anchor": "vLLM EngineCore"},
     "cc1plus (under vLLM EngineCore)"),
    ("anything", {"own_label": "realistic_run.py (this benchmark)"}, "realistic_run.py (this benchmark)"),
])
def test_process_labels(cmdline: str, kwargs: dict, label: str) -> None:
    assert pm.process_label(cmdline, **kwargs) == label


@pytest.mark.parametrize("cmdline, role", [
    ("/v/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=3)",
     "python -c from multiprocessing.spawn import spawn_"),
    ("/v/python3 /r/scripts/prepare_demo.py --out_dir x", "python prepare_demo.py"),
    ("/v/python -m pip install x", "python -m pip"),
    ("/v/python", "python (under ?)"),
])
def test_suite_profile_names_unlabelled_python_processes_by_what_they_run(cmdline: str, role: str) -> None:
    assert pm.python_role(cmdline) == role


def test_weak_labels() -> None:
    assert pm.is_weak_label(pm.IDLE_RAY_WORKER) and pm.is_weak_label(pm.UNKNOWN_RANK)
    assert pm.is_weak_label("python (under raylet)")
    assert not pm.is_weak_label("generation worker actor") and not pm.is_weak_label("forkserver of verifier pool actor")


def test_parse_status_reads_kb_fields() -> None:
    text = "Name:\tpython\nVmHWM:\t  226928 kB\nVmRSS:\t  200000 kB\nRssAnon:\t  150000 kB\nThreads:\t4\n"
    assert pm.parse_status(text) == {"VmHWM": 226928, "VmRSS": 200000, "RssAnon": 150000}
    own = pm.parse_status(Path("/proc/self/status").read_text())
    assert own["VmHWM"] >= own["VmRSS"] > 0


def _record(pid: int, label: str, peak_kb: int, first: float) -> pm.ProcessRecord:
    return pm.ProcessRecord(pid=pid, label=label, cmdline=label, first_seen_s=first, last_seen_s=first + 1,
                            peak_rss_kb=peak_kb, rises=[(peak_kb, "step 0")])


def test_merge_rows_numbers_duplicates_and_merges_helpers() -> None:
    rows = pm.merge_rows([
        _record(10, "registry actor", 300_000, 2.0), _record(9, "registry actor", 310_000, 1.0),
        _record(20, "cc1plus (under vLLM EngineCore)", 200_000, 5.0),
        _record(21, "cc1plus (under vLLM EngineCore)", 250_000, 6.0),
        _record(30, "trainer rank 0", 6_000_000, 3.0),
    ])
    assert [r["label"] for r in rows] == ["trainer rank 0", "registry actor #1", "registry actor #2",
                                          "cc1plus (under vLLM EngineCore) x2"]
    assert rows[1]["pid"] == 9  # numbered by start order
    assert rows[3]["count"] == 2 and rows[3]["pid"] == 21


def test_phase_at_peak_ignores_small_late_rises() -> None:
    record = _record(1, "trainer rank 0", 1_000_000, 0.0)
    record.rises = [(500_000, "trainer start-up (model load)"), (6_000_000, "step 1"), (6_010_000, "shutdown")]
    record.peak_rss_kb = 6_010_000
    assert record.phase_at_peak == "step 1"
    record.rises.append((7_000_000, "final checkpoint"))
    record.peak_rss_kb = 7_000_000
    assert record.phase_at_peak == "final checkpoint"


def test_log_watcher_events_and_phases(tmp_path: Path) -> None:
    log = tmp_path / "local_cluster.log"
    log.write_text("2026-11-23 20:20:29,493 INFO __main__: Ray head at 127.0.0.1:1 (127.0.0.1 only)\n"
                   "2026-11-23 20:22:14,700 INFO __main__: generation-0 worker registered\n"
                   "2026-11-23 20:22:14,704 INFO __main__: starting trainer: torch.distributed.run ...\n"
                   "2026-11-23 20:22:30,855 [rank0] INFO async_grpo.trainer.fsdp_setup: FSDP2 model from /m: 1 parameters\n")
    (tmp_path / "logprob-0_worker.log").write_text("loading\nworker logprob-worker-0 registered\n")
    watcher = pm.LogWatcher(log, (tmp_path, "*_worker.log"))
    watcher.poll()
    events = watcher.events
    assert events["registered:generation-0"] - events["ray_head_started"] == pytest.approx(105.207)
    assert "worker_log_registered:logprob-worker-0" in events
    assert pm.phase_of(watcher, 0, 3, cluster_running=True) == "trainer start-up (first push)"
    with log.open("a") as f:
        f.write("2026-11-23 20:22:36,192 [rank0] INFO async_grpo.weights.weight_sync: pushed weights v0 (gather, torch.float32) to 1 workers\n")
    watcher.poll()
    assert pm.phase_of(watcher, 0, 3, cluster_running=True) == "step 0"
    assert pm.phase_of(watcher, 2, 3, cluster_running=True) == "step 2"
    assert pm.phase_of(watcher, 3, 3, cluster_running=True) == "final checkpoint"
    watcher.feed("2026-11-23 20:22:39,826 [rank0] INFO __main__: training finished at step 3; metrics in x")
    assert pm.phase_of(watcher, 3, 3, cluster_running=True) == "shutdown"
    assert pm.phase_of(pm.LogWatcher(log), 0, 3, cluster_running=False) == "prepare"


def _metrics(step: int, end: float, step_s: float) -> dict:
    return {"step": step, "unix_time": end, "timing/step_s": step_s, "timing/wait_s": step_s / 2,
            "timing/train_s": step_s / 4, "timing/push_s": 1.0, "counts/tokens": 9000.0 + step,
            "response/length_mean": 2048.0, "response/truncated_frac": 1.0}


def test_step_rows_median_and_stage_times() -> None:
    records = [_metrics(0, 1100.0, 40.0), _metrics(1, 1120.0, 20.0), _metrics(2, 1150.0, 30.0)]
    rows = rr.step_rows(records)
    assert rows[0]["other_s"] == pytest.approx(40 - 20 - 10 - 1)
    median = rr.median_row(rows)
    assert median["step"] == "median" and median["step_s"] == 30.0 and median["tokens"] == 9001.0
    assert "gen_req_s" not in median  # absent from the records: left out, not zero
    events = {"registered:generation-0": 1020.0, "registered:logprob-0": 1021.0, "trainer_started": 1022.0,
              "worker_log_registered:generation-worker-0": 1019.0}
    stages = rr.stage_times(started=900.0, launched=1000.0, exited=1200.0, events=events, records=records,
                            torchrun_gone=1180.0, prepare={"model_s": 60.0})
    assert stages["prepare_s"] == 100.0 and stages["cluster_start_s"] == 21.0
    assert stages["worker_registered_after_s"] == {"generation-worker-0": 19.0}
    assert stages["trainer_startup_s"] == 1060.0 - 1022.0  # step 0 started at 1100 - 40
    assert stages["steps_s"] == 90.0 and stages["trainer_end_s"] == 30.0 and stages["shutdown_s"] == 20.0
    assert stages["total_s"] == 300.0
    print(rr.steps_table([*rows, median]))


def test_final_line_has_the_agreed_keys() -> None:
    report = {"summary": {"steps": 3, "model": "qwen2.5-0.5b-float32", "max_tokens": 2048, "tokens_per_step": 9000.0,
                          "step_s_median": 812.3, "peak_total_gb": 17.5, "machine_peak_used_gb": 20.1,
                          "machine_baseline_gb": 2.0, "sum_of_process_peaks_gb": 24.0}}
    line = rr.final_line(report)
    assert line.startswith("realistic_run: steps=3 model=qwen2.5-0.5b-float32 max_tokens=2048 tokens_per_step=9000 "
                           "step_s_median=812.3 peak_total_gb=17.50 ")
    json.dumps(report)


def test_first_errors_finds_the_root_cause_before_the_summaries(tmp_path: Path) -> None:
    log = tmp_path / "local_cluster.log"
    log.write_text("loading\n[rank1]: Traceback (most recent call last):\n"
                   "[rank1]: ValueError: Specified `attn_implementation=\"bogus\"` is not supported.\n"
                   "[rank0]: ValueError: Specified `attn_implementation=\"bogus\"` is not supported.\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                   "RuntimeError: local cluster gave up\n")
    assert pm.first_errors(log) == ['ValueError: Specified `attn_implementation="bogus"` is not supported.',
                                    "RuntimeError: local cluster gave up"]
    assert pm.first_errors(tmp_path / "missing.log") == []
