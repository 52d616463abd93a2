"""run_inputs.wait_for_judges: a run whose reward names the judge waits for a live judge worker
and fails in one line, saying how to start one, when none comes (Ray's lookups stood in for)."""

from __future__ import annotations

import types

import pytest

from async_grpo.trainer import run_inputs


class _Registry:
    def __init__(self, answers: list[list[str]]) -> None:
        self.live_workers = types.SimpleNamespace(remote=lambda: answers.pop(0))


def test_no_judge_registry_fails_in_one_line_naming_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, namespace: str) -> None:
        raise ValueError(f"Failed to look up actor {name}")

    monkeypatch.setattr(run_inputs.ray, "get_actor", missing)
    with pytest.raises(RuntimeError) as error:
        run_inputs.wait_for_judges(timeout_s=0.0, poll_s=0.0)
    message = str(error.value)
    assert "\n" not in message and "judge-registry has no live worker" in message
    assert "--mode judge" in message and "--judge_workers" in message


def test_the_wait_ends_when_a_judge_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _Registry([[], [], ["judge-worker-0"]])
    looked_up: list[str] = []

    def get_actor(name: str, namespace: str) -> _Registry:
        looked_up.append(name)
        return registry

    monkeypatch.setattr(run_inputs.ray, "get_actor", get_actor)
    monkeypatch.setattr(run_inputs.ray, "get", lambda value: value)
    assert run_inputs.wait_for_judges(timeout_s=60.0, poll_s=0.0) == ["judge-worker-0"]
    assert looked_up == ["judge-registry"] * 3
