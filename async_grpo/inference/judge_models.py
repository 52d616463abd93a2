"""The models behind a judge worker: how one JudgeRequest becomes one JudgeReply.

- GenerativeJudge: the tokenizer's chat template renders the request's messages with the
  assistant turn opened, and a vLLM engine (engine_start.build_engine, the generation worker's
  own start; a judge never receives weight pushes) writes the reply with the request's max_tokens
  and temperature.
- RewardModelJudge: an HF sequence-classification model with one label scores the rendered chat;
  requests queue in a TokenBudgetQueue and leave in padded forwards of at most
  max_tokens_per_forward tokens, as the logprob worker's do. Its reply is the score as a plain
  decimal number, read with `verdict: number` (low and high set to the head's range).

Both talk to their model through a small protocol (TextEngine, SequenceScorer), so a unit test
drives them with a stand-in. Imports neither vLLM nor torch at import time.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from async_grpo.config.worker_options import EngineConfig, EngineTransferConfig, LogprobBatchingConfig
from async_grpo.inference.token_budget_queue import QueuedRequest, TokenBudgetQueue, fail_requests
from async_grpo.rewards.judge_reward import JudgeReply, JudgeRequest

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# A reward-model score as a reply: fixed-point, because the verdict rules read plain decimals
# (judge_template's number pattern has no exponent) and 6 places keep more than bf16 holds.
_SCORE_DECIMALS = 6


class EngineDeadError(RuntimeError):
    """The judge's model can no longer answer (its engine died): the worker FAILS and its
    requests go to another judge."""


def chat_text(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The messages through the tokenizer's chat template (the assistant turn opened when
    generation_prompt); ValueError naming the tokenizer when it has no template or it fails."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; a judge renders "
                         "its requests' messages with one")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):
        raise ValueError(f"the chat template of {tokenizer.name_or_path!r} returned {type(text).__name__}, not text")
    return text


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    """chat_text encoded without special tokens: the template writes its own (a second BOS otherwise)."""
    return list(tokenizer.encode(chat_text(tokenizer, messages, generation_prompt), add_special_tokens=False))


class TextEngine(Protocol):
    """What GenerativeJudge needs of an engine (VllmTextEngine over vLLM's AsyncLLM, or a test's stand-in)."""

    async def complete(self, prompt_token_ids: list[int], max_tokens: int, temperature: float,
                       request_id: str) -> tuple[str, int]:
        """(reply text, reply tokens) of one greedy or sampled completion; EngineDeadError when dead."""
        ...

    @property
    def errored(self) -> bool:
        """The engine died (no request needed to notice)."""
        ...

    def shutdown(self) -> None: ...


class VllmTextEngine:
    """TextEngine over a started AsyncLLM."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    async def complete(self, prompt_token_ids: list[int], max_tokens: int, temperature: float,
                       request_id: str) -> tuple[str, int]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        params = SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        try:
            async for output in self._engine.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), params,
                                                      request_id):
                final = output
        except Exception as exc:
            if isinstance(exc, VllmEngineDead) or self._engine.errored:
                raise EngineDeadError(f"vLLM engine died: {type(exc).__name__}: {exc}") from exc
            raise
        if final is None or not final.outputs:
            raise RuntimeError(f"request {request_id}: the engine returned no completion")
        return final.outputs[0].text, len(final.outputs[0].token_ids)

    @property
    def errored(self) -> bool:
        return bool(self._engine.errored)

    def shutdown(self) -> None:
        self._engine.shutdown()


class GenerativeJudge:
    """Replies from a generative model: chat template, then the engine's completion."""

    def __init__(self, worker_name: str, tokenizer: Any, engine: TextEngine) -> None:
        self.worker_name = worker_name
        self.tokenizer = tokenizer
        self.engine = engine
        self._requests = 0

    async def answer(self, request: JudgeRequest) -> JudgeReply:
        prompt = chat_token_ids(self.tokenizer, request.messages, generation_prompt=True)
        self._requests += 1
        request_id = f"{self.worker_name}-judge-{self._requests}-{uuid.uuid4().hex[:8]}"
        text, completion_tokens = await self.engine.complete(prompt, request.max_tokens, request.temperature,
                                                             request_id)
        return JudgeReply(text=text, prompt_tokens=len(prompt), completion_tokens=completion_tokens)

    def problem(self) -> str:
        return "vLLM engine died" if self.engine.errored else ""

    async def close(self) -> None:
        self.engine.shutdown()


def start_generative_judge(worker_name: str, model_path: str, engine: EngineConfig) -> GenerativeJudge:
    """A GenerativeJudge on its own vLLM engine, started as a generation worker's is (tens of
    seconds); engine_start.EngineStartError with one line when it does not start."""
    from async_grpo.inference.engine_start import build_engine
    from setup_model import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    chat_text(tokenizer, [{"role": "user", "content": "?"}], generation_prompt=True)  # no template: fail now
    spec = _EngineSpec(model_path=model_path, engine=engine)
    async_llm, _way = build_engine(spec, worker_name)
    return GenerativeJudge(worker_name, tokenizer, VllmTextEngine(async_llm))


