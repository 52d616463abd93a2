"""A rollout that straddles a weight push (weight_update_pause_mode: keep) carries the right
version per token, and each segment's sampling logprobs are those of the weights its version names.

    .venv/bin/python -m pytest tests/rollouts/test_token_versions_engine.py -q

One real vLLM engine in a GenerationWorkerActor on the bundled tiny Qwen2 (random weights: with
max_tokens 200 most completions run long, so a push issued while a request is in flight lands in
the middle of some of them). The pushed versions alternate between two seeded perturbations of
the model, saved so HF can load each: every completion's tokens are scored by HF under the
version of each run in Sample.token_versions, and must match vLLM's sampling logprobs there (and
differ from the other version's, so the check can tell them apart). The token at a boundary is
the one sampled in the engine step that raced with the pause: it must belong to the old run.
The decoupled loss then weighs each segment by its own version's importance weight.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from async_grpo.config.worker_options import EngineConfig, VerificationConfig
from async_grpo.config.sampling import SamplingConfig
from async_grpo.rollouts.token_versions import version_runs
from async_grpo.weights.update import WeightUpdate, state_dict_to_blobs
from grpo_loss import LossConfig, grpo_loss
from sample_processing_utils import Sample, post_process_batch
from support.generation_worker import perturbed_copy
from support.reference_logprobs import reference_logprobs
from vllm_worker import GenerationWorkerActor, GenerationWorkerConfig

logger = logging.getLogger(__name__)

pytestmark = [pytest.mark.vllm]

# float32 engine vs float32 HF on the same tokens: observed max |diff| ~3e-6
# (tests/inference/test_vllm_worker.py).
LOGPROB_ATOL = 1e-4
# The two versions are seeded perturbations (support.generation_worker.perturbed_copy: noise of scale 0.1
# moves the tiny model's logprobs by ~1 nat); a 0.1 gap proves a segment matches its own version
# and not the other one.
MIN_OTHER_VERSION_GAP = 0.1
# One token's logprob may move less than the gap; over this many the largest move is well above it.
MIN_GAP_TOKENS = 4
MAX_TOKENS = 200
COMPLETIONS = 4
# A push lands after the request entered the worker; if it landed before any token was sampled
# (or after all finished), no completion straddles it and the request is tried again.
ATTEMPTS = 5
# The decoupled objective's cap on a stale token's weight pi_old / pi_sampler in this test.
BEHAVIOUR_CAP = 2.0
HEALTH_POLLS = 10_000  # health calls while waiting for the request to be in flight (bound, not timing)


def _config(model_dir: Path) -> GenerationWorkerConfig:
    engine = EngineConfig(max_num_seqs=16, gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 << 20,
                          max_model_len=256, enforce_eager=True, dtype="float32")
    return GenerationWorkerConfig(model_path=str(model_dir), engine=engine, verification=VerificationConfig(global_num_verifiers=1),
                                  weight_update_pause_mode="keep")


def _check_segments(rollout: Sample, version_dirs: dict[int, Path]) -> None:
    """Each run's logprobs are its own version's (HF), not the other version's."""
    position = 0
    for version, count in version_runs(rollout):
        other = next(v for v in version_dirs if v != version)
        own = reference_logprobs(version_dirs[version], rollout.input_token_ids, rollout.output_token_ids)
        other_hf = reference_logprobs(version_dirs[other], rollout.input_token_ids, rollout.output_token_ids)
        got = torch.tensor(rollout.sampling_logprobs[position:position + count])
        assert float((got - own[position:position + count]).abs().max()) <= LOGPROB_ATOL, (version, position, count)
        if count >= MIN_GAP_TOKENS:
            assert float((got - other_hf[position:position + count]).abs().max()) >= MIN_OTHER_VERSION_GAP
        position += count


def _check_segment_weights(rollout: Sample, version_dirs: dict[int, Path], newest: int) -> None:
    """The decoupled loss weighs each segment by its own version: at the trainer's version `newest`
    (pi_old = that version's HF logprobs), tokens of the older segment by min(pi_old / pi_sampler,
    cap), the newest segment's by 1. Read from the gradient: at ratio 1 it is -A x weight / |o|."""
    proximal = reference_logprobs(version_dirs[newest], rollout.input_token_ids, rollout.output_token_ids)
    batch = post_process_batch([replace(rollout, old_logprobs=proximal.tolist(), advantage=1.0)])
    logprobs = batch.old_logprobs.clone().requires_grad_(True)
    loss, _ = grpo_loss(logprobs, batch, LossConfig(decoupled=True, is_cap=BEHAVIOUR_CAP), policy_version=newest)
    loss.backward()
    weights = -logprobs.grad * len(rollout.output_token_ids)
    sampling = torch.tensor(rollout.sampling_logprobs)
    position = 0
    for version, count in version_runs(rollout):
        segment = slice(position, position + count)
        expected = (torch.ones(count) if version == newest
                    else torch.exp(proximal[segment] - sampling[segment]).clamp(max=BEHAVIOUR_CAP))
        torch.testing.assert_close(weights[segment], expected, rtol=1e-5, atol=1e-6)
        position += count


def test_a_rollout_straddling_a_push_has_per_token_versions_and_logprobs(ray_local, tiny_model_dir,
                                                                          tmp_path: Path) -> None:
    ray = ray_local
    dirs = {0: tmp_path / "even", 1: tmp_path / "odd"}
    blobs = {parity: ray.put(state_dict_to_blobs(perturbed_copy(tiny_model_dir, d, seed=11 + parity)))
             for parity, d in dirs.items()}
    actor = GenerationWorkerActor.options(name="generation-worker-test-token-versions").remote(
        "generation-worker-test-token-versions", _config(tiny_model_dir))
    try:
        ray.get(actor.start.remote())
        ray.get(actor.mark_ready.remote())
        version = 1
        assert ray.get(actor.update_weights.remote(WeightUpdate(version=version, shard_refs=[blobs[1]]))) == version
        sample = Sample(input_token_ids=[3, 1, 4, 1, 5, 9, 2, 6], gt_answer="7", prompt_id=0)
        straddled: list[Sample] = []
        for attempt in range(ATTEMPTS):
            old = version
            sampling = SamplingConfig(n=COMPLETIONS, temperature=1.0, max_tokens=MAX_TOKENS, seed=attempt)
            pending = actor.generate.remote(sample, sampling)
            for _ in range(HEALTH_POLLS):
                if ray.get(actor.health.remote()).inflight_requests:
                    break
            version += 1
            assert ray.get(actor.update_weights.remote(WeightUpdate(version=version,
                                                                    shard_refs=[blobs[version % 2]]))) == version
            rollouts = ray.get(pending)
            version_dirs = {old: dirs[old % 2], version: dirs[version % 2]}
            for rollout in rollouts:
                runs = version_runs(rollout)
                assert sum(count for _, count in runs) == len(rollout.output_token_ids)
                assert [v for v, _ in runs] in ([old], [version], [old, version]), runs
                assert rollout.weight_version == runs[0][0]
                _check_segments(rollout, version_dirs)
            straddled += [r for r in rollouts if len(version_runs(r)) == 2]
            for rollout in straddled:
                _check_segment_weights(rollout, version_dirs, newest=version)
            if straddled:
                break
            logger.warning("attempt %d: the push straddled no completion (lengths %s); trying again", attempt,
                           [len(r.output_token_ids) for r in rollouts])
        assert straddled, f"no completion straddled a push in {ATTEMPTS} attempts"
        assert all(r.token_versions is not None and all(c > 0 for _, c in r.token_versions) for r in straddled)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
