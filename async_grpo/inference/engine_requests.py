"""One rollout request as a generation worker puts it to its vLLM engine and reads the answer:
our SamplingConfig as vLLM's SamplingParams (`sampling_params`), a vLLM completion as a completed
Sample (`completed_sample`), and the self-check's one greedy token (`canary_tokens`).

Worker side: vLLM is imported when a request is built, not at import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from async_grpo.config.sampling import SamplingConfig, request_seed
from async_grpo.rollouts.token_versions import CompletionVersions
from sample_processing_utils import Sample

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

# vLLM's finish_reason for a completion cut off at max_tokens.
FINISH_LENGTH = "length"


def sampling_params(sampling: SamplingConfig, prompt_id: int) -> SamplingParams:
    """vLLM's SamplingParams for one prompt's request."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    # FINAL_ONLY: with n > 1 the default cumulative stream's last output can miss completions.
    # include_stop_str_in_output: vLLM keeps the tokens of a stop string (up to the one that
    # completes it) in token_ids either way; keeping the string in the text too makes the
    # rewarded text the decoded trained tokens (see sampling.py's module docstring).
    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=request_seed(sampling.seed, prompt_id, sampling.n),
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        include_stop_str_in_output=True,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def canary_tokens(engine: AsyncLLM, request_id: str) -> int:
    """Tokens the engine returns for one greedy token of the prompt [0] (a live engine: 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    final = None
    async for output in engine.generate(TokensPrompt(prompt_token_ids=[0]), SamplingParams(max_tokens=1, temperature=0.0),
                                        request_id):
        final = output
    return 0 if final is None else len(final.outputs[0].token_ids)


def _token_logprobs(completion: CompletionOutput) -> list[float]:
    """Logprob of each sampled token (SamplingParams(logprobs=0) returns exactly that one)."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although the request asked for them")
    return [float(position[token].logprob) for token, position in zip(completion.token_ids, completion.logprobs)]


def completed_sample(sample: Sample, completion: CompletionOutput, versions: CompletionVersions) -> Sample:
    """A copy of `sample` completed by one of vLLM's completions, with the weight versions that
    sampled its tokens (token_versions.TokenVersionTracker.finish)."""
    finish_reason = str(completion.finish_reason or "")
    return dataclasses.replace(
        sample,
        input_token_ids=list(sample.input_token_ids),
        output_token_ids=list(completion.token_ids),
        output_text=completion.text,
        sampling_logprobs=_token_logprobs(completion),
        finish_reason=finish_reason,
        truncated=finish_reason == FINISH_LENGTH,
        weight_version=versions.weight_version,
        token_versions=versions.token_versions,
    )
