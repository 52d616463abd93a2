"""The judge worker's plain parts: a generative judge over a stand-in engine (the chat it renders,
the reply's token counts, an engine death failing the worker), the frozen worker's refusals, and
a reward-model head on a tiny sequence-classification model built here, whose batched scores must
equal the model's own one-request-at-a-time scores. A judge over a real vLLM engine is checked in
tests/rollouts/test_multi_turn_vllm.py, on that module's engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_grpo.config.worker_options import JudgeServingConfig, LogprobBatchingConfig
from async_grpo.demo_assets.tiny_model import TinyModelConfig, build_chat_tokenizer, hf_config
from async_grpo.inference.judge_models import EngineDeadError, GenerativeJudge, load_reward_model_judge
from async_grpo.inference.judge_worker import JudgeWorker, JudgeWorkerConfig
from async_grpo.rewards.judge_reward import JudgeReply, JudgeRequest
from async_grpo.routing.batch_calls import Bundle, WorkerFailedError, serve_many
from async_grpo.routing.worker_lifecycle import WorkerState
from async_grpo.weights.update import WeightUpdate

MESSAGES = [{"role": "system", "content": "Grade it."}, {"role": "user", "content": "Is 3+4=7 right?"}]
# The ChatML layout written out by hand: what the judge's engine must be sent for MESSAGES.
EXPECTED_CHAT = ("<|im_start|>system\nGrade it.<|im_end|>\n<|im_start|>user\nIs 3+4=7 right?<|im_end|>\n"
                 "<|im_start|>assistant\n")


class StandInEngine:
    """TextEngine that answers `reply` (one token per character) and records what it was sent;
    `hold` keeps a request waiting; `dead` makes it die on the next request."""

    def __init__(self, reply: str = "8") -> None:
        self.reply = reply
        self.sent: list[tuple[list[int], int, float]] = []
        self.hold: asyncio.Event | None = None
        self.dead = False
        self.errored = False
        self.stopped = False

    async def complete(self, prompt_token_ids: list[int], max_tokens: int, temperature: float,
                       request_id: str) -> tuple[str, int]:
        self.sent.append((prompt_token_ids, max_tokens, temperature))
        if self.hold is not None:
            await self.hold.wait()
        if self.dead:
            self.errored = True
            raise EngineDeadError("vLLM engine died: EngineDeadError: gone")
        return self.reply, len(self.reply)

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_chat_tokenizer()


def _worker(tokenizer, engine: StandInEngine) -> JudgeWorker:
    return JudgeWorker("judge-worker-0", JudgeWorkerConfig(model_path="m"),
                       model=GenerativeJudge("judge-worker-0", tokenizer, engine))


def test_a_generative_judge_sends_the_chat_with_the_assistant_turn_open(chat_tokenizer) -> None:
    engine = StandInEngine(reply="7 out of 10")

    async def run() -> JudgeReply:
        worker = _worker(chat_tokenizer, engine)
        await worker.start()
        worker.mark_ready()
        return await worker.judge(JudgeRequest(messages=MESSAGES, max_tokens=12, temperature=0.5))

    reply = asyncio.run(run())
    expected_ids = chat_tokenizer.encode(EXPECTED_CHAT, add_special_tokens=False)
    assert engine.sent[-1] == (expected_ids, 12, 0.5)
    assert reply == JudgeReply(text="7 out of 10", prompt_tokens=len(expected_ids), completion_tokens=11)


def test_a_request_counts_one_in_the_load_while_it_runs(chat_tokenizer) -> None:
    engine = StandInEngine()

    async def run() -> tuple[int, int]:
        worker = _worker(chat_tokenizer, engine)
        await worker.start()
        worker.mark_ready()
        engine.hold = asyncio.Event()
        tasks = [asyncio.create_task(worker.judge(JudgeRequest(messages=MESSAGES, max_tokens=4, temperature=0.0)))
                 for _ in range(3)]
        await asyncio.sleep(0.01)
        during = worker.health().inflight_requests
        engine.hold.set()
        await asyncio.gather(*tasks)
        return during, worker.health().inflight_requests

    assert asyncio.run(run()) == (3, 0)


def test_a_dead_engine_fails_the_worker_and_its_requests_fail_over(chat_tokenizer) -> None:
    engine = StandInEngine()

    async def run() -> JudgeWorker:
        worker = _worker(chat_tokenizer, engine)
        await worker.start()
        worker.mark_ready()
        engine.dead = True
        request = JudgeRequest(messages=MESSAGES, max_tokens=4, temperature=0.0)
        with pytest.raises(WorkerFailedError, match="engine died"):
            await worker.judge(request)
        with pytest.raises(WorkerFailedError):  # FAILED answers nothing more
            await worker.judge(request)
        return worker

    worker = asyncio.run(run())
    health = worker.health()
    assert health.state == WorkerState.FAILED and not health.healthy and health.kind == "judge"


def test_an_engine_found_dead_by_health_fails_the_worker(chat_tokenizer) -> None:
    engine = StandInEngine()
    worker = _worker(chat_tokenizer, engine)
    asyncio.run(worker.start())
    worker.mark_ready()
    engine.errored = True
    assert worker.health().state == WorkerState.FAILED


def test_a_judge_refuses_weight_pushes_and_serves_only_judge_calls(chat_tokenizer) -> None:
    worker = _worker(chat_tokenizer, StandInEngine())

    async def run() -> list:
        await worker.start()
        worker.mark_ready()
        with pytest.raises(ValueError, match="frozen judge"):
            await worker.update_weights(WeightUpdate(version=3, shard_refs=[]))
        with pytest.raises(ValueError, match="not one of"):
            async for _ in serve_many(worker, ("judge",), "generate", Bundle([])):
                pass
        request = JudgeRequest(messages=MESSAGES, max_tokens=4, temperature=0.0)
        return [chunk async for chunk in serve_many(worker, ("judge",), "judge", Bundle([(request,)]))]

    chunks = asyncio.run(run())
    outcomes = [outcome for chunk in chunks for outcome in chunk.items]
    assert outcomes == [(0, True, JudgeReply(text="8", prompt_tokens=outcomes[0][2].prompt_tokens,
                                            completion_tokens=1))]


def test_a_model_whose_self_check_fails_leaves_the_worker_failed(chat_tokenizer) -> None:
    engine = StandInEngine()
    engine.dead = True
    worker = _worker(chat_tokenizer, engine)
    with pytest.raises(WorkerFailedError, match="self-check failed"):
        asyncio.run(worker.start())
    assert worker.health().state == WorkerState.FAILED


def test_the_judge_kind_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="JudgeServingConfig.judge_kind"):
        JudgeServingConfig(judge_kind="critic")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """A tiny Qwen2 sequence-classification model with one label and the chat tokenizer, saved as
    a reward-model checkpoint is."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = hf_config(TinyModelConfig(tokenizer="bpe"), chat_tokenizer)
    config.num_labels = 1
    out = tmp_path_factory.mktemp("tiny-reward-model")
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    chat_tokenizer.save_pretrained(out)
    return out


