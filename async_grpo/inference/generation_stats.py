"""What a generation worker counts: requests, completions, reward and generation failures,
weight updates and LoRA adapter changes, since it started. Its health detail and metrics read
them as 'generation/<field>' keys.

Worker side; a plain record (no Ray, no vLLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from async_grpo.rewards.shaping import ShapedReward
from sample_processing_utils import Sample


@dataclass(slots=True)
class GenerationStats:
    """Counters of one worker since it started."""

    requests: int = 0
    """Generate calls answered with samples."""
    samples: int = 0
    """Completions returned."""
    truncated: int = 0
    """Completions cut off at max_tokens."""
    reward_failures: int = 0
    """Completions whose verification failed or timed out (verdict 0, before format shaping)."""
    verdicts_in_worker: int = 0
    """Completions the worker verified itself, without a call to the verifier pool: plain numbers
    and the answers the pre-checks refuse (math_verifier.quick_verdict, the verdict the pool would
    give them from the same function)."""
    generation_failures: int = 0
    """Generate calls that raised inside the engine."""
    format_checked: int = 0
    """Completions checked against SamplingConfig.reward.format_pattern (verified ones only)."""
    format_matched: int = 0
    """Of those, completions that matched it (got format_bonus; the others got -format_penalty)."""
    weight_updates: int = 0
    """Weight updates applied (full weights or LoRA adapters)."""
    unattributed_versions: int = 0
    """Completions whose tokens the engine gave no weight-version spans for although a push
    landed while they ran: every token is attributed to the start version (the oldest)."""
    adapters_removed: int = 0
    """LoRA adapters unloaded from the engine after a newer one replaced them."""
    unstable_updates_refused: int = 0
    """LoRA updates refused because the STABLE marker did not name them."""
    endpoint_requests: int = 0
    """Requests answered through the worker's OpenAI-compatible endpoint (EngineConfig.openai_endpoint_port)."""
    base_restores: int = 0
    """Times the checkpoint's weights were reloaded from model_path before a LoRA adapter, because
    the engine held full weights pushed earlier (e.g. by a previous full fine-tuning run)."""

    def count(self, samples: list[Sample], shaped: list[ShapedReward]) -> None:
        """Count one answered generate call: its samples and their rewards."""
        self.requests += 1
        self.samples += len(samples)
        self.truncated += sum(s.truncated for s in samples)
        self.reward_failures += sum(s.reward_failed for s in samples)
        self.format_checked += sum(r.format_matched is not None for r in shaped)
        self.format_matched += sum(r.format_matched is True for r in shaped)

    def as_metrics(self) -> dict[str, float]:
        """Namespaced metric keys, e.g. 'generation/reward_failures'."""
        return {f"generation/{f.name}": float(getattr(self, f.name)) for f in dataclasses.fields(self)}
