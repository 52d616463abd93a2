"""The old name of shaping.py, kept while telemetry/metrics.py imports counts_as_solved from here."""

from async_grpo.rewards.shaping import counts_as_solved  # noqa: F401
