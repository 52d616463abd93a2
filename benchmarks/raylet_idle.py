"""The raylet's memory with nothing running: does it grow with time alone, under which settings?

    .venv/bin/python -m benchmarks.raylet_idle --duration_s 900
    .venv/bin/python -m benchmarks.raylet_idle --duration_s 900 --system_config '{"event_stats": false}'

Starts a private Ray head as async_grpo.launch.ray_cluster.init_local_ray does (loopback only, dashboard, metrics
and task events off) with the extra `_system_config` entries given as JSON, creates one idle
actor, and prints the raylet's anonymous RSS (`RssAnon` in /proc/<pid>/status) every
`--every_s` seconds, then `raylet_idle: start_mb=<> end_mb=<> growth=<end/start>`. Issue 11's
soak found the raylet growing ~1-1.5 MB per 300-step run whatever the workload settings; this
separates time from work.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from async_grpo.launch.ray_env import actor_runtime_env, use_loopback_only_ray
from benchmarks.harness import apply_smoke, load_bench_config

SMOKE = {"duration_s": 5.0, "every_s": 1.0}
"""Sizes of the smoke mode."""


@dataclass(kw_only=True, frozen=True)
class RayletIdleConfig:
    """Command line of `python -m benchmarks.raylet_idle`."""

    duration_s: float = 900.0
    """How long to watch."""
    every_s: float = 60.0
    """Seconds between readings."""
    system_config: str = "{}"
    """Extra Ray `_system_config` entries, as JSON (on top of init_local_ray's)."""
    smoke: bool = False
    """Smoke mode: 5 s, a reading every second (SMOKE); checks that the command still runs, its figures mean
    nothing."""


def raylet_pid(socket_name: str) -> int:
    """The raylet process started with this raylet socket (one head per probe)."""
    flag = f"--raylet_socket_name={socket_name}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"/raylet") and flag in argv:
            return int(entry.name)
    raise RuntimeError(f"no raylet process with {flag.decode()}")


def rss_anon_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def main(argv: list[str] | None = None) -> int:
    import ray

    config = load_bench_config(RayletIdleConfig, argv, description=__doc__)

    config = apply_smoke(config, SMOKE)
    extra = json.loads(config.system_config)
    use_loopback_only_ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", namespace="raylet-idle",
             runtime_env=actor_runtime_env(), log_to_driver=False,
             _system_config={"enable_metrics_collection": False, "task_events_report_interval_ms": 0, **extra})

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> int:
            return 1

    idle = Idle.remote()
    ray.get(idle.ping.remote())
    pid = raylet_pid(ray.nodes()[0]["RayletSocketName"])
    started = time.monotonic()
    readings = []
    while True:
        elapsed = time.monotonic() - started
        readings.append(rss_anon_mb(pid))
        print(f"{elapsed:6.0f} s  raylet RssAnon {readings[-1]:.2f} MB", flush=True)
        if elapsed >= config.duration_s:
            break
        time.sleep(min(config.every_s, config.duration_s - elapsed + 0.01))
    print(f"raylet_idle: system_config={json.dumps(extra)} start_mb={readings[0]:.2f} end_mb={readings[-1]:.2f} "
          f"growth={readings[-1] / readings[0]:.3f} over {config.duration_s:.0f} s")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
