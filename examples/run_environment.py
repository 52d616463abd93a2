"""Run an environment's rollouts against a real vLLM engine and print them, turn by turn.

    .venv/bin/python -m examples.run_environment --environment.name examples.guess_environment:GuessNumber
    .venv/bin/python -m examples.run_environment --environment.name async_grpo.rollouts.tool_environment:ToolEnvironment \\
        --environment.options '{"tools": ["calculator", "python"]}' --environment.max_total_tokens 512

The rollouts are exactly what a generation worker trains on (multi_turn.run_rollouts over vLLM's
AsyncLLM, in this process): each line shows a turn's sampled tokens, the observation appended
after it, and at the end the reward, the sampled / observation token counts and why it stopped.
Without --model_path it writes the tiny chat model (random weights, the ChatML template) first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from dataclasses import dataclass

from async_grpo.config.worker_options import VerificationConfig
from async_grpo.config.rollout_sources import EnvironmentConfig
from async_grpo.rollouts.multi_turn import ChatRenderer, MultiTurnStats, engine_generate, run_rollouts
from async_grpo.config.sampling import SamplingConfig
from sample_processing_utils import Sample

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class RunEnvironmentConfig:
    """Command line of `python -m examples.run_environment`."""

    environment: EnvironmentConfig = EnvironmentConfig(name="examples.guess_environment:GuessNumber", max_turns=4,
                                                       max_total_tokens=256)
    """The environment and its limits (--environment.name, --environment.max_turns, ...)."""
    model_path: str = ""
    """A Hugging Face model folder with a chat template; "": write the tiny chat model first."""
    rollouts: int = 4
    """Rollouts of the one prompt, run concurrently."""
    question: str = "What is 12 + 30?"
    """The prompt record's question field."""
    gt_answer: str = "42"
    """The prompt record's gold answer."""
    max_tokens_per_turn: int = 16
    """sampling.max_tokens: tokens one turn may sample."""
    seed: int = 0
    """sampling.seed of the rollouts."""

    def __post_init__(self) -> None:
        if not self.environment.enabled:
            raise ValueError("RunEnvironmentConfig.environment.name must name an environment ('module:Class')")
        for name in ("rollouts", "max_tokens_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunEnvironmentConfig.{name} must be >= 1, got {getattr(self, name)}")


def _engine(model_path: str, max_model_len: int):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.config.worker_options import EngineConfig
    from async_grpo.inference.engine_start import engine_args
    from vllm_worker import GenerationWorkerConfig

    # The in-process executor, as GenerationWorker.start selects it on CPU.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = EngineConfig(max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=max_model_len,
                          enforce_eager=True, dtype="float32")
    config = GenerationWorkerConfig(model_path=model_path, engine=engine, verification=VerificationConfig(global_num_verifiers=1))
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(config, in_process=True)))


async def _run(config: RunEnvironmentConfig, model_path: str) -> None:
    from async_grpo.inference.engine_requests import sampling_params
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    engine = _engine(model_path, config.environment.max_total_tokens)
    try:
        sampling = SamplingConfig(n=1, max_tokens=config.max_tokens_per_turn, seed=config.seed)
        stats = MultiTurnStats()
        sample = Sample(input_token_ids=[0], gt_answer=config.gt_answer, prompt_id=0,
                        record={"question": config.question, "gt_answer": config.gt_answer})
        samples = await run_rollouts(
            sample, config.rollouts, config.environment,
            lambda i: engine_generate(engine, sampling_params(sampling, prompt_id=0), "example", rollout_index=i),
            ChatRenderer(tokenizer), config.max_tokens_per_turn, stats)
    finally:
        engine.shutdown()
    for i, s in enumerate(samples):
        print(f"--- rollout {i}: reward {s.reward}, {s.num_sampled_tokens} sampled + "
              f"{len(s.output_token_ids) - s.num_sampled_tokens} observation tokens, finish {s.finish_reason}")
        for sampled, text in _segments(s, tokenizer):
            print(f"{'model' if sampled else 'env  '} | {text!r}")
    print(" ".join(f"{k}={v:g}" for k, v in stats.metrics().items()))


def _segments(sample: Sample, tokenizer) -> list[tuple[bool, str]]:
    """The output split into runs of sampled and of observation tokens, decoded."""
    runs: list[tuple[bool, list[int]]] = []
    for token, sampled in zip(sample.output_token_ids, sample.output_mask):
        if runs and runs[-1][0] == sampled:
            runs[-1][1].append(token)
        else:
            runs.append((sampled, [token]))
    return [(sampled, tokenizer.decode(ids, skip_special_tokens=False)) for sampled, ids in runs]


def main(argv: list[str] | None = None) -> None:
    from async_grpo.config.run_config import load_config

    config = load_config(RunEnvironmentConfig, sys.argv[1:] if argv is None else argv, description=__doc__)
    config.environment.check()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="tiny-chat-") as scratch:
        model_path = config.model_path
        if not model_path:
            from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model

            model_path = str(write_tiny_model(scratch, TinyModelConfig(tokenizer="bpe")))
        asyncio.run(_run(config, model_path))


if __name__ == "__main__":
    main()
