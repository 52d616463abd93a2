"""The checks an entry point makes before it starts anything: installed versions, the GPU layout,
the CPU KV-cache default, a start-up failure's root cause, and the reload warnings filtered out.
Pure functions, checked against hand-written expectations."""

from __future__ import annotations

import logging

import pytest

from async_grpo.config.versions import Requirement, VersionError, check_versions
from async_grpo.inference.engine_diagnostics import root_cause_line
from async_grpo.launch.node_resources import cpu_kv_cache_bytes, gpus_per_worker
from async_grpo.launch.placement import GiB, ModelShape, PlacementError, RunShape, plan_placement
from async_grpo.trainer.fsdp_setup import check_trainer_gpus
from async_grpo.weights.worker_reload_fixes import UninformativeReloadWarnings


@pytest.mark.parametrize(("version", "allowed"), [
    ("0.11.0", False), ("0.31.9", False), ("0.32.0", True), ("0.32.1rc1", True), ("0.32.0+cpu", True),
    ("0.33.0", False), ("not-a-version", False),
])
def test_requirement_range(version: str, allowed: bool) -> None:
    assert Requirement("vllm", "0.32", "0.33", "why").allows(version) is allowed


def test_version_errors_name_package_installed_needed_and_why() -> None:
    old = Requirement("pytest", "999", None, "a future API")
    with pytest.raises(VersionError) as info:
        check_versions((old,))
    message = str(info.value)
    assert "\n" not in message and "pytest" in message and ">=999" in message and "a future API" in message
    missing = Requirement("no-such-package-anywhere", "1", None, "something")
    with pytest.raises(VersionError, match="no-such-package-anywhere is not installed"):
        check_versions((missing,))


def test_this_install_passes_every_entry_points_check() -> None:
    from async_grpo.config.versions import LOGPROB_WORKER_REQUIREMENTS, TRAINER_REQUIREMENTS, WORKER_REQUIREMENTS

    for requirements in (TRAINER_REQUIREMENTS, WORKER_REQUIREMENTS, LOGPROB_WORKER_REQUIREMENTS):
        check_versions(requirements)


def test_trainer_gpu_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="has 8 GPU\\(s\\) but CUDA_VISIBLE_DEVICES='' leaves the trainer none"):
        check_trainer_gpus(local_world_size=2, visible_gpus=0, host_gpus=8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    with pytest.raises(ValueError, match="starts 2 ranks on this node but CUDA_VISIBLE_DEVICES='6' shows 1"):
        check_trainer_gpus(local_world_size=2, visible_gpus=1, host_gpus=8)
    check_trainer_gpus(local_world_size=2, visible_gpus=2, host_gpus=8)
    check_trainer_gpus(local_world_size=2, visible_gpus=0, host_gpus=0)  # a CPU machine trains on the CPU


def test_local_cluster_gpu_plan_keeps_workers_and_trainer_apart() -> None:
    tiny = ModelShape(num_params=321_152, hidden_size=128, num_layers=2, vocab_size=101)
    six_workers = RunShape(trainer_ranks=2, max_tokens_per_gpu=4096, generation_workers=1, logprob_workers=5)
    assert not plan_placement(0, 0, tiny, six_workers).on_gpu
    plan = plan_placement(8, 80 * GiB, tiny, six_workers)
    assert plan.worker_gpus == (0, 1, 2, 3, 4, 5) and plan.trainer_gpus == (6, 7) and plan.worker_gpu_share == 1
    assert not set(plan.worker_gpus) & set(plan.trainer_gpus)
    with pytest.raises(PlacementError, match="4 GPU\\(s\\) cannot hold 4 trainer ranks"):
        plan_placement(4, 80 * GiB, tiny, RunShape(trainer_ranks=4, max_tokens_per_gpu=4096))


def test_gpus_per_worker() -> None:
    assert gpus_per_worker("generation", 2, node_gpus=0) == 0
    assert gpus_per_worker("generation", 2, node_gpus=8) == 2
    assert gpus_per_worker("logprob", 1, node_gpus=8) == 1
    with pytest.raises(ValueError, match="needs 4 GPU\\(s\\) and this Ray node advertises 2"):
        gpus_per_worker("generation", 4, node_gpus=2)
    assert gpus_per_worker("generation", 1, node_gpus=1, requested=0.5) == 0.5  # shares GPU 0
    assert gpus_per_worker("logprob", 1, node_gpus=0, requested=0.5) == 0  # a CPU node takes none


def test_cpu_kv_cache_default_is_an_eighth_of_free_memory_within_bounds() -> None:
    assert cpu_kv_cache_bytes(8 * GiB) == 1 * GiB
    assert cpu_kv_cache_bytes(1 * GiB) == 256 * 2**20  # floor
    assert cpu_kv_cache_bytes(512 * GiB) == 8 * GiB  # ceiling


# What a failed vLLM start leaves in the actor's stderr (abridged from a real run).
_FAILED_START = """\
(EngineCore pid=4242) INFO 11-25 15:40:01 [core.py:94] Initializing a V1 LLM engine (v0.32.0) with config: ...
(EngineCore pid=4242) ERROR 11-25 15:40:02 [core.py:708] EngineCore failed to start.
(EngineCore pid=4242) Traceback (most recent call last):
(EngineCore pid=4242)   File ".../vllm/v1/worker/cpu_worker.py", line 85, in __init__
(EngineCore pid=4242) ValueError: Available memory on node 0 (8.24/10.84 GiB) on startup is less than desired CPU memory utilization (0.9, 9.76 GiB).
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_engine_cores_error_not_the_wrapper() -> None:
    assert root_cause_line(_FAILED_START) == (
        "ValueError: Available memory on node 0 (8.24/10.84 GiB) on startup is less than desired CPU memory "
        "utilization (0.9, 9.76 GiB).")
    assert root_cause_line("INFO all good\nWARNING nothing failed\n") is None


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING, __file__, 1, msg,
                             args, None)


def test_only_buffer_only_layers_reload_warnings_are_dropped() -> None:
    keep = UninformativeReloadWarnings().filter
    assert not keep(_record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep(_record("%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert keep(_record("%s: Failed to load weights", "QKVParallelLinear")), "a layer with weights must warn"
    assert keep(_record("%s: Delayed processing", "RotaryEmbedding"))
    assert keep(_record("something else entirely"))
