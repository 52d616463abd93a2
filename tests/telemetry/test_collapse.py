"""The collapse warning (async_grpo/telemetry/collapse.py) on scripted metric streams: one shaped
like the tool demo's seed 3 (learns, the first token becomes deterministic, the reward falls) warns
once per sign; one shaped like the main demo (learns and stays, its first-token entropy falling as
it does) and one that never learns do not (issue 38, item 3)."""

from __future__ import annotations

import logging

import pytest

from async_grpo.telemetry.collapse import CollapseConfig, CollapseWatch

LOGGER = "async_grpo.telemetry.collapse"


def _stream(rewards: list[float], entropies: list[float]) -> list[dict[str, float]]:
    return [{"reward/mean": r, "entropy/first_token": e} for r, e in zip(rewards, entropies, strict=True)]


def _run(records: list[dict[str, float]], config: CollapseConfig = CollapseConfig()) -> list[dict[str, float]]:
    watch = CollapseWatch(config)
    return [watch.observe(step, record) for step, record in enumerate(records)]


# The tool demo, seed 3 (issue 38's table, steps between the measured ones filled in): 0.08 at step
# 0, ~0.8 by step 3, then swinging and falling to ~0.2-0.5 while the first token's entropy sits at
# 0.002 from step 10 on.
SEED3_REWARDS = [0.08, 0.4, 0.7, 0.91, 0.8, 0.73, 0.6, 0.3, 0.13, 0.4, 0.62, 0.7, 0.75, 0.8, 0.77, 0.77, 0.6, 0.5,
                 0.45, 0.42, 0.41, 0.2, 0.14, 0.18, 0.22, 0.2, 0.3, 0.35, 0.4, 0.5]
SEED3_ENTROPY = [2.19, 1.0, 0.6, 0.37, 0.1, 0.02, 0.01, 0.008, 0.005, 0.004, 0.003, 0.003, 0.002, 0.002, 0.002,
                 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002, 0.002,
                 0.002]
# The main demo: the answer digit is the first token, so its entropy falls as the reward climbs to
# ~0.97 and stays there (sampling noise of a few hundredths).
DEMO_REWARDS = [min(0.97, 0.05 + 0.01 * s) + (0.02 if s % 3 == 0 else -0.02 if s % 3 == 1 else 0.0)
                for s in range(200)]
DEMO_ENTROPY = [max(0.001, 2.0 - 0.02 * s) for s in range(200)]


def test_the_tool_demos_seed_3_warns_once_for_each_sign(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        metrics = _run(_stream(SEED3_REWARDS, SEED3_ENTROPY))
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 2, warnings
    drop, entropy = warnings  # the mean has fallen 0.15 below its best by step 23, before 5 low steps below it
    assert drop.startswith("step 23: the 10-step mean reward (0.444) has fallen 0.194 below its best (0.638)")
    assert entropy.startswith("step 25: first-token entropy 0.002 has stayed below 0.01 for 5 steps")
    assert metrics[-1]["counts/collapse_warnings"] == 2.0
    # Best 10-step mean: steps 10-19 (0.638), by hand below; the last: steps 20-29 (0.290).
    best = max(sum(SEED3_REWARDS[i:i + 10]) / 10 for i in range(len(SEED3_REWARDS) - 9))
    assert best == pytest.approx(sum(SEED3_REWARDS[10:20]) / 10) == pytest.approx(0.638)
    assert metrics[-1]["collapse/reward_below_best"] == pytest.approx(best - sum(SEED3_REWARDS[20:30]) / 10)


def test_a_run_that_learns_and_stays_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        metrics = _run(_stream(DEMO_REWARDS, DEMO_ENTROPY))
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert max(m["collapse/reward_below_best"] for m in metrics) < 0.05
    assert metrics[-1]["counts/collapse_warnings"] == 0.0


def test_a_run_that_never_learns_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    flat = [0.05 + (0.01 if s % 2 else 0.0) for s in range(100)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(_stream(flat, [2.0] * 100))
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_no_metrics_before_a_full_window_and_none_when_off() -> None:
    metrics = _run(_stream([0.5] * 3, [1.0] * 3))
    assert all(m == {"collapse/reward_below_best": 0.0, "counts/collapse_warnings": 0.0} for m in metrics)
    assert _run(_stream(SEED3_REWARDS, SEED3_ENTROPY), CollapseConfig(enabled=False)) == [{}] * len(SEED3_REWARDS)


@pytest.mark.parametrize("field, value", [("entropy_floor", 0.0), ("entropy_steps", 0), ("reward_drop", 1.5),
                                          ("best_margin", -0.1), ("window", 0)])
def test_bad_thresholds_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"CollapseConfig.{field}"):
        CollapseConfig(**{field: value})


def test_the_metrics_logger_writes_the_collapse_metrics(tmp_path) -> None:
    import json

    from async_grpo.telemetry.metrics import MetricsLogger

    sink = MetricsLogger(tmp_path, tensorboard=False, progress_total=len(SEED3_REWARDS), progress_bar=False,
                         report=None, collapse=CollapseConfig())
    base = {"reward/accuracy": 0.0, "loss/kl": 0.0, "response/length_mean": 1.0, "timing/step_s": 1.0}
    for step, record in enumerate(_stream(SEED3_REWARDS, SEED3_ENTROPY)):
        sink.log(step, {**base, **record})
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["counts/collapse_warnings"] == 2.0 and lines[-1]["collapse/reward_below_best"] > 0.3
