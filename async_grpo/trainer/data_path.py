"""How trainer ranks get their prompts to the ExperienceBatcher and their minibatches back.

Two paths, chosen by TrainerConfig.data_path:

- `per_rank` (PerRankDataPath): every rank submits its own prompts to the batcher actor and
  pulls its own minibatches from it over Ray.
- `rank0` (Rank0DataPath): only rank 0 talks to the batcher. Prompts: every rank draws its
  prompt indices from its own sampler as before and all-gathers them (an int64 tensor) inside
  the trainer's process group; rank 0 submits every rank's prompts. Minibatches: rank 0 reads one
  *round* from the batcher, the next message of every rank for the step
  (ExperienceBatcher.next_round), acknowledges it once it holds all of it (ack_round), then
  hands each rank its message with two collectives, a broadcast of the encoded sizes and a
  scatter of the encoded bytes. The other ranks never touch Ray's network path for data, which
  at 8+ ranks per node keeps the object transfers to one process per node group and puts the
  fan-out on the interconnect (NCCL) instead.

Ordering (a two-phase protocol: release, then acknowledge): the batcher refuses round i + 1 until round i was
acknowledged, so a round is only ever released to a reader that holds the previous one whole;
a rank starts a minibatch only after the scatter that carried it completed; and a step's
EndOfStep arrives in its own round, after every round of data before it.

Messages cross the process group as bytes in the safetensors format (encode_message): token
ids and per-token values as tensors, the per-sample scalars and strings as JSON metadata, never
pickle. Decoding gives back Minibatch/EndOfStep/PromptRequest records equal to the batcher's,
so both paths hand every rank the same minibatches.

Failure: an error rank 0 gets from the batcher is scattered to every rank as an error message
and raised everywhere; if rank 0 dies or hangs, the others raise Rank0DataPathError naming the
step. Every collective is issued with async_op=True and waited with a deadline
(_deadline_s: a little under the process group's timeout), on gloo and NCCL alike: NCCL reports
a dead peer only through its watchdog, which aborts the process at the group's timeout, and a
blocking NCCL call (or `int(sizes.max())` on a CUDA tensor) would hang until then without a
word. gloo fails the wait itself when the peer's connection closes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as torch_dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from async_grpo.batching.batcher_messages import EndOfStep, Minibatch, PromptRequest
from async_grpo.trainer.fsdp_setup import DistInfo
from sample_processing_utils import JudgeUsage, Sample

logger = logging.getLogger(__name__)

Message = Minibatch | EndOfStep | PromptRequest

# ---------------------------------------------------------------------------------------------
# Codec: messages <-> safetensors bytes (no pickle)
# ---------------------------------------------------------------------------------------------

_INT_LIST_FIELDS = ("input_token_ids", "output_token_ids")
"""Sample fields that are lists of token ids: one int64 tensor each, split by per-sample lengths."""
_BOOL_LIST_FIELDS = ("output_mask",)
"""Sample fields that are lists of flags or None: int64 0/1 on the wire, lengths -1 for None."""
_FLOAT_LIST_FIELDS = ("sampling_logprobs", "ref_logprobs", "old_logprobs", "teacher_logprobs", "token_advantages")
"""Sample fields that are lists of floats or None: float64 (exact for Python floats), lengths -1 for None."""
_SCALAR_FIELDS = ("gt_answer", "prompt_id", "group_id", "run_id", "output_text", "finish_reason", "truncated",
                  "reward", "advantage", "weight_version", "reward_failed", "reward_masked", "solved", "record",
                  "reward_parts", "reward_failure_reasons", "token_versions", "judge_usage")
"""Sample fields carried in the JSON metadata (Python's JSON round-trips floats exactly)."""

_ALL_FIELDS = set(_INT_LIST_FIELDS) | set(_BOOL_LIST_FIELDS) | set(_FLOAT_LIST_FIELDS) | set(_SCALAR_FIELDS)
if _ALL_FIELDS != {f.name for f in fields(Sample)}:  # a new Sample field must get a place here
    raise ImportError(f"data_path's codec does not cover Sample's fields: "
                      f"{sorted(_ALL_FIELDS ^ {f.name for f in fields(Sample)})}")

_KINDS = {"minibatch": Minibatch, "end_of_step": EndOfStep, "prompt_request": PromptRequest}

# Share of the process group's timeout a rank waits for one collective of this path: our own
# deadline must pass first, so that on NCCL the rank raises Rank0DataPathError before the
# watchdog aborts the process at the group's timeout.
_DEADLINE_FRACTION = 0.9


class Rank0DataPathError(RuntimeError):
    """A rank could not get its data through rank 0 (rank 0 died, or reported an error)."""


def _lengths_and_values(samples: Sequence[Sample], name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    lists = [getattr(s, name) for s in samples]
    lengths = [-1 if values is None else len(values) for values in lists]
    flat = [v for values in lists if values is not None for v in values]
    return {f"{name}.lengths": torch.tensor(lengths, dtype=torch.int64),
            f"{name}.values": torch.tensor(flat, dtype=dtype)}


def encode_message(message: Message | BaseException) -> bytes:
    """One batcher message (or an error to report to the other ranks) as safetensors bytes."""
    if isinstance(message, BaseException):
        return safetensors_save({}, metadata={"kind": "error", "message": f"{type(message).__name__}: {message}"})
    if isinstance(message, Minibatch):
        tensors: dict[str, torch.Tensor] = {}
        for name in (*_INT_LIST_FIELDS, *_BOOL_LIST_FIELDS):
            tensors.update(_lengths_and_values(message.samples, name, torch.int64))
        for name in _FLOAT_LIST_FIELDS:
            tensors.update(_lengths_and_values(message.samples, name, torch.float64))
        header = {"step": message.step, "rank": message.rank, "index": message.index,
                  "loss_weight": message.loss_weight,
                  "samples": [_scalars(s) for s in message.samples]}
        return safetensors_save(tensors, metadata={"kind": "minibatch", "header": json.dumps(header)})
    for kind, cls in _KINDS.items():
        if isinstance(message, cls):
            return safetensors_save({}, metadata={"kind": kind, "header": json.dumps(asdict(message))})
    raise TypeError(f"encode_message: unexpected message {type(message).__name__}")


def _scalars(sample: Sample) -> dict[str, Any]:
    """A sample's _SCALAR_FIELDS as JSON values (JudgeUsage as its dict)."""
    out = {name: getattr(sample, name) for name in _SCALAR_FIELDS}
    if sample.judge_usage is not None:
        out["judge_usage"] = asdict(sample.judge_usage)
    return out


def _split(tensors: dict[str, torch.Tensor], name: str, count: int) -> list[list[Any] | None]:
    lengths = tensors[f"{name}.lengths"].tolist()
    values = tensors[f"{name}.values"].tolist()
    if len(lengths) != count or sum(max(n, 0) for n in lengths) != len(values):
        raise ValueError(f"decode_message: field {name} has {len(values)} values for lengths {lengths}")
    out: list[list[Any] | None] = []
    start = 0
    for n in lengths:
        out.append(None if n < 0 else values[start:start + n])
        start += max(n, 0)
    return out


def decode_message(data: bytes) -> Message:
    """Inverse of encode_message; an encoded error raises Rank0DataPathError with its text."""
    metadata = _metadata(data)
    kind = metadata.get("kind")
    if kind == "error":
        raise Rank0DataPathError(f"rank 0 reported: {metadata.get('message', '')}")
    if kind not in _KINDS:
        raise ValueError(f"decode_message: unknown message kind {kind!r}")
    header = json.loads(metadata["header"])
    if kind != "minibatch":
        return _KINDS[kind](**header)
    tensors = safetensors_load(data)
    scalars = header.pop("samples")
    columns = {name: _split(tensors, name, len(scalars)) for name in (*_INT_LIST_FIELDS, *_FLOAT_LIST_FIELDS)}
    for name in _BOOL_LIST_FIELDS:
        columns[name] = [None if flags is None else [bool(f) for f in flags]
                         for flags in _split(tensors, name, len(scalars))]
    for scalar in scalars:  # JSON has no tuples nor dataclasses
        if scalar.get("token_versions") is not None:
            scalar["token_versions"] = [(int(v), int(n)) for v, n in scalar["token_versions"]]
        if scalar.get("judge_usage") is not None:
            scalar["judge_usage"] = JudgeUsage(**scalar["judge_usage"])
    samples = [Sample(**scalar, **{name: column[i] for name, column in columns.items()})
               for i, scalar in enumerate(scalars)]
    return Minibatch(samples=samples, **header)


def _metadata(data: bytes) -> dict[str, str]:
    """The __metadata__ of safetensors bytes: an 8-byte little-endian header size, then JSON."""
    if len(data) < 8:
        raise ValueError(f"decode_message: {len(data)} bytes is not a safetensors message")
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return header.get("__metadata__", {})


def payload_nbytes(message: Message) -> int:
    """Bytes of a message's token and per-token values at 8 bytes each: the part of a message
    that grows with the batch, counted the same way on both paths (metrics data/*_bytes)."""
    if not isinstance(message, Minibatch):
        return 0
    total = 0
    for s in message.samples:
        total += len(s.input_token_ids) + len(s.output_token_ids) + len(s.output_mask or ())
        total += sum(len(getattr(s, name) or ()) for name in _FLOAT_LIST_FIELDS)
    return 8 * total


# ---------------------------------------------------------------------------------------------
# The two paths
# ---------------------------------------------------------------------------------------------


class BatcherClient(Protocol):
    """What the data paths need from the batcher (RayBatcherClient; tests pass stand-ins)."""

    def submit_prompts(self, rank: int, step: int, samples: list[Sample], round_index: int) -> None: ...

    def submit_prompts_of_ranks(self, step: int, per_rank: list[list[Sample]], round_index: int) -> None: ...

    def next_message(self, rank: int, step: int, timeout_s: float) -> Message: ...

    def next_round(self, step: int, index: int, timeout_s: float) -> list[Message]: ...

    def ack_round(self, step: int, index: int) -> None: ...


class RayBatcherClient:
    """BatcherClient over the ExperienceBatcher actor. Ray is imported here, not at the top:
    the process-group half of this module runs where Ray is not installed (the GPU tier)."""

    def __init__(self, batcher: Any) -> None:
        import ray

        self.actor = batcher
        self._ray = ray

    def submit_prompts(self, rank: int, step: int, samples: list[Sample], round_index: int) -> None:
        self._ray.get(self.actor.submit_prompts.remote(rank, step, samples, round_index))  # surfaces rejections

    def submit_prompts_of_ranks(self, step: int, per_rank: list[list[Sample]], round_index: int) -> None:
        """Every rank's prompts at once (rank 0's path), waited for together."""
        self._ray.get([self.actor.submit_prompts.remote(rank, step, samples, round_index)
                 for rank, samples in enumerate(per_rank)])

    def next_message(self, rank: int, step: int, timeout_s: float) -> Message:
        return self._ray.get(self.actor.next_message.remote(rank, step), timeout=timeout_s)

    def next_round(self, step: int, index: int, timeout_s: float) -> list[Message]:
        return self._ray.get(self.actor.next_round.remote(step, index), timeout=timeout_s)

    def ack_round(self, step: int, index: int) -> None:
        # Not waited for: Ray runs one caller's calls to an actor in submission order, so the ack
        # reaches the batcher before the next round's request does.
        self.actor.ack_round.remote(step, index)


@dataclass(slots=True)
class Received:
    """One message as a data path delivered it to this rank."""

    message: Message
    ray_bytes: int
    """payload_nbytes this rank's process received over Ray for it (all ranks' on rank 0 in rank0)."""
    scatter_bytes: int
    """payload_nbytes that reached this rank through the process group (0 on per_rank, and on rank 0)."""


class PerRankDataPath:
    """Every rank talks to the batcher itself."""

    def __init__(self, client: BatcherClient, prompts: Sequence[Sample], dist: DistInfo) -> None:
        self._client, self._prompts, self._rank = client, prompts, dist.rank

    def submit_prompts(self, step: int, indices: list[int], round_index: int = 0) -> None:
        self._client.submit_prompts(self._rank, step, [self._prompts[i] for i in indices], round_index)

    def next_message(self, step: int, timeout_s: float) -> Received:
        message = self._client.next_message(self._rank, step, timeout_s)
        return Received(message=message, ray_bytes=payload_nbytes(message), scatter_bytes=0)


class Rank0DataPath:
    """Rank 0 talks to the batcher for every rank; the others receive through the process group.

    Every method is collective: all ranks call it in the same order (the trainer does: prompt
    submissions at the same points of the loop, and one next_message per message).
    """

    def __init__(self, client: BatcherClient | None, prompts: Sequence[Sample], dist: DistInfo) -> None:
        if dist.is_main and client is None:
            raise ValueError("Rank0DataPath: rank 0 needs the batcher client")
        self._client, self._prompts, self._dist = client, prompts, dist
        self._round: dict[int, int] = {}
        """step -> index of the next round to read (rank 0)."""

    def submit_prompts(self, step: int, indices: list[int], round_index: int = 0) -> None:
        """All-gather every rank's drawn indices (equal counts on every rank); rank 0 submits them."""
        dist = self._dist
        mine = torch.tensor(indices, dtype=torch.int64, device=dist.device)
        gathered = [torch.empty_like(mine) for _ in range(dist.world_size)]
        self._collective(step, "the prompt indices", lambda: torch_dist.all_gather(gathered, mine, async_op=True))
        if dist.rank != 0:
            return
        self._client.submit_prompts_of_ranks(step, [[self._prompts[i] for i in part.tolist()] for part in gathered],
                                             round_index)

    def next_message(self, step: int, timeout_s: float) -> Received:
        if self._dist.is_main:
            return self._read_and_scatter(step, timeout_s)
        return self._receive(step)

    def _read_and_scatter(self, step: int, timeout_s: float) -> Received:
        index = self._round.get(step, 0)
        try:
            messages = self._client.next_round(step, index, timeout_s)
            if len(messages) != self._dist.world_size:
                raise RuntimeError(f"batcher round {index} of step {step} has {len(messages)} messages for "
                                   f"{self._dist.world_size} ranks")
            self._client.ack_round(step, index)  # phase 1 done: rank 0 holds the whole set
        except BaseException as error:
            self._scatter([encode_message(error)] * self._dist.world_size, step)
            raise
        self._round[step] = index + 1
        if isinstance(messages[0], EndOfStep):
            self._round.pop(step, None)
        encoded = [encode_message(m) for m in messages]
        self._scatter(encoded, step)  # phase 2: every rank starts only once its share arrived
        return Received(message=messages[0], ray_bytes=sum(payload_nbytes(m) for m in messages), scatter_bytes=0)

    def _scatter(self, encoded: list[bytes], step: int) -> None:
        dist = self._dist
        sizes = torch.tensor([len(e) for e in encoded], dtype=torch.int64, device=dist.device)
        self._collective(step, "the message sizes", lambda: torch_dist.broadcast(sizes, src=0, async_op=True))
        width = int(sizes.max())
        chunks = [torch.zeros(width, dtype=torch.uint8) for _ in encoded]
        for chunk, data in zip(chunks, encoded):
            chunk[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        chunks = [c.to(dist.device) for c in chunks]
        out = torch.empty(width, dtype=torch.uint8, device=dist.device)
        self._collective(step, "the messages", lambda: torch_dist.scatter(out, chunks, src=0, async_op=True))

    def _receive(self, step: int) -> Received:
        dist = self._dist
        sizes = torch.empty(dist.world_size, dtype=torch.int64, device=dist.device)
        self._collective(step, "the message sizes", lambda: torch_dist.broadcast(sizes, src=0, async_op=True))
        width = int(sizes.max())
        out = torch.empty(width, dtype=torch.uint8, device=dist.device)
        self._collective(step, "its message", lambda: torch_dist.scatter(out, None, src=0, async_op=True))
        data = out[:int(sizes[dist.rank])].cpu().numpy().tobytes()
        message = decode_message(data)
        return Received(message=message, ray_bytes=0, scatter_bytes=payload_nbytes(message))

    def _deadline_s(self) -> float:
        return self._dist.timeout_s * _DEADLINE_FRACTION

    def _collective(self, step: int, what: str, issue: Callable[[], torch_dist.Work]) -> None:
        """Issue one asynchronous collective and wait for it at most _deadline_s.

        wait(timeout) blocks this thread on both backends (on NCCL until the GPU finished it,
        so the host may read the result), and raises when the peer's connection closed (gloo)
        or the deadline passed (both); a False return is taken as a timeout too.
        """
        started = time.monotonic()
        deadline_s = self._deadline_s()
        try:
            work = issue()
            completed = work.wait(timeout=timedelta(seconds=deadline_s))
        except Exception as error:  # gloo/NCCL errors when a peer died or the deadline passed
            raise self._error(step, what, started, deadline_s, f"{type(error).__name__}: {error}") from error
        if completed is False:
            raise self._error(step, what, started, deadline_s, "not completed by the deadline")

    def _error(self, step: int, what: str, started: float, deadline_s: float, cause: str) -> Rank0DataPathError:
        return Rank0DataPathError(
            f"rank {self._dist.rank}: data_path rank0 failed to exchange {what} for step {step} after "
            f"{time.monotonic() - started:.1f} s (deadline {deadline_s:.1f} s; {cause}); rank 0 died or stopped, "
            "see its log")


def make_data_path(kind: str, batcher: Any | None, prompts: Sequence[Sample],
                   dist: DistInfo) -> PerRankDataPath | Rank0DataPath:
    """The trainer's data path: `per_rank` or `rank0` (TrainerConfig.data_path)."""
    client = RayBatcherClient(batcher) if batcher is not None else None
    if kind == "per_rank":
        if client is None:
            raise ValueError("data_path per_rank: every rank needs the batcher")
        return PerRankDataPath(client, prompts, dist)
    if kind == "rank0":
        return Rank0DataPath(client, prompts, dist)
    raise ValueError(f"unknown data_path {kind!r}; known: per_rank, rank0")
