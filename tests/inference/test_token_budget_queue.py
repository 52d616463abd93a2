"""TokenBudgetQueue: batches of at most a token budget, formed when full or max_wait after the
oldest request, first fit behind the head; plain asyncio, no model.

    .venv/bin/python -m pytest tests/inference/test_token_budget_queue.py -q
"""

from __future__ import annotations

import asyncio
import random

import pytest

from async_grpo.inference.token_budget_queue import TokenBudgetQueue, fail_requests, select_batch

# A wait no test reaches: batches that must form without it prove the budget triggered them.
NEVER_S = 3600.0
_CLOCK_ALLOWANCE_S = 1e-3


def _run(coro):
    return asyncio.run(coro)


def test_select_batch_takes_head_then_first_fit() -> None:
    assert select_batch([], 10) == []
    assert select_batch([10, 50, 20, 5], 40) == [0, 2, 3]
    assert select_batch([100, 5, 5], 50) == [0]  # oversized head runs alone
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(20, 80)
        chosen = select_batch(counts, budget)
        used = sum(counts[i] for i in chosen)
        assert chosen[0] == 0 and chosen == sorted(set(chosen))
        assert used <= budget or chosen == [0]
        # First fit leaves nothing behind that would still have fitted.
        assert all(used + counts[i] > budget for i in range(len(counts)) if i not in chosen)


def test_a_full_budget_forms_a_batch_without_waiting() -> None:
    async def scenario() -> tuple[list[str], list[str], int]:
        queue = TokenBudgetQueue(budget=10, max_wait_s=NEVER_S)
        for name, tokens in (("a", 4), ("b", 9), ("c", 6), ("d", 3)):
            queue.put(name, tokens)
        first = [r.item for r in await queue.next_batch()]
        second = [r.item for r in await asyncio.wait_for(queue.next_batch(), NEVER_S)]
        return first, second, queue.queued_tokens

    # 4 + 6 fill the budget (b, 9 tokens, does not fit behind a); then b alone (9 + 3 > 10).
    assert _run(scenario()) == (["a", "c"], ["b"], 3)


def test_an_unfilled_batch_leaves_after_max_wait_from_its_oldest_request() -> None:
    async def scenario() -> tuple[list[str], float]:
        queue = TokenBudgetQueue(budget=1000, max_wait_s=0.05)
        loop = asyncio.get_running_loop()
        queue.put("a", 3)
        queue.put("b", 4)
        batch = await queue.next_batch()
        return [r.item for r in batch], loop.time() - batch[0].enqueued_at

    items, waited = _run(scenario())
    assert items == ["a", "b"]
    # It did not leave before the oldest request had waited max_wait_s (asyncio may fire a
    # timer up to its clock resolution early, far below the allowance).
    assert waited >= 0.05 - _CLOCK_ALLOWANCE_S


def test_an_oversized_request_leaves_alone() -> None:
    async def scenario() -> list:
        queue = TokenBudgetQueue(budget=8, max_wait_s=0.0)
        queue.put("big", 20)
        queue.put("small", 2)
        return [[r.item for r in await queue.next_batch()] for _ in range(2)]

    assert _run(scenario()) == [["big"], ["small"]]


def test_requests_whose_callers_gave_up_are_dropped() -> None:
    async def scenario() -> tuple[list[str], int]:
        queue = TokenBudgetQueue(budget=100, max_wait_s=0.0)
        gone = queue.put("gone", 5)
        queue.put("kept", 7)
        gone.cancel()
        return [r.item for r in await queue.next_batch()], len(queue)

    assert _run(scenario()) == (["kept"], 0)


def test_a_waiting_next_batch_wakes_on_a_put_and_on_close() -> None:
    async def scenario() -> tuple[list[str], list]:
        queue = TokenBudgetQueue(budget=100, max_wait_s=0.0)
        waiting = asyncio.ensure_future(queue.next_batch())
        await asyncio.sleep(0)
        queue.put("late", 1)
        woken = [r.item for r in await asyncio.wait_for(waiting, NEVER_S)]
        closing = asyncio.ensure_future(queue.next_batch())
        await asyncio.sleep(0)
        queue.close()
        return woken, await asyncio.wait_for(closing, NEVER_S)

    assert _run(scenario()) == (["late"], [])


def test_close_keeps_queued_requests_until_fail_all_and_refuses_new_ones() -> None:
    async def scenario() -> tuple[int, bool, str]:
        queue = TokenBudgetQueue(budget=100, max_wait_s=NEVER_S)
        future = queue.put("queued", 3)
        queue.close()
        kept = len(queue)
        assert await queue.next_batch() == []
        with pytest.raises(RuntimeError, match="closed"):
            queue.put("after", 1)
        queue.fail_all(RuntimeError("shut down"))
        with pytest.raises(RuntimeError, match="shut down"):
            await future
        return kept, future.done(), str(queue.queued_tokens)

    assert _run(scenario()) == (1, True, "0")


def test_fail_requests_leaves_answered_ones_alone() -> None:
    async def scenario() -> tuple[str, str]:
        queue = TokenBudgetQueue(budget=100, max_wait_s=0.0)
        answered, failed = queue.put("a", 1), queue.put("b", 1)
        batch = await queue.next_batch()
        answered.set_result("done")
        fail_requests(batch, ValueError("batch failed"))
        return answered.result(), type(failed.exception()).__name__

    assert _run(scenario()) == ("done", "ValueError")


@pytest.mark.parametrize("budget, wait", [(0, 0.0), (1, -1.0)])
def test_bad_settings_are_refused(budget: int, wait: float) -> None:
    with pytest.raises(ValueError, match="TokenBudgetQueue"):
        TokenBudgetQueue(budget=budget, max_wait_s=wait)
