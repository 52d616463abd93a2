"""Logprob worker: exact trainer logprobs, packed batches == one-at-a-time, weight updates, Ray, failures.

References are computed here, independently of the worker: the trainer's module
(TokenLogprobModel on one sample at a time) and a plain Hugging Face forward (log_softmax of the
full logits), both loaded with from_pretrained.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import logprob_worker
from async_grpo.config.worker_options import LogprobBatchingConfig, PromptSharingConfig
from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model
from async_grpo.config.actor_names import LOGPROB
from async_grpo.model.packed_attention import PACKED_SDPA
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs, tensor_to_blob
from logprob_worker import LogprobWorker, LogprobWorkerActor, LogprobWorkerConfig, resolve_dtype, resolve_model_settings
from sample_processing_utils import Sample, get_input_for_logprobs
from setup_model import TokenLogprobModel, default_attn_implementation, load_causal_lm
from support.lora_adapters import files_update, mark_stable
from support.reference_logprobs import hf_model, reference_logprobs
from vllm_registry import WorkerHealth

FP32_TOLERANCE = 1e-5  # packed vs per-sample fp32 attention differed by ~3e-7 on this machine
DIFFERENT_WEIGHTS_GAP = 1e-2  # two random inits give logprobs far further apart than this
# Long enough that a batch would never run on its deadline during the test: only a full token
# budget or shutdown can end the wait.
NEVER_MS = 3_600_000.0
# Liveness guard for the budget-full dispatch test (the alternative is waiting NEVER_MS).
LIVENESS_S = 120.0


def _build_sample(rng: random.Random, vocab_size: int, prompt_len: int, output_len: int, prompt_id: int) -> Sample:
    return Sample(
        input_token_ids=[rng.randrange(vocab_size) for _ in range(prompt_len)],
        gt_answer="",
        prompt_id=prompt_id,
        output_token_ids=[rng.randrange(vocab_size) for _ in range(output_len)],
    )


def _build_samples(count: int, vocab_size: int, seed: int = 0, max_prompt: int = 30, max_output: int = 60) -> list[Sample]:
    rng = random.Random(seed)
    return [
        _build_sample(rng, vocab_size, rng.randint(1, max_prompt), rng.randint(1, max_output), i) for i in range(count)
    ]


def _vocab_size(model_dir: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir)).vocab_size


def _trainer_logprobs(model_dir: Path, samples: list[Sample], share_prompts: bool = False) -> list[torch.Tensor]:
    """The trainer's function, one sample per forward."""
    model = TokenLogprobModel(load_causal_lm(model_dir)).eval()
    with torch.no_grad():
        return [model.score(get_input_for_logprobs([s], share_prompts))[0] for s in samples]


