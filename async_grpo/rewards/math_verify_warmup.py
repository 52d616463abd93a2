"""Warms math-verify once in the verifier pool's forkserver, so that every process forked from it
starts warm.

math_verify_pool.VerifierPool lists this module last in its forkserver preload
(math_verify_process.FORKSERVER_PRELOAD). Importing it parses and verifies one answer: the first
verification in a fresh interpreter builds math-verify's LaTeX parser and sympy's caches (~0.18 s
on a quiet 2-core machine, measured), the ones after it take ~0.01 s, and a child forked from a
warmed process ~0.03 s. Without it every replacement process (after a timeout or a crash) paid
the 0.18 s before serving again. Importing it anywhere else only costs that one verification.
"""

from __future__ import annotations

import logging

from async_grpo.rewards.math_verifier import verify_with_math_verify

# The "timeout is disabled" warning is expected: the pool enforces the deadline.
logging.getLogger("math_verify").setLevel(logging.ERROR)
verify_with_math_verify("1", "1")
