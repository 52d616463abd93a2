"""Benchmarks: each script runs from the repository root as `python -m benchmarks.NAME` (`--help`
for its options, `--smoke true` for a few steps at tiny sizes); RESULTS.md holds every recorded run.

Shared modules (no `__main__` entry; scripts import these, never each other):
- harness.py: logging set-up, the smoke mode, the summary line, the demo's assets and trainer
  flags, one trainer run on a local cluster with its metrics;
- process_monitor.py: peak memory of every process in a run's tree, log events, run_polled;
- packed_samples.py: packed minibatches of realistic lengths and their training FLOPs;
- realistic_parts.py, soak_parts.py: those scripts' pure parts (config, data, sizing, comparisons);
- ab_parts.py: the demo with settings A against settings B (demo_ab.py and its presets);
- cpu_profile.py: a run's CPU seconds and page faults per process kind (the runner's CPU profile).
"""