def test_a_reward_model_head_scores_batched_as_one_request_at_a_time(reward_model_dir: Path, chat_tokenizer) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    answers = ["7", "it is 12", "seven, since three and four make seven", "no", "8", "3+4 is 7 indeed"]
    requests = [JudgeRequest(messages=[MESSAGES[0], {"role": "user", "content": f"3+4=? Answer: {a}"}],
                             max_tokens=1, temperature=0.0) for a in answers]
    # A budget that holds about two requests: the six leave in several padded forwards.
    judge = load_reward_model_judge("judge-worker-0", str(reward_model_dir), "float32",
                                    LogprobBatchingConfig(max_tokens_per_forward=80, max_wait_ms=50))

    async def run() -> list[JudgeReply]:
        return list(await asyncio.gather(*(judge.answer(r) for r in requests)))

    replies = asyncio.run(run())
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    for request, reply in zip(requests, replies):
        text = chat_tokenizer.apply_chat_template(request.messages, tokenize=False)
        ids = chat_tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert float(reply.text) == pytest.approx(expected, abs=1e-5)
        assert reply.prompt_tokens == len(ids) and reply.completion_tokens == 0
    assert 1 < judge.batches < len(requests)
    assert len({r.text for r in replies}) > 1  # the scores differ: the test can tell answers apart


def test_a_reward_model_needs_one_label(tmp_path: Path, chat_tokenizer) -> None:
    from transformers import Qwen2ForSequenceClassification

    config = hf_config(TinyModelConfig(tokenizer="bpe"), chat_tokenizer)
    config.num_labels = 3
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    chat_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=3"):
        load_reward_model_judge("judge-worker-0", str(tmp_path), "float32", LogprobBatchingConfig())


def test_the_worker_config_names_the_serving_kind() -> None:
    config = JudgeWorkerConfig(model_path="m", serving=JudgeServingConfig(judge_kind="reward_model"))
    assert JudgeWorker("judge-worker-1", config).model_info() == {"model_path": "m", "judge_kind": "reward_model"}
