"""How an object-store push goes into the engine (worker_object_store.ObjectStoreReloader): which
of vLLM's calls a load makes with and without requests running, against a recording stand-in of
AsyncLLM, and that no request starts while a load runs (served_weights.ServedWeights). The engine
path itself, with real vLLM, runs in tests/inference/test_vllm_worker.py and
tests/rollouts/test_token_versions_engine.py (a push in the middle of a rollout).

    .venv/bin/python -m pytest tests/weights/test_object_store_reload.py -q
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from async_grpo.config.worker_options import OBJECT_STORE_TRANSFER
from async_grpo.inference.generation_stats import GenerationStats
from async_grpo.inference.served_weights import ServedWeights
from async_grpo.routing.worker_lifecycle import WorkerLifecycle
from async_grpo.weights import worker_object_store
from async_grpo.weights.worker_object_store import ObjectStoreReloader
from support.recording_engine import RecordingEngine

BUCKETS = [({"model.embed_tokens.weight": torch.ones(2, 2)}, False), ({"lm_head.weight": torch.zeros(2, 2)}, True)]


async def _no_adapter(adapter_id: int) -> None:
    raise AssertionError("no adapter is loaded here")


def _reloader(served: ServedWeights) -> ObjectStoreReloader:
    return ObjectStoreReloader("reload-test", model_path="unused", weight_transfer=OBJECT_STORE_TRANSFER,
                               bucket_bytes=1 << 20, pause_mode="keep", served=served, stats=GenerationStats(),
                               life=WorkerLifecycle("reload-test"))


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The buckets handed to the engine (names), in place of the memory files vLLM maps."""
    names: list[list[str]] = []

    async def send(engine: RecordingEngine, worker_name: str, bucket: dict[str, Any]) -> None:
        names.append(list(bucket))
        engine.calls.append(("update_weights", list(bucket)))

    monkeypatch.setattr(worker_object_store, "_send_bucket", send)
    return names


def test_with_no_request_running_the_load_skips_the_pause_and_resets_the_prefix_cache(sent) -> None:
    engine, served = RecordingEngine(), ServedWeights(_no_adapter)
    count = asyncio.run(_reloader(served)._reload_paused(engine, iter(BUCKETS), 7))
    assert count == 2 and sent == [["model.embed_tokens.weight"], ["lm_head.weight"]]
    assert [c for c, _ in engine.calls] == ["start_weight_update", "update_weights", "update_weights",
                                            "finish_weight_update", "reset_prefix_cache"]
    assert served.version == 7 and served.accepting.is_set()


def test_with_a_request_running_the_engine_is_paused_across_the_load(sent) -> None:
    engine, served = RecordingEngine(), ServedWeights(_no_adapter)

    async def load_during_a_request() -> tuple[int, int]:
        started, finish = asyncio.Event(), asyncio.Event()

        async def request() -> int:
            async with served.request() as (version, _):
                started.set()
                await finish.wait()
                return version

        running = asyncio.create_task(request())
        await started.wait()
        await _reloader(served)._reload_paused(engine, iter(BUCKETS), 8)
        finish.set()
        return await running, served.inflight

    version, inflight = asyncio.run(load_during_a_request())
    assert version == -1 and inflight == 0  # it started on the checkpoint's weights
    assert engine.calls[0] == ("pause_generation", ("keep", True))
    assert [c for c, _ in engine.calls] == ["pause_generation", "start_weight_update", "update_weights",
                                            "update_weights", "finish_weight_update", "resume_generation"]


def test_a_request_woken_just_before_the_next_load_waits_for_that_load() -> None:
    """accepting.set() wakes a waiting request, but the next load may clear it again before the
    request runs: the request must look again rather than start while that load counts none."""
    served = ServedWeights(_no_adapter)

    async def race() -> tuple[int, list[tuple[int, bool]]]:
        served.accepting.clear()  # a load holds requests back
        entered: list[tuple[int, bool]] = []  # (version, whether requests were let in) as each started

        async def request() -> None:
            async with served.request() as (version, _):
                entered.append((version, served.accepting.is_set()))

        waiting = asyncio.create_task(request())
        await asyncio.sleep(0)  # the request now waits on accepting
        served.accepting.set()  # the load ends ...
        served.accepting.clear()  # ... and the next begins before the woken request runs
        for _ in range(5):
            await asyncio.sleep(0)
        during_the_load = len(entered)
        served.switch_version(3)
        served.accepting.set()
        await waiting
        return during_the_load, entered

    assert asyncio.run(race()) == (0, [(3, True)])


def test_a_prefix_cache_that_cannot_be_reset_fails_the_load(sent) -> None:
    engine, served = RecordingEngine(), ServedWeights(_no_adapter)
    engine.prefix_cache_resets = False
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        asyncio.run(_reloader(served)._reload_paused(engine, iter(BUCKETS), 9))
    assert served.version == -1 and served.accepting.is_set()  # the version is not switched
