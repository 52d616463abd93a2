"""A queue of requests that leave in batches of at most a token budget.

Plain asyncio, no model: the logprob worker puts each sample with its token count and scores
what `next_batch` hands out in one packed forward. A batch forms once the budget is full or
`max_wait_s` after its oldest request arrived, whichever is first; `select_batch` picks which
queued requests it holds.

    queue = TokenBudgetQueue(budget=8192, max_wait_s=0.02)
    future = queue.put(sample, sample.num_tokens)     # resolved by whoever scores the batch
    batch = await queue.next_batch()                  # [QueuedRequest, ...]; [] once closed
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(slots=True)
class QueuedRequest:
    """One queued request."""

    item: Any
    """What the caller queued (the logprob worker: a Sample)."""
    num_tokens: int
    """Tokens the item adds to a batch."""
    future: asyncio.Future
    """Resolved with the item's result, or the batch's error."""
    enqueued_at: float
    """Event-loop time when the request was queued."""


def select_batch(token_counts: Sequence[int], budget: int) -> list[int]:
    """Indices (in queue order) of the requests that form the next batch.

    The head of the queue is always taken, alone if it exceeds the budget, so no request waits
    more than one batch behind later ones. Then every later request that still fits is added
    (first fit), so one long sample does not cut a batch short for the short ones behind it.
    """
    if not token_counts:
        return []
    chosen, used = [0], token_counts[0]
    for index in range(1, len(token_counts)):
        if used + token_counts[index] <= budget:
            chosen.append(index)
            used += token_counts[index]
    return chosen


def fail_requests(requests: Sequence[QueuedRequest], error: BaseException) -> None:
    """Hand `error` to every request whose caller still waits."""
    for request in requests:
        if not request.future.done():
            request.future.set_exception(error)


class TokenBudgetQueue:
    """Requests with token counts, handed out as batches of at most `budget` tokens (one request
    over the budget leaves alone). Use it from one event loop."""

    def __init__(self, budget: int, max_wait_s: float) -> None:
        if budget < 1 or max_wait_s < 0:
            raise ValueError(f"TokenBudgetQueue needs budget >= 1 and max_wait_s >= 0, got {budget}, {max_wait_s}")
        self.budget = budget
        self.max_wait_s = max_wait_s
        self._requests: deque[QueuedRequest] = deque()
        self._tokens = 0
        self._arrival = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def queued_tokens(self) -> int:
        """Tokens of the requests waiting now."""
        return self._tokens

    def put(self, item: Any, num_tokens: int) -> asyncio.Future:
        """Queue `item` now (not at the caller's next await); returns the future its batch resolves."""
        if self._closed:
            raise RuntimeError("TokenBudgetQueue is closed")
        loop = asyncio.get_running_loop()
        request = QueuedRequest(item=item, num_tokens=num_tokens, future=loop.create_future(),
                                enqueued_at=loop.time())
        self._requests.append(request)
        self._tokens += num_tokens
        self._arrival.set()
        return request.future

    async def next_batch(self) -> list[QueuedRequest]:
        """Wait for a request, then until the budget is full or max_wait_s after the oldest one;
        remove and return the batch ([] once closed). Requests whose callers gave up are dropped."""
        while not self._requests and not self._closed:
            self._arrival.clear()
            await self._arrival.wait()
        if self._closed:
            return []
        loop = asyncio.get_running_loop()
        deadline = self._requests[0].enqueued_at + self.max_wait_s
        while self._tokens < self.budget and not self._closed:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), remaining)
            except TimeoutError:
                break
        return [] if self._closed else self._take()

    def _take(self) -> list[QueuedRequest]:
        live = [r for r in self._requests if not r.future.done()]
        chosen = select_batch([r.num_tokens for r in live], self.budget)
        picked = set(chosen)
        self._requests = deque(r for i, r in enumerate(live) if i not in picked)
        self._tokens = sum(r.num_tokens for r in self._requests)
        return [live[i] for i in chosen]

    def close(self) -> None:
        """Refuse new requests and wake a waiting next_batch (it returns []); the queued requests
        stay until fail_all."""
        self._closed = True
        self._arrival.set()

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued request with `error` and empty the queue."""
        fail_requests(list(self._requests), error)
        self._requests.clear()
        self._tokens = 0
