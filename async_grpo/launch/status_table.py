"""The operator's table of workers (`python worker_dispatcher.py status`): one line per worker
with its kind, node, GPUs, lifecycle state, weight version, uptime, load and health.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from async_grpo.launch.node_resources import NODE_ID_CHARS


def format_status(rows: Sequence[Any]) -> str:
    """Operator table: one line per worker."""
    header = ("kind", "name", "node", "gpus", "state", "version", "uptime", "load", "in-flight", "served", "failed",
              "health")
    lines = [header]
    for r in rows:
        health = "ok" if r.healthy else f"UNHEALTHY {r.last_error}".strip()
        lines.append((
            r.kind, r.name, r.node_id[:NODE_ID_CHARS], r.gpu_ids or "-", r.state or "?", str(r.weight_version),
            _duration(r.uptime_s),
            str(r.inflight_cost), str(r.inflight_requests), str(r.requests_served), str(r.requests_failed), health,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]]).rstrip() for line in lines)


def _duration(seconds: float) -> str:
    """Uptime as the table shows it: 45s, 12m, 3h05m."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
