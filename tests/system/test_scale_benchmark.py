"""System-level: `python -m benchmarks.scale --smoke true` runs end to end (its own two-node loopback Ray
cluster, stand-in workers, the real registry and batcher) and reports its figures.

    .venv/bin/python -m pytest tests/system/test_scale_benchmark.py -q

The script checks what it measures as it goes (every request got its own answer, the batcher
delivered every sample), so a routing fault fails it here. No figure is compared with a threshold.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.paths import REPO_ROOT

# The smoke run takes ~50 s on an idle 2-core machine; a busy one may take several times that.
_SMOKE_BOUND_S = 900
_FIGURES = ("routed_per_s", "routed_ratio", "registry_cpu_us", "routing_cpu_us", "batcher_samples_per_s",
            "baseline_batcher_samples_per_s")


@pytest.mark.system
def test_scale_benchmark_smoke_mode_reports_every_figure() -> None:
    result = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--smoke", "true"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=_SMOKE_BOUND_S)
    assert result.returncode == 0, f"scale.py --smoke failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("scale: N=4:"), last
    figures = dict(pair.split("=") for pair in last.split(":", 2)[2].split(","))
    assert sorted(figures) == sorted(_FIGURES)
    # routing_cpu_us is the registry's CPU less its idle rate: a few hundred requests may not rise above it.
    assert all(float(value) > 0 for name, value in figures.items() if name != "routing_cpu_us"), figures
    assert float(figures["routing_cpu_us"]) >= 0, figures