class _EngineSpec:
    """engine_start.EngineSpec of a judge: its model and engine options."""

    def __init__(self, model_path: str, engine: EngineConfig) -> None:
        self.model_path = model_path
        self.engine = engine
        # A judge never receives weight pushes; the engine still names a transfer backend.
        self.transfer = EngineTransferConfig()


class SequenceScorer(Protocol):
    """What RewardModelJudge needs of a model: one score per token sequence, in a batch."""

    def score(self, sequences: list[list[int]]) -> list[float]: ...


class HfSequenceScorer:
    """SequenceScorer over a decoder-only HF AutoModelForSequenceClassification with one label and
    a `score` head (Llama, Qwen2, Mistral, Gemma reward models): right-padded batches with an
    attention mask, the head read at each sequence's last real token."""

    def __init__(self, model_path: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from setup_model import MODEL_DTYPES, load_tokenizer, training_compute_dtype

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = (training_compute_dtype(self.device, mixed_precision=True) if dtype == "auto"
                       else MODEL_DTYPES[dtype])
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch_dtype).to(self.device)
        self.model.eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_path}: a reward-model judge needs a sequence-classification head with one "
                             f"label (its score), this one has num_labels={self.model.config.num_labels}")
        if not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise ValueError(f"{model_path}: a reward-model judge reads a decoder's `score` head at the last token; "
                             f"{type(self.model).__name__} has none")
        self.tokenizer = load_tokenizer(model_path)

    def score(self, sequences: list[list[int]]) -> list[float]:
        import torch

        longest = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        with torch.inference_mode():
            # The head's logits at every position, read at each row's own last token: no reliance
            # on a pad id (HF's pooling looks for the last non-pad token, which a pad id equal to
            # a real last token would misplace).
            hidden = self.model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            last = torch.tensor([len(s) - 1 for s in sequences], device=self.device)
            states = hidden.last_hidden_state[torch.arange(len(sequences), device=self.device), last]
            return [float(v) for v in self.model.score(states).float()[:, 0].cpu()]


class RewardModelJudge:
    """Replies from a reward-model head: each request's rendered chat queued with its token count,
    scored in batches of at most batching.max_tokens_per_forward tokens (one longer request runs
    alone), one forward at a time in a thread. Use it from one event loop."""

    def __init__(self, worker_name: str, tokenizer: Any, scorer: SequenceScorer,
                 batching: LogprobBatchingConfig) -> None:
        self.worker_name = worker_name
        self.tokenizer = tokenizer
        self.scorer = scorer
        self._queue = TokenBudgetQueue(batching.max_tokens_per_forward, batching.max_wait_ms / 1000.0)
        self._batcher: asyncio.Task[None] | None = None
        self.batches = 0
        """Forwards run (for stats and tests)."""

    async def answer(self, request: JudgeRequest) -> JudgeReply:
        ids = chat_token_ids(self.tokenizer, request.messages, generation_prompt=False)
        if not ids:
            raise ValueError("the judge request renders to no tokens")
        if self._batcher is None:
            self._batcher = asyncio.get_running_loop().create_task(self._batch_forever(), name=f"{self.worker_name}-rm")
        score = await self._queue.put(ids, len(ids))
        return JudgeReply(text=f"{score:.{_SCORE_DECIMALS}f}", prompt_tokens=len(ids), completion_tokens=0)

    async def _batch_forever(self) -> None:
        while True:
            batch = await self._queue.next_batch()
            if not batch:
                return
            await self._run(batch)

    async def _run(self, batch: list[QueuedRequest]) -> None:
        try:
            scores = await asyncio.to_thread(self.scorer.score, [r.item for r in batch])
        except Exception as error:  # the batch's callers get the error; the next batch runs
            logger.exception("%s: reward-model batch of %d failed", self.worker_name, len(batch))
            fail_requests(batch, error)
            return
        self.batches += 1
        for request, score in zip(batch, scores):
            if not request.future.done():
                request.future.set_result(score)

    def problem(self) -> str:
        if self._batcher is not None and self._batcher.done() and not self._batcher.cancelled():
            return f"batching task stopped: {self._batcher.exception()!r}"
        return ""

    async def close(self) -> None:
        self._queue.close()
        if self._batcher is not None:
            await asyncio.gather(self._batcher, return_exceptions=True)
        self._queue.fail_all(RuntimeError(f"{self.worker_name} shut down"))


def load_reward_model_judge(worker_name: str, model_path: str, dtype: str,
                            batching: LogprobBatchingConfig) -> RewardModelJudge:
    """A RewardModelJudge on the HF sequence-classification checkpoint at model_path (one label)."""
    scorer = HfSequenceScorer(model_path, dtype)
    chat_text(scorer.tokenizer, [{"role": "user", "content": "?"}], generation_prompt=False)  # no template: fail now
    return RewardModelJudge(worker_name, scorer.tokenizer, scorer, batching)