def _hf_logprobs(model_dir: Path, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's reference logprobs (support.reference_logprobs: a plain HF forward, the full
    logits' log_softmax at the positions that predict output tokens), one model load."""
    model = hf_model(model_dir)
    return [reference_logprobs(model, s.input_token_ids, s.output_token_ids) for s in samples]


def _max_diff(results: list[list[float]], references: list[torch.Tensor]) -> float:
    assert [len(r) for r in results] == [len(r) for r in references]
    return max((torch.tensor(r) - ref).abs().max().item() for r, ref in zip(results, references))


async def _concurrently(worker: LogprobWorker, samples: list[Sample]) -> list[list[float]]:
    return list(await asyncio.gather(*(worker.compute_logprobs(s) for s in samples)))


async def _one_at_a_time(worker: LogprobWorker, samples: list[Sample]) -> list[list[float]]:
    return [await worker.compute_logprobs(s) for s in samples]


def _weight_update(model_dir: Path, version: int) -> WeightUpdate:
    """The checkpoint's own tensors (HF names, a tied embedding stored once) as a 'gather' update."""
    import ray

    state_dict = load_file(str(model_dir / "model.safetensors"))
    return WeightUpdate(version=version, shard_refs=[ray.put(state_dict_to_blobs(state_dict))])


@pytest.fixture(scope="module")
def other_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Same shapes as the fixtures' tiny models, different seed: keyed by tie_word_embeddings."""
    return {
        tied: write_tiny_model(tmp_path_factory.mktemp(f"tiny-seed1-tied{tied}"), TinyModelConfig(seed=1, tie_word_embeddings=tied))
        for tied in (False, True)
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_path", ""), ("logprob_chunk_size", 0), ("device", "tpu"), ("dtype", "int8"), ("attn_implementation", "")],
)
def test_config_rejects_bad_field(field: str, value: object) -> None:
    kwargs = {"model_path": "m", field: value}
    with pytest.raises(ValueError, match=f"LogprobWorkerConfig.{field}"):
        LogprobWorkerConfig(**kwargs)


@pytest.mark.parametrize(("field", "value"), [("max_tokens_per_forward", 0), ("max_wait_ms", -1.0)])
def test_batching_config_rejects_bad_field(field: str, value: object) -> None:
    # The worker's batching section (worker_options.LogprobBatchingConfig) validates its own fields.
    with pytest.raises(ValueError, match=f"LogprobBatchingConfig.{field}"):
        LogprobWorkerConfig(model_path="m", batching=LogprobBatchingConfig(**{field: value}))


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_dtype_defaults_to_what_the_trainer_computes_in() -> None:
    # The trainer: bf16 compute on CUDA (ModelConfig.mixed_precision, on by default), fp32 on CPU.
    assert LogprobWorkerConfig(model_path="m").dtype == "auto"
    assert resolve_dtype("auto", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("float32", CUDA) == torch.float32  # explicit names win
    assert resolve_dtype("float16", CPU) == torch.float16


def test_attention_defaults_to_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_model_settings picks setup_model's default for the device, as the trainer does
    (the device is only named, never used: no GPU needed)."""
    config = LogprobWorkerConfig(model_path="m", device="cuda")
    assert resolve_model_settings(config, CUDA) == (torch.bfloat16, default_attn_implementation(CUDA))
    assert resolve_model_settings(LogprobWorkerConfig(model_path="m", device="cpu"), CPU) == (torch.float32, PACKED_SDPA)
    # A CUDA node with flash-attn installed: bf16 runs it; an fp32 worker falls back to packed_sdpa.
    monkeypatch.setattr(logprob_worker, "default_attn_implementation",
                        lambda device, share_prompts: PACKED_SDPA if share_prompts else "flash_attention_2")
    assert resolve_model_settings(config, CUDA) == (torch.bfloat16, "flash_attention_2")
    sharing = LogprobWorkerConfig(model_path="m", device="cuda", sharing=PromptSharingConfig(share_prompts=True))
    assert resolve_model_settings(sharing, CUDA) == (torch.bfloat16, PACKED_SDPA)  # flash-attn cannot share
    fp32 = LogprobWorkerConfig(model_path="m", device="cuda", dtype="float32")
    assert resolve_model_settings(fp32, CUDA) == (torch.float32, PACKED_SDPA)
    explicit = LogprobWorkerConfig(model_path="m", device="cuda", attn_implementation="sdpa")
    assert resolve_model_settings(explicit, CUDA) == (torch.bfloat16, "sdpa")


def test_prompt_sharing_with_an_attention_that_cannot_run_it_is_refused_at_config_time() -> None:
    with pytest.raises(ValueError, match="share_prompts needs LogprobWorkerConfig.attn_implementation"):
        LogprobWorkerConfig(model_path="m", attn_implementation="sdpa", sharing=PromptSharingConfig(share_prompts=True))


@pytest.mark.parametrize("device, dtype", [("cuda", "float32"), ("auto", "float32"), ("cpu", "auto")])
def test_flash_attention_in_float32_is_refused_at_config_time(device: str, dtype: str) -> None:
    with pytest.raises(ValueError, match=r"LogprobWorkerConfig.attn_implementation='flash_attention_2' needs bf16"):
        LogprobWorkerConfig(model_path="m", device=device, dtype=dtype, attn_implementation="flash_attention_2")
    LogprobWorkerConfig(model_path="m", device=device, dtype="bfloat16", attn_implementation="flash_attention_2")


def test_flash_attention_with_auto_dtype_on_auto_device_is_checked_where_it_resolves() -> None:
    config = LogprobWorkerConfig(model_path="m", attn_implementation="flash_attention_2")  # cuda: bf16, fine
    assert resolve_model_settings(config, CUDA) == (torch.bfloat16, "flash_attention_2")
    with pytest.raises(ValueError, match="flash-attn does not run float32 models"):
        resolve_model_settings(config, CPU)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_one_at_a_time_equals_trainer_function_and_hf(tiny_model_dir: Path, share_prompts: bool) -> None:
    samples = _build_samples(6, _vocab_size(tiny_model_dir))
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_wait_ms=0.0), sharing=PromptSharingConfig(share_prompts=share_prompts)))

    async def run() -> list[list[float]]:
        results = await _one_at_a_time(worker, samples)
        await worker.shutdown()
        return results

    results = asyncio.run(run())
    assert (worker.dtype, worker.attn_implementation) == (torch.float32, PACKED_SDPA)  # the CPU trainer's
    # Same module, same single-sample input: the worker must reproduce the trainer bit for bit.
    for got, want in zip(results, _trainer_logprobs(tiny_model_dir, samples, share_prompts)):
        assert torch.equal(torch.tensor(got), want)
    assert _max_diff(results, _hf_logprobs(tiny_model_dir, samples)) <= FP32_TOLERANCE
    assert worker.stats().batches == len(samples)


def test_concurrent_batches_equal_one_at_a_time(tiny_model_dir: Path) -> None:
    budget = 256
    samples = _build_samples(40, _vocab_size(tiny_model_dir), seed=1)
    config = LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_tokens_per_forward=budget, max_wait_ms=50.0))
    worker = LogprobWorker("logprob-worker-0", config)

    async def run() -> tuple[list[list[float]], list[list[float]]]:
        sequential = await _one_at_a_time(worker, samples)
        batched = await _concurrently(worker, samples)
        await worker.shutdown()
        return sequential, batched

    sequential, batched = asyncio.run(run())
    max_diff = _max_diff(batched, [torch.tensor(s) for s in sequential])
    print(f"packed batches vs one-at-a-time: max abs logprob diff {max_diff:.2e}")
    assert max_diff <= FP32_TOLERANCE
    stats = worker.stats()
    total_tokens = sum(s.num_tokens for s in samples)
    batched_forwards = stats.batches - len(samples)
    assert stats.samples == 2 * len(samples) and stats.tokens == 2 * total_tokens
    assert total_tokens > 3 * budget  # the workload needs several batches
    assert -(-total_tokens // budget) <= batched_forwards < len(samples)
    assert stats.max_batch_samples > 1
    assert stats.max_batch_tokens <= budget and stats.oversized_samples == 0
    assert stats.output_tokens == 2 * sum(len(s.output_token_ids) for s in samples)


def test_oversized_sample_runs_alone(tiny_model_dir: Path) -> None:
    budget = 64
    vocab = _vocab_size(tiny_model_dir)
    samples = _build_samples(5, vocab, seed=2, max_prompt=10, max_output=10)
    rng = random.Random(3)
    samples.append(_build_sample(rng, vocab, prompt_len=40, output_len=60, prompt_id=99))
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_tokens_per_forward=budget)))

    async def run() -> list[list[float]]:
        results = await _concurrently(worker, samples)
        await worker.shutdown()
        return results

    results = asyncio.run(run())
    assert _max_diff(results, _trainer_logprobs(tiny_model_dir, samples)) <= FP32_TOLERANCE
    stats = worker.stats()
    assert stats.oversized_samples == 1 and stats.max_batch_tokens == 100


def test_full_budget_runs_without_waiting_and_shutdown_fails_queued(tiny_model_dir: Path) -> None:
    vocab = _vocab_size(tiny_model_dir)
    first, second, third = _build_samples(3, vocab, seed=4)
    budget = first.num_tokens + second.num_tokens
    config = LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_tokens_per_forward=budget, max_wait_ms=NEVER_MS))
    worker = LogprobWorker("logprob-worker-0", config)

    async def run() -> tuple[list[list[float]], BaseException | None]:
        full = [asyncio.create_task(worker.compute_logprobs(s)) for s in (first, second)]
        results = await asyncio.wait_for(asyncio.gather(*full), LIVENESS_S)
        waiting = asyncio.create_task(worker.compute_logprobs(third))
        await asyncio.sleep(0)
        assert worker.health().inflight_requests == 1
        await worker.shutdown()
        return results, (await asyncio.gather(waiting, return_exceptions=True))[0]

    results, error = asyncio.run(run())
    assert _max_diff(results, _trainer_logprobs(tiny_model_dir, [first, second])) <= FP32_TOLERANCE
    assert isinstance(error, RuntimeError) and "shut down" in str(error)
    assert worker.stats().batches == 1
    assert not worker.health().healthy


def test_bad_sample_fails_only_its_caller(tiny_model_dir: Path) -> None:
    vocab = _vocab_size(tiny_model_dir)
    good = _build_samples(4, vocab, seed=5)
    bad = Sample(input_token_ids=[1, 2, 3], gt_answer="", prompt_id=7, output_token_ids=[4, vocab + 10])
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir)))

    async def run() -> tuple[list, list[list[float]]]:
        mixed = await asyncio.gather(*(worker.compute_logprobs(s) for s in [*good[:2], bad, *good[2:]]), return_exceptions=True)
        after = await _concurrently(worker, good)
        await worker.shutdown()
        return mixed, after

    mixed, after = asyncio.run(run())
    assert isinstance(mixed[2], ValueError) and str(vocab + 10) in str(mixed[2])
    references = _trainer_logprobs(tiny_model_dir, good)
    assert _max_diff([r for i, r in enumerate(mixed) if i != 2], references) <= FP32_TOLERANCE
    assert _max_diff(after, references) <= FP32_TOLERANCE
    assert worker.stats().rejected_samples == 1 and worker.stats().failed_batches == 0


def test_group_call_answers_in_order_and_a_bad_sample_fails_it_before_queueing(tiny_model_dir: Path) -> None:
    vocab = _vocab_size(tiny_model_dir)
    good = _build_samples(6, vocab, seed=7)
    bad = Sample(input_token_ids=[1, 2, 3], gt_answer="", prompt_id=8, output_token_ids=[vocab])
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_wait_ms=50.0)))

    async def run() -> tuple[list[list[float]], BaseException | None]:
        answers = [a.values for a in await worker.compute_group_logprobs(good)]
        try:
            await worker.compute_group_logprobs([*good[:3], bad])
        except ValueError as err:
            return answers, err
        finally:
            await worker.shutdown()
        return answers, None

    answers, error = asyncio.run(run())
    assert _max_diff(answers, _trainer_logprobs(tiny_model_dir, good)) <= FP32_TOLERANCE
    assert error is not None and str(vocab) in str(error)
    stats = worker.stats()
    assert stats.rejected_samples == 1 and stats.samples == len(good)  # nothing of the failed call was scored


def test_failing_batch_errors_its_callers_and_worker_keeps_serving(tiny_model_dir: Path) -> None:
    samples = _build_samples(5, _vocab_size(tiny_model_dir), seed=6)
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(tiny_model_dir)))

    def fail_forward(module: torch.nn.Module, args: tuple) -> None:
        raise RuntimeError("injected forward failure")

    async def run() -> tuple[list, list[list[float]], WorkerHealth]:
        hook = worker.model.causal_lm.get_decoder().register_forward_pre_hook(fail_forward)
        failed = await asyncio.gather(*(worker.compute_logprobs(s) for s in samples), return_exceptions=True)
        hook.remove()
        served = await _concurrently(worker, samples)
        health = worker.health()
        await worker.shutdown()
        return failed, served, health

    failed, served, health = asyncio.run(run())
    assert all(isinstance(e, RuntimeError) and "injected forward failure" in str(e) for e in failed)
    assert _max_diff(served, _trainer_logprobs(tiny_model_dir, samples)) <= FP32_TOLERANCE
    stats = worker.stats()
    assert stats.failed_batches >= 1 and stats.samples == len(samples)
    # Not FAILED: a failing batch fails its callers only (the worker is not registered, so it is INIT).
    assert health.state == "INIT" and "injected forward failure" in health.detail


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_update_matches_hf_model_with_those_weights(
    ray_local, tiny_model_dir: Path, tiny_tied_model_dir: Path, other_model_dirs: dict[bool, Path], tied: bool
) -> None:
    start_dir, new_dir = (tiny_tied_model_dir if tied else tiny_model_dir), other_model_dirs[tied]
    samples = _build_samples(6, _vocab_size(start_dir), seed=7)
    worker = LogprobWorker("logprob-worker-0", LogprobWorkerConfig(model_path=str(start_dir)))
    update = _weight_update(new_dir, version=3)

    async def run() -> tuple[list[list[float]], int, list[list[float]]]:
        before = await _concurrently(worker, samples)
        version = await worker.update_weights(update)
        after = await _concurrently(worker, samples)
        await worker.shutdown()
        return before, version, after

    before, version, after = asyncio.run(run())
    new_reference = _hf_logprobs(new_dir, samples)
    assert _max_diff(before, _hf_logprobs(start_dir, samples)) <= FP32_TOLERANCE
    assert _max_diff(before, new_reference) > DIFFERENT_WEIGHTS_GAP
    assert _max_diff(after, new_reference) <= FP32_TOLERANCE
    assert version == 3 and worker.health().weight_version == 3 and worker.stats().weight_version == 3


def test_weight_update_lands_between_batches(ray_local, tiny_model_dir: Path, other_model_dirs: dict[bool, Path]) -> None:
    new_dir = other_model_dirs[False]
    samples = _build_samples(30, _vocab_size(tiny_model_dir), seed=8)
    config = LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_tokens_per_forward=128, max_wait_ms=0.0))
    worker = LogprobWorker("logprob-worker-0", config)
    update = _weight_update(new_dir, version=1)

    async def run() -> tuple[list[list[float]], list[list[float]]]:
        racing = [asyncio.create_task(worker.compute_logprobs(s)) for s in samples]
        await asyncio.sleep(0)
        await worker.update_weights(update)
        during = list(await asyncio.gather(*racing))
        after = await _concurrently(worker, samples)
        await worker.shutdown()
        return during, after

    during, after = asyncio.run(run())
    old_reference, new_reference = _trainer_logprobs(tiny_model_dir, samples), _trainer_logprobs(new_dir, samples)
    for got, old, new in zip(during, old_reference, new_reference):
        # Every sample is scored entirely by one weight version, never by a half-loaded model.
        got = torch.tensor(got)
        assert min((got - old).abs().max().item(), (got - new).abs().max().item()) <= FP32_TOLERANCE
    assert _max_diff(after, new_reference) <= FP32_TOLERANCE


def test_ray_actor_serves_batches_and_updates(ray_local, tiny_model_dir: Path, other_model_dirs: dict[bool, Path]) -> None:
    ray = ray_local
    name = "logprob-worker-0"
    samples = _build_samples(12, _vocab_size(tiny_model_dir), seed=9)
    config = LogprobWorkerConfig(model_path=str(tiny_model_dir),
        batching=LogprobBatchingConfig(max_tokens_per_forward=512, max_wait_ms=50.0))
    actor = LogprobWorkerActor.options(name=name).remote(name, config)
    try:
        health = ray.get(actor.start.remote())  # self-check passed; READY comes from registration
        assert isinstance(health, WorkerHealth) and health.state == "INIT" and not health.healthy
        assert (health.name, health.kind, health.weight_version) == (name, LOGPROB, -1)
        assert health.node_id == ray.get_runtime_context().get_node_id()
        ray.get(actor.mark_ready.remote())
        health = ray.get(actor.health.remote())
        assert health.state == "READY" and health.healthy
        before = ray.get([actor.compute_logprobs.remote(s) for s in samples])
        assert _max_diff(before, _trainer_logprobs(tiny_model_dir, samples)) <= FP32_TOLERANCE
        stats = ray.get(actor.stats.remote())
        assert stats.samples == len(samples) and stats.batches < len(samples)
        assert ray.get(actor.update_weights.remote(_weight_update(other_model_dirs[False], version=5))) == 5
        after = ray.get(actor.compute_group_logprobs.remote(samples))  # one call, answers in order
        assert [a.weight_version for a in after] == [5] * len(samples)  # each answer names its weights
        assert _max_diff([a.values for a in after], _hf_logprobs(other_model_dirs[False], samples)) <= FP32_TOLERANCE
        health = ray.get(actor.health.remote())
        assert (health.weight_version, health.state, health.requests_served) == (5, "RUNNING", len(samples) + 1)
        ray.get(actor.shutdown.remote())
        health = ray.get(actor.health.remote())
        assert health.state == "FINISH" and not health.healthy
        with pytest.raises(ray.exceptions.RayTaskError, match="shut down"):
            ray.get(actor.compute_logprobs.remote(samples[0]))
    finally:
        ray.kill(actor)


def _sharded_weight_update(model_dir: Path, version: int, world_size: int = 2) -> WeightUpdate:
    """The checkpoint's tensors cut by rows as FSDP2 ranks hold them, one Ray object per 'rank'
    (WeightPusher's sharded mode): the worker reassembles them tensor by tensor as it loads."""
    import ray

    shards: list[dict] = [{} for _ in range(world_size)]
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        offset = 0
        for rank, piece in enumerate(torch.tensor_split(tensor, world_size, dim=0) if tensor.dim() else [tensor]):
            shards[rank][name] = tensor_to_blob(piece, global_shape=tuple(tensor.shape), offset=offset)
            offset += piece.shape[0] if tensor.dim() else 0
    return WeightUpdate(version=version, shard_refs=[ray.put(s) for s in shards], mode="sharded")


@pytest.mark.parametrize("order", ["adapter_then_full", "full_then_adapter"])
def test_full_weights_and_a_lora_adapter_in_either_order(
    ray_local, tiny_model_dir: Path, other_model_dirs: dict[bool, Path], tmp_path: Path, order: str
) -> None:
    """One worker serves a LoRA run (its adapter wraps the model with PEFT) and a full-weights run
    (streamed, sharded), in either order: each time it scores as HF does with those weights."""
    from peft import PeftModel

    from async_grpo.demo_assets.tiny_model import write_random_adapter as _write_adapter

    samples = _build_samples(5, _vocab_size(tiny_model_dir), seed=11)
    adapter = _write_adapter(tiny_model_dir, tmp_path / "a1", 8, seed=1)
    worker = LogprobWorker("logprob-worker-either-order", LogprobWorkerConfig(
        model_path=str(tiny_model_dir), device="cpu", batching=LogprobBatchingConfig(max_wait_ms=0)))

    async def push_adapter(version: int) -> list[list[float]]:
        update = files_update(adapter, version, tmp_path / "weights" / "STABLE")
        mark_stable(update)
        assert await worker.update_weights(update) == version
        assert isinstance(worker.model.causal_lm, PeftModel)
        return await _concurrently(worker, samples)

    async def push_full(version: int) -> list[list[float]]:
        assert await worker.update_weights(_sharded_weight_update(other_model_dirs[False], version)) == version
        assert not isinstance(worker.model.causal_lm, PeftModel)
        return await _concurrently(worker, samples)

    async def run() -> tuple[list[list[float]], list[list[float]]]:
        await worker.start()
        if order == "adapter_then_full":
            adapted, full = await push_adapter(1), await push_full(2)
        else:
            full, adapted = await push_full(1), await push_adapter(2)
        await worker.shutdown()
        return adapted, full

    adapted, full = asyncio.run(run())
    assert _max_diff(full, _hf_logprobs(other_model_dirs[False], samples)) <= FP32_TOLERANCE
    peft = hf_model(tiny_model_dir, adapter)  # the adapter always goes on the checkpoint's own weights
    want = [reference_logprobs(peft, s.input_token_ids, s.output_token_ids) for s in samples]
    assert _max_diff(adapted, want) <= FP32_TOLERANCE
    assert _max_diff(adapted, _hf_logprobs(tiny_model_dir, samples)) > DIFFERENT_WEIGHTS_GAP  # the adapter acts
