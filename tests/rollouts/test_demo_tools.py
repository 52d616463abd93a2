"""The tool demo's parts: the warm-up data is exactly what ToolEnvironment runs, and the report's figures.

    .venv/bin/python -m pytest tests/rollouts/test_demo_tools.py -q

The demo itself (scripts/demo_tools.sh) is a cluster run; tests/system/test_demo_tools_smoke.py runs
it for a few steps.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from support.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import demo_tools_report  # noqa: E402
import prepare_tool_demo  # noqa: E402

from async_grpo.demo_assets.tiny_model import build_tiny_tokenizer  # noqa: E402
from async_grpo.rollouts.environments import EnvPrompt, Turn  # noqa: E402
from async_grpo.rollouts.tool_environment import ToolEnvironment  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_a_tool_episode_is_what_the_environment_answers_and_masks_its_observation(tokenizer) -> None:
    episode = prepare_tool_demo.tool_episode(tokenizer, 347, 285)
    out, mask = episode.output_token_ids, episode.output_mask
    first_obs = mask.index(False)
    after_obs = first_obs + mask[first_obs:].index(True)
    call, observation, answer = out[:first_obs], out[first_obs:after_obs], out[after_obs:]
    assert tokenizer.decode(episode.input_token_ids) == "347+285="
    assert call[-1] == answer[-1] == tokenizer.eos_token_id
    # The environment, given the call as the model would write it, answers with exactly these tokens.
    env = ToolEnvironment(tools=["calculator"], format="text")
    env.reset(EnvPrompt(record={"prompt": "347+285="}, gt_answer="632", prompt_token_ids=episode.input_token_ids))
    result = env.step(Turn(index=0, token_ids=call, text=tokenizer.decode(call[:-1]), finish_reason="stop"))
    assert tokenizer.encode(result.text, add_special_tokens=False) == observation
    assert tokenizer.decode(answer[:-1]) == "632" and env.step(Turn(1, answer, "632", "stop")).reward == 1.0
    assert all(mask[:first_obs]) and not any(observation and mask[first_obs:after_obs]) and all(mask[after_obs:])
    assert prepare_tool_demo.tool_episode(tokenizer, 347, 285, train_choice=False).output_mask[0] is False


def test_the_warm_up_trains_the_choice_to_call_at_the_configured_rate(tokenizer) -> None:
    args = prepare_tool_demo.PrepareToolDemoConfig(out_dir="unused", tool_fraction=0.1, episode_fraction=0.5,
                                                   warmup_batch_size=4000)
    batch = prepare_tool_demo.warmup_batch(tokenizer, args, random.Random(0))
    open_tag = tokenizer.convert_tokens_to_ids("<")
    trained_first = [s.output_token_ids[0] for s in batch if s.output_mask is None or s.output_mask[0]]
    episodes = sum(1 for s in batch if s.output_mask is not None)
    rate = sum(1 for t in trained_first if t == open_tag) / len(trained_first)
    assert abs(episodes / len(batch) - 0.5) < 0.03
    assert abs(rate - 0.1 / 0.6) < 0.03  # tool_fraction / (1 - episode_fraction + tool_fraction)
    guesses = [s for s in batch if s.output_mask is None]
    assert all(200 <= int(tokenizer.decode(s.output_token_ids[:-1])) <= 998 for s in guesses)


@pytest.mark.parametrize("fields", [{"tool_fraction": 0.0}, {"tool_fraction": 0.6, "episode_fraction": 0.5},
                                    {"warmup_steps": 0}, {"warmup_lr": 0.0}])
def test_the_prepare_config_names_a_bad_field(fields: dict) -> None:
    with pytest.raises(ValueError, match="PrepareToolDemoConfig"):
        prepare_tool_demo.PrepareToolDemoConfig(out_dir="x", **fields)


def _write_run(run_dir: Path, rewards: list[float], tool_rates: list[float], step_s: float, started: float) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "command_started_at").write_text(str(started))
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step, (reward, rate) in enumerate(zip(rewards, tool_rates)):
            f.write(json.dumps({"step": step, "reward/mean": reward, "multi_turn/observed_frac": rate, "counts/samples": 64,
                                "time_s": step * step_s, "unix_time": started + 60 + step * step_s}) + "\n")
    return run_dir


def test_the_report_computes_rise_budget_and_tool_gain_by_hand(tmp_path: Path) -> None:
    # 30 steps of 30 s after a 60 s start: step i ends at minute 1 + i/2. Reward 0.1 for the first 10
    # steps, then 0.7: the 10-step mean at step i >= 9 is 0.1 + 0.06 (i - 9); the start is step 0, 0.1.
    rewards = [0.1] * 10 + [0.7] * 20
    with_run = _write_run(tmp_path / "with", rewards, [0.2] * 10 + [0.9] * 20, 30.0, 1000.0)
    without = _write_run(tmp_path / "without", [0.0] * 29 + [0.2], [0.2] * 30, 30.0, 1000.0)
    run = demo_tools_report.summarize(with_run, target_rise=0.33, budget_min=10.0)
    assert run.start_reward == pytest.approx(0.1) and run.final_mean == pytest.approx(0.7)
    assert run.rise_at_min == pytest.approx(1 + 15 / 2)  # rise 0.36 at step 15, 0.30 at step 14
    # Within 10 minutes: steps up to 18, whose mean is 0.1 + 0.06 * 9.
    assert run.best_in_budget == pytest.approx(0.64) and run.rise == pytest.approx(0.54)
    assert run.tool_rate[9] == pytest.approx(0.2) and run.tool_rate[-1] == pytest.approx(0.9)
    short = demo_tools_report.summarize(with_run, target_rise=0.33, budget_min=8.0)  # up to step 14
    assert short.rise_at_min is None and short.best_in_budget == pytest.approx(0.4)
    base = demo_tools_report.summarize(without, target_rise=0.33, budget_min=10.0)
    assert base.final_mean == pytest.approx(0.02)
    line = demo_tools_report.tool_gain([run], [base])
    assert line.startswith("tool_gain=35.0 ") and "+0.680" in line
    zero = demo_tools_report.summarize(_write_run(tmp_path / "zero", [0.0] * 12, [0.0] * 12, 30.0, 1000.0), 0.3, 10.0)
    # No correct answer in the last 10 steps' 640 rollouts: the rate is below 3/640 at 95%.
    assert demo_tools_report.tool_gain([run], [zero]).startswith("tool_gain=inf ")
    assert f">= {0.7 * 640 / 3:.0f} at 95% confidence: no correct answer in 640 rollouts" in (
        demo_tools_report.tool_gain([run], [zero]))


def test_the_report_refuses_a_run_shorter_than_its_window(tmp_path: Path) -> None:
    short = _write_run(tmp_path / "short", [0.5] * 5, [0.0] * 5, 30.0, 1000.0)
    with pytest.raises(ValueError, match="fewer than the 10-step window"):
        demo_tools_report.summarize(short, 0.3, 10.0)


def test_the_report_prints_the_final_beside_the_best_and_flags_a_fall(tmp_path: Path) -> None:
    """Rewards 0.1 for 10 steps, 0.8 for 10, then 0.4 for 10 (by hand: best 10-step mean 0.8 at
    step 19, final 0.4: ended 0.40 below its best); a run that stays at 0.8 is not flagged."""
    fell = _write_run(tmp_path / "fell", [0.1] * 10 + [0.8] * 10 + [0.4] * 10, [0.5] * 30, 30.0, 1000.0)
    stayed = _write_run(tmp_path / "stayed", [0.1] * 10 + [0.8] * 20, [0.5] * 30, 30.0, 1000.0)
    run = demo_tools_report.summarize(fell, target_rise=0.3, budget_min=60.0)
    assert (run.best_mean, run.best_step, run.final_mean) == (pytest.approx(0.8), 19, pytest.approx(0.4))
    line = demo_tools_report.run_line(run, 0.3, 60.0)
    assert "final 0.400 (best 0.800 at step 19) (ENDED 0.40 BELOW ITS BEST)" in line
    kept = demo_tools_report.run_line(demo_tools_report.summarize(stayed, 0.3, 60.0), 0.3, 60.0)
    assert "final 0.800 (best 0.800 at step 19)," in kept and "BELOW" not in kept
    table = demo_tools_report.markdown([run], [], 0.3, 60.0, "tool_gain=-")
    assert "| 0.400 (ENDED 0.40 BELOW ITS BEST) | 0.800 (19) |" in table
