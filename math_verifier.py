"""Rewards from math-verify under a hard per-sample deadline, in worker processes that can be killed.

math-verify enforces its timeouts with `signal.alarm`, which raises outside the main thread and
cannot interrupt long C-level work: an exponent tower such as `\\boxed{5^{5^{5^{5^5}}}}` or a
megabyte of LaTeX can hang a verifier for minutes. So each verification here runs in the main
thread of a worker process of its own. One dispatcher thread per process sends it one task at a
time as JSON over a pipe and waits at most `timeout_s`; a process that overruns is killed, its
sample scores 0 with error "timeout", and a replacement process is started. A hostile output thus
costs one deadline and one process restart, never a stalled pool.

Processes come from multiprocessing's forkserver: a fresh single-threaded interpreter (started
like a spawn child, so forking from it is safe even when the pool lives in a threaded Ray actor or
beside vLLM) that has sympy and math-verify imported already. A replacement is then ready in
~0.2 s instead of the ~1.2 s a spawn child spends importing them (measured on this 2-core
machine), which is most of what a timeout costs beyond its deadline.

Before a completion reaches a process, the pool answers two kinds of input itself, in the
caller's thread (`quick_verdict`, the same rules in `score_completion`; ~0.1-0.3 ms for a
4k-character completion, ~7 ms at the 131k-character cap):
    - pre-checks (AnswerLimits): a completion longer than `max_completion_chars`, a boxed
      answer longer than `max_answer_chars`, brackets nested deeper than `max_nesting_depth`,
      an exponent tower higher than `max_exponent_tower` (`5^{5^{5^5}}`, `2**3**4**5`) or a
      numeric power of more than `max_power_digits` digits (`9^{9^{9}}`) is rejected: reward 0,
      failed, error "rejected: <measure> exceeds <cap>". These shapes hang math-verify
      (measured: 20 nested parentheses ~4 s, 20 nested braces over 15 s, a tower or a huge
      power indefinitely), and rejected they cost neither a deadline nor a process restart.
      A 20k-character `$x...x$` span (6.8 s) still passes: the deadline is for such shapes;
    - the plain-number fast path: when the extracted answer and the gold answer are both plain
      numerals ("-12", "3.50": no sign other than a leading minus, no leading zeros, at most
      15 digits and 6 decimals, where math-verify's comparison is exact), they are compared
      as exact decimals, which is math-verify's verdict on them (tested against it).
Everything else goes to math-verify in a process under the deadline, which stays the backstop
for hostile shapes the pre-checks do not know.

    pool = VerifierPool()  # one process per core (at least 2), 1 s deadline: VerifierPoolConfig
    results = await pool.score(["so the sum is \\boxed{7}", "8"], gt_answer="7")
    pool.close()

What a result means:
    reward 1.0, failed False, error ""   math_verify.verify(parse(gold), parse(completion)) is true
    reward 0.0, failed False, error ""   an answer was found and it does not match the gold
    reward 0.0, failed True,  error "timeout"            the deadline passed; the process was killed
    reward 0.0, failed True,  error "parse_error: ..."   no answer could be extracted from the
                                         completion (or from the gold answer, a dataset problem)
    reward 0.0, failed True,  error "verify_error: ..."  verify raised, or the process died
    reward 0.0, failed True,  error "rejected: ..."      a pre-check cap (the error names it)

An output without any extractable answer earns 0 like a wrong one, but is flagged (failed=True,
counted in stats()) so callers can tell "wrong" from "unscorable".

Which answer of a long completion counts (`score_completion`):
    1. With a complete \\boxed{...} (braces balanced), the content of the LAST one, and only it:
       "3. Let me check: 2+2=4. \\boxed{5}" answers 5, "\\boxed{3}, no: \\boxed{5}" answers 5,
       "\\boxed{\\frac{1}{2}}" answers 1/2. (math-verify alone would read every boxed answer
       of the text as one set {3, 5}, which matches neither 3 nor 5.) An empty last box is no answer.
    2. Without one, math-verify's own choice on the whole text: the rightmost answer-like
       expression ($...$ LaTeX, a fraction, an expression or a number: "so 12 apples, then 7
       more: 19" answers 19), except that an answer introduced by "final answer is" or within 50
       characters after the word "answer" outranks later unanchored ones: "The answer is 5 (I
       checked it with 2 methods)" answers 5, and so does "The answer is 5. Later: 3".

On a Ray cluster all generation workers share one pool actor, created by the first call to
`get_or_create_verifier_pool`; that first caller's `num_processes` (the seed's
--global_num_verifiers; None: from the cores, VerifierPoolConfig) and `timeout_s` size it, later
callers get the existing actor whatever they pass. Each process uses about one CPU core. Nodes
offer that capacity through the `verification_slot` custom resource
(`ray start --resources='{"verification_slot": 100}'`): the processes are then spread over those
nodes, one slot reserved per process (VerifierPoolActor).
Without it they all run in the pool actor's process, outside Ray's accounting, as is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import signal
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from decimal import Decimal
from functools import lru_cache
from multiprocessing.connection import Connection
from typing import Any, Mapping, Sequence

import reward_functions
from reward_functions import FunctionScore

logger = logging.getLogger(__name__)

# A new process warms math-verify's LaTeX parser (~0.2 s from the forkserver; the server's own
# first start imports sympy, a few seconds on a busy machine or in a Ray worker); past this it is broken.
_STARTUP_TIMEOUT_S = 120.0
# Seconds a closing pool waits for a process to exit after its pipe closes before killing it.
_SHUTDOWN_GRACE_S = 5.0
# Error strings come from exception messages that may quote a megabyte of input: keep them short.
_MAX_ERROR_CHARS = 300
# A reply is one small JSON object; anything larger means the process broke the protocol. A
# reward function's reply carries one score (with its named parts) per completion of its batch.
_MAX_REPLY_BYTES = 1 << 16
_MAX_FUNCTION_REPLY_BYTES = 1 << 22
# Characters of a completion quoted in a timeout log line.
_LOG_SNIPPET_CHARS = 80
# Distinct gold answers whose parse a process keeps: the n rollouts of a prompt share one gold.
_GOLD_CACHE_SIZE = 1024
# Completions longer than this are never cached: they are rarely repeated and would bloat the cache.
_MAX_CACHED_COMPLETION_CHARS = 1024
# Ray restarts the shared pool actor if its process dies (e.g. OOM), with its creation arguments,
# so the generation workers regain a verifier instead of failing every reward from then on.
_ACTOR_MAX_RESTARTS = -1
# The custom resource through which nodes offer verifier capacity, one slot per process:
# `ray start ... --resources='{"verification_slot": 100}'`.
VERIFICATION_SLOT = "verification_slot"
# How long the pool actor waits for its shards: each starts its processes (a few seconds, up to
# _STARTUP_TIMEOUT_S on a loaded node); far longer means their slots are held by someone else.
_SHARD_START_TIMEOUT_S = 2 * _STARTUP_TIMEOUT_S
# Imported once by the forkserver so that every process forked from it starts with them loaded,
# and warm (verifier_warmup verifies one answer: a replacement process then starts in ~0.03 s).
_FORKSERVER_PRELOAD = ["math_verifier", "math_verify", "sympy", "verifier_warmup"]
_READY_MESSAGE = b'{"ready": true}'
# What last_boxed() scans for: `\boxed{` (spaces allowed before the brace), an escaped brace
# (literal text in LaTeX, never a group), or a plain brace.
_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|\\[{}]|[{}]")
_BOXED_PREFIX = "\\boxed"
_TIMEOUT_ERROR = "timeout"
_PARSE_ERROR = "parse_error"
_VERIFY_ERROR = "verify_error"
_REJECTED_ERROR = "rejected"
# Brackets of every kind count toward the nesting depth: math-verify's LaTeX parser slows down
# with depth whichever kind nests (measured: 10 nested parentheses ~1.3 s, 12 nested fractions ~2 s).
_OPENERS = frozenset("({[")
_CLOSERS = frozenset(")}]")
_BRACKET = re.compile(r"[(){}\[\]]")
# Tokens of exponent_tower_height: a power operator, a bracket, a lone `*`, or a run of anything
# else (one token for a whole stretch of prose, so long texts cost few loop turns).
_TOWER_TOKEN = re.compile(r"\*\*|\^|[{}()\[\]]|\*|[^*^{}()\[\]]+")
# A run that is a single atom (a number, a name or a LaTeX command, whitespace around it): right
# after a power it is the whole exponent, and a power right after it stacks on it (2**3**4).
_ATOM = re.compile(r"\s*[A-Za-z0-9.\\]+\s*")
# A numeric power: an integer base, `^` or `**`, an integer exponent (bare or in braces, maybe
# negative: sympy computes 3^-N exactly too) that no further power follows (2**3**4 is 2**(3**4):
# the rightmost power of a chain folds first).
_NUMERIC_POWER = re.compile(r"(\d+)\s*(?:\^|\*\*)\s*(?:\{\s*(-?\d+)\s*\}|(-?\d+)(?!\d|\s*(?:\^|\*\*)))")
# Numeric powers up to this many digits are folded into their value, so an outer power sees its
# real exponent (9^{9^{9}} is 9^387420489); a larger inner power becomes _HUGE_EXPONENT, which
# makes any outer power with a base >= 2 far exceed every sensible max_power_digits.
_FOLD_DIGITS = 18
_HUGE_EXPONENT = str(10**_FOLD_DIGITS)
# A plain numeral: optional minus, no leading zeros, optional decimals. Within _MAX_PLAIN_DIGITS
# and _MAX_PLAIN_DECIMALS, math-verify's verdict on two of them is exact equality: integers are
# compared exactly, and a decimal becomes a float of 15 significant digits that it rounds to 6
# decimals before comparing (so 7.0000001 == 7 for math-verify: such inputs skip the fast path).
_PLAIN_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
_MAX_PLAIN_DIGITS = 15
_MAX_PLAIN_DECIMALS = 6
# Default pool size: one process per usable core, but never one (a lone process that is killed at
# the deadline stalls every other result for the deadline plus a restart), and at most 32 (each
# process holds ~57 MB RSS, ~27 MB PSS, with sympy loaded, measured; 32 verify ~10k samples/s at
# ~3 ms each).
_MIN_DEFAULT_PROCESSES = 2
_MAX_DEFAULT_PROCESSES = 32
# Default deadline per verification. benchmarks/reward.py --fast_path false on the 2-core machine
# (2 processes, 32 completions in flight, half of them ~4k-character reasoning texts, all through
# math-verify): clean p99 latency, queueing included, 24-29 ms on a quiet machine and up to 166 ms
# while other test suites ran (2026-11-24; 53-183 ms in earlier runs; RESULTS.md "Reward
# verification"). 1 s is >5x the worst of those, headroom for a machine shared with generation and
# training, while a hostile input that evades the pre-checks holds a process for 1 s, not 10.
DEFAULT_TIMEOUT_S = 1.0


@dataclass(slots=True)
class RewardResult:
    """The verifier's verdict on one completion."""

    reward: float
    """1.0 if the completion's answer matches the gold answer, else 0.0."""
    failed: bool
    """True when the completion could not be scored (timeout, parse or verify error, or a
    pre-check rejection); reward 0."""
    error: str
    """"" when scored; "timeout", "parse_error: <why>", "verify_error: <why>" or
    "rejected: <which pre-check cap>" when failed."""


@dataclass(kw_only=True, frozen=True)
class AnswerLimits:
    """Caps of the cheap pre-checks a completion passes before math-verify sees it.

    "The answer" is the content of the last complete \\boxed{} when there is one (all
    math-verify parses then), else the whole completion (math-verify searches all of it). A
    completion over a cap scores 0 with error "rejected: ..." and never reaches a process.
    """

    max_completion_chars: int = 131_072
    """Longest completion, in characters (~32k tokens at ~4 characters a token): longer texts are
    not real answers, and this bounds the scans below and what goes down a pipe."""
    max_answer_chars: int = 512
    """Longest boxed answer. math-verify's parse grows with it (a 1,000-character `1+1+...+1`
    took 0.4-2 s, 10,000 characters 4.4 s, measured on the 2-core machine)."""
    max_nesting_depth: int = 8
    """Deepest nesting of brackets ((, [, {, counted together) in the answer. Real answers nest
    2-4 deep (`\\left(\\frac{\\sqrt{3}}{2}, 1\\right)` is 3); math-verify slows steeply with depth
    (measured: 5 nested parentheses 0.3 s, 10 1.3 s, 20 4 s, 20 nested braces over 15 s)."""
    max_exponent_tower: int = 2
    """Highest exponent tower: `x^2` is 1, `2^{2^n}` 2, `5^{5^{5^5}}` and `2**3**4**5` 3. sympy
    evaluates numeric powers exactly, so a 3-level numeric tower has more digits than memory
    holds and hangs the verifier."""
    max_power_digits: int = 1_000_000
    """Most decimal digits of a numeric power (exponent x log10(base), inner powers folded first):
    `\\boxed{9^{9^{9}}}` (3.7e8 digits) hangs math-verify, `3^{1000000}` (477k digits) took 0.18 s
    (measured), `2^{2023}` is 609."""

    def __post_init__(self) -> None:
        for name in ("max_completion_chars", "max_answer_chars", "max_nesting_depth", "max_exponent_tower",
                     "max_power_digits"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AnswerLimits.{name} must be an int >= 1, got {value!r}")


DEFAULT_LIMITS = AnswerLimits()


def default_num_processes() -> int:
    """Verifier processes for this machine: its usable cores (the CPU affinity of this process,
    which container CPU sets narrow), at least _MIN_DEFAULT_PROCESSES, at most _MAX_DEFAULT_PROCESSES."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    return min(max(cores, _MIN_DEFAULT_PROCESSES), _MAX_DEFAULT_PROCESSES)


@dataclass(kw_only=True, frozen=True)
class VerifierPoolConfig:
    """How a VerifierPool is sized and what it lets through to math-verify."""

    num_processes: int | None = None
    """Worker processes (each verifies one completion at a time, ~one CPU core when busy). None:
    default_num_processes(), i.e. one per usable core of the machine the pool starts on, at least
    2 (one process killed at a deadline must not stall the rest) and at most 32."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Hard deadline per verification; a process past it is killed and replaced, the sample scores
    0 with error "timeout". Default 1 s: benchmarks/reward.py's clean p99 latency through
    math-verify on the 2-core machine, queueing included, was 24-166 ms (quiet to busy machine;
    RESULTS.md "Reward verification"), so 1 s leaves >5x headroom for a loaded machine while a
    hostile input that evades the pre-checks costs 1 s of a process, not 10."""
    cache_size: int = 65536
    """Entries of the (gold, completion) -> result LRU cache; 0 turns the cache and the
    within-call deduplication off."""
    limits: AnswerLimits = DEFAULT_LIMITS
    """Caps of the pre-checks run before math-verify (AnswerLimits)."""
    fast_path: bool = True
    """Decide plain-number answers against plain-number golds without math-verify (same verdict,
    no process). False sends them to math-verify too: for measuring math-verify itself."""

    def __post_init__(self) -> None:
        if self.num_processes is not None and (not isinstance(self.num_processes, int) or self.num_processes < 1):
            raise ValueError(f"VerifierPoolConfig.num_processes must be an int >= 1 or None, got {self.num_processes!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"VerifierPoolConfig.timeout_s must be a finite number > 0, got {timeout!r}")
        if not isinstance(self.cache_size, int) or self.cache_size < 0:
            raise ValueError(f"VerifierPoolConfig.cache_size must be an int >= 0, got {self.cache_size!r}")
        if not isinstance(self.limits, AnswerLimits):
            raise ValueError(f"VerifierPoolConfig.limits must be an AnswerLimits, got {type(self.limits).__name__}")


class WorkerStartError(RuntimeError):
    """A verifier process did not come up (crashed while importing math-verify, or too slow)."""


def _truncate(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _failure(kind: str, detail: str = "") -> RewardResult:
    error = f"{kind}: {_truncate(detail)}" if detail else kind
    return RewardResult(reward=0.0, failed=True, error=error)


@lru_cache(maxsize=_GOLD_CACHE_SIZE)
def _parse_gold(gold: str) -> list[Any]:
    """Parse a gold answer given as "7", "$7$", "\\boxed{7}" or bare LaTeX such as "\\frac{1}{2}".

    math-verify extracts LaTeX only inside $...$ or \\boxed{}, so bare gold answers are wrapped in
    $...$ (which also reads "\\sqrt{2}" and "(1,2)" right); plain parsing is the fallback.
    """
    from math_verify import parse

    if "$" not in gold and "\\boxed" not in gold:
        wrapped = parse(f"${gold}$", parsing_timeout=None, raise_on_error=True)
        if wrapped:
            return wrapped
    return parse(gold, parsing_timeout=None, raise_on_error=True)


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` in text (the one that opens last among those
    whose braces close), nested braces kept: "\\boxed{\\frac{1}{2}}" gives "\\frac{1}{2}".
    None when the text has no complete box (an unclosed "\\boxed{5" is not one). One pass, linear
    in the text's length."""
    open_boxes: list[tuple[int, int]] = []  # (content start, brace depth inside the box)
    depth = 0
    last: tuple[int, int] | None = None  # (content start, content end) of the latest-opening closed box
    for match in _BOXED_OR_BRACE.finditer(text):
        token = match.group()
        if token.startswith(_BOXED_PREFIX):
            depth += 1
            open_boxes.append((match.end(), depth))
        elif token == "{":
            depth += 1
        elif token == "}":
            if open_boxes and open_boxes[-1][1] == depth:
                start, _ = open_boxes.pop()
                if last is None or start > last[0]:
                    last = (start, match.start())
            depth = max(depth - 1, 0)
    return None if last is None else text[last[0] : last[1]]


def nesting_depth(text: str) -> int:
    """Deepest nesting of brackets in text, (, [ and { counted together (an escaped \\{ too);
    a closer without an opener is ignored, so "1) 2)" nests 0 deep."""
    depth = deepest = 0
    for match in _BRACKET.finditer(text):  # only the brackets: prose between them costs no Python loop
        if match.group() in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def exponent_tower_height(text: str) -> int:
    """Height of the highest exponent tower in text: how many powers (^ or **) stand inside one
    another's exponents. `x^2+y^2` is 1, `2^{2^n}` 2, `5^{5^{5^5}}` 3 and `2**3**4**5` 3 (powers
    chain to the right). A power's exponent is the group ({...}, (...), [...]) or the atom (number,
    name, command) right after it; one linear pass, whitespace ignored."""
    if "^" not in text and "**" not in text:  # no power at all: skip the tokenizing pass
        return 0
    group_levels = [0]  # tower level of each open group, outermost first
    pending: int | None = None  # level of the exponent that the next group or atom starts
    chained: int | None = None  # level of the atom just read, when it was an exponent
    highest = 0
    for match in _TOWER_TOKEN.finditer(text):
        token = match.group()
        if token in ("^", "**"):
            pending = (chained if chained is not None else group_levels[-1]) + 1
            highest = max(highest, pending)
            chained = None
        elif token in _OPENERS:
            group_levels.append(group_levels[-1] if pending is None else pending)
            pending = chained = None
        elif token in _CLOSERS:
            if len(group_levels) > 1:
                group_levels.pop()
            pending = chained = None
        elif token.isspace():
            continue
        elif _ATOM.fullmatch(token):
            chained, pending = pending, None
        else:  # an operator or prose ends the exponent: "2^3+4^5" holds two towers of height 1
            pending = chained = None
    return highest


def _log10(digits: str) -> float:
    """log10 of a non-negative integer written in decimal, for any length (int() refuses more
    than 4,300 digits); 0 for 0 and 1, whose powers stay small."""
    digits = digits.lstrip("0") or "0"
    if len(digits) <= _FOLD_DIGITS:
        return math.log10(int(digits)) if int(digits) > 1 else 0.0
    return len(digits) - _FOLD_DIGITS + math.log10(int(digits[:_FOLD_DIGITS]))


def numeric_power_digits(text: str, passes: int) -> float:
    """Decimal digits of the largest numeric power in text (`3^{20}`, `2**-7`), numeric towers
    folded from the inside out over at most `passes` passes: `9^{9^{9}}` is 9^387420489, 3.7e8
    digits. Powers of a name (`x^{10}`) do not count. Never computes a large number."""
    largest = 0.0

    def fold(match: re.Match) -> str:
        nonlocal largest
        base = match.group(1).lstrip("0") or "0"
        exponent = (match.group(2) or match.group(3)).lstrip("-").lstrip("0") or "0"
        digits = math.inf if _log10(exponent) > _FOLD_DIGITS else int(exponent) * _log10(base)
        largest = max(largest, digits)
        if digits > _FOLD_DIGITS:
            return _HUGE_EXPONENT
        # A small power becomes its value, so that an outer power sees its real exponent
        # (a 1/x from a negative exponent counts as x: only the size matters).
        return "1" if exponent == "0" else str(int(base) ** int(exponent))

    for _ in range(passes):
        text, folded = _NUMERIC_POWER.subn(fold, text)
        if not folded:
            break
    return largest


def extract_answer(completion: str) -> tuple[str, bool]:
    """(the text math-verify will parse, whether it is a box's content): the last complete
    \\boxed{}'s content, else the whole completion (see the module docstring)."""
    boxed = last_boxed(completion)
    return (completion, False) if boxed is None else (boxed, True)


def precheck(completion: str, limits: AnswerLimits = DEFAULT_LIMITS) -> RewardResult | None:
    """A "rejected" failure naming the first limit the completion breaks, else None. Linear in
    the completion's length, and the length cap comes first, so a megabyte costs nothing."""
    if len(completion) > limits.max_completion_chars:
        return _rejected(f"completion length {len(completion)}", "max_completion_chars", limits)
    answer, boxed = extract_answer(completion)
    what = "boxed answer" if boxed else "completion"
    if boxed and len(answer) > limits.max_answer_chars:
        return _rejected(f"boxed answer length {len(answer)}", "max_answer_chars", limits)
    depth = nesting_depth(answer)
    if depth > limits.max_nesting_depth:
        return _rejected(f"{what} nesting depth {depth}", "max_nesting_depth", limits)
    height = exponent_tower_height(answer)
    if height > limits.max_exponent_tower:
        return _rejected(f"{what} exponent tower height {height}", "max_exponent_tower", limits)
    # Towers are at most `height` high here, so that many folding passes see every level.
    digits = numeric_power_digits(answer, passes=height)
    if digits > limits.max_power_digits:
        return _rejected(f"{what} numeric power of {digits:.3g} digits", "max_power_digits", limits)
    return None


def _rejected(measured: str, cap: str, limits: AnswerLimits) -> RewardResult:
    return _failure(_REJECTED_ERROR, f"{measured} exceeds {cap}={getattr(limits, cap)}")


def plain_number(text: str) -> Decimal | None:
    """The value of a plain numeral ("-12", "3.50"; surrounding whitespace allowed), or None for
    anything else: a sign other than a leading minus, leading zeros, exponents, separators, more
    than _MAX_PLAIN_DIGITS digits or _MAX_PLAIN_DECIMALS decimals."""
    text = text.strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    whole, _, decimals = text.lstrip("-").partition(".")
    if len(whole) + len(decimals) > _MAX_PLAIN_DIGITS or len(decimals) > _MAX_PLAIN_DECIMALS:
        return None
    return Decimal(text)


def plain_number_verdict(answer: str, gold: str) -> RewardResult | None:
    """The verdict when both the answer and the gold are plain numbers (exact comparison, which
    is math-verify's verdict on them: tests/test_math_verifier.py), else None."""
    predicted = plain_number(answer)
    if predicted is None:
        return None
    expected = plain_number(gold)
    if expected is None:
        return None
    return RewardResult(reward=1.0 if predicted == expected else 0.0, failed=False, error="")


def quick_verdict(
    completion: str, gold: str, limits: AnswerLimits = DEFAULT_LIMITS, fast_path: bool = True
) -> RewardResult | None:
    """What the pool answers without a process: a pre-check rejection, or a plain-number
    verdict (unless fast_path is False); None when math-verify must decide."""
    rejected = precheck(completion, limits)
    if rejected is not None or not fast_path:
        return rejected
    answer, _ = extract_answer(completion)
    return plain_number_verdict(answer, gold)


def score_completion(completion: str, gold: str, limits: AnswerLimits = DEFAULT_LIMITS) -> RewardResult:
    """Score one completion against a gold answer, in this process, with no deadline: the
    pre-checks and the plain-number fast path (quick_verdict), then math-verify.

    Only safe where a hang can be cut short from outside (the pre-checks stop the known hostile
    shapes, not every one): VerifierPool runs math-verify in processes it can kill.
    """
    quick = quick_verdict(completion, gold, limits)
    return quick if quick is not None else verify_with_math_verify(completion, gold)


def verify_with_math_verify(completion: str, gold: str) -> RewardResult:
    """Score one completion against a gold answer with math-verify alone (no pre-checks, no fast
    path), in this process, with no deadline.

    The answer is the last complete \\boxed{} if there is one, else math-verify's pick from the
    whole text (see the module docstring). Only safe where a hang can be cut short from outside:
    the pool's worker processes call it. math-verify's own signal timeouts are disabled (None):
    the pool's watchdog is the deadline.
    """
    from math_verify import parse, verify

    try:
        gold_parsed = _parse_gold(gold)
    except Exception as exc:  # noqa: BLE001 - any parser failure is a scoring outcome, not a crash
        return _failure(_PARSE_ERROR, f"gold answer {gold!r}: {type(exc).__name__}: {exc}")
    if not gold_parsed:
        return _failure(_PARSE_ERROR, f"gold answer {gold!r} has no parsable answer")
    boxed = last_boxed(completion)
    try:
        answer = completion if boxed is None else f"\\boxed{{{boxed}}}"
        predicted = parse(answer, parsing_timeout=None, raise_on_error=True)
    except Exception as exc:  # noqa: BLE001
        return _failure(_PARSE_ERROR, f"{type(exc).__name__}: {exc}")
    if not predicted:
        where = "completion" if boxed is None else f"the last \\boxed{{{_truncate(boxed, _LOG_SNIPPET_CHARS)}}}"
        return _failure(_PARSE_ERROR, f"no answer found in {where}")
    try:
        # raise_on_error=False: math-verify tries every (gold, prediction) pair and counts a pair
        # that raises as a mismatch; raising would abort the pairs that could still match.
        matched = verify(gold_parsed, predicted, timeout_seconds=None, raise_on_error=False)
    except Exception as exc:  # noqa: BLE001
        return _failure(_VERIFY_ERROR, f"{type(exc).__name__}: {exc}")
    return RewardResult(reward=1.0 if matched else 0.0, failed=False, error="")


def _worker_main(conn: Connection) -> None:
    """Entry point of a verifier process: JSON task in, JSON RewardResult out, until EOF."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The "timeout is disabled" warning is expected: the parent enforces the deadline.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verify_with_math_verify("1", "1")  # import sympy/math-verify and build the LaTeX parser before "ready"
    conn.send_bytes(_READY_MESSAGE)
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if "function" in request:
            conn.send_bytes(_run_function(request["function"], request["calls"]))
            continue
        if "load" in request:
            conn.send_bytes(_load_function(request["load"]))
            continue
        # The parent ran the pre-checks and the fast path (quick_verdict) before sending it here.
        result = verify_with_math_verify(request["completion"], request["gold"])
        conn.send_bytes(json.dumps(asdict(result)).encode("utf-8"))


def _load_function(ref: str) -> bytes:
    """Import a reward function's module ahead of its first call (inside a verifier process), so
    that its import time (reasoning-gym: seconds) never counts against a call's deadline."""
    try:
        reward_functions.load_function(ref)
    except reward_functions.RewardFunctionError as exc:
        return json.dumps({"loaded": False, "error": str(exc)}).encode("utf-8")
    return json.dumps({"loaded": True}).encode("utf-8")


def _run_function(ref: str, calls: list[dict[str, Any]]) -> bytes:
    """A reward function's scores on `calls`, as the JSON reply (inside a verifier process)."""
    try:
        function = reward_functions.load_function(ref)
    except reward_functions.RewardFunctionError as exc:
        scores = [reward_functions.failure(reward_functions.RAISED, str(exc))] * len(calls)
    else:
        scores = reward_functions.call_function(function, calls)
    reply = json.dumps({"scores": [score.as_json() for score in scores]}).encode("utf-8")
    if len(reply) > _MAX_FUNCTION_REPLY_BYTES:
        detail = f"reply of {len(reply)} bytes exceeds {_MAX_FUNCTION_REPLY_BYTES}"
        reply = json.dumps({"scores": [reward_functions.failure(reward_functions.BAD_RETURN, detail).as_json()]
                            * len(calls)}).encode("utf-8")
    return reply


def math_verify_reward(prompt: Mapping[str, Any], completion: str, token_ids: Sequence[int],
                       metadata: Mapping[str, Any]) -> float:
    """math-verify as a reward function (`math_verifier:math_verify_reward`): 1.0 when the
    completion's answer matches prompt["gt_answer"] (score_completion's rules), else 0.0. Run
    under the pool's deadline like any reward function; the default when RewardConfig names none
    runs the same verdict through VerifierPool.score, with its cache."""
    return score_completion(completion, str(prompt["gt_answer"])).reward


def _in_order(count: int, index_groups: list[list[int]], results: list[list[FunctionScore]]) -> list[FunctionScore]:
    """Scores of `count` calls in call order, from per-task (indices, scores) pieces."""
    ordered: list[FunctionScore | None] = [None] * count
    for indices, scores in zip(index_groups, results):
        for i, score in zip(indices, scores, strict=True):
            ordered[i] = score
    assert all(score is not None for score in ordered), "a call got no score"
    return ordered  # type: ignore[return-value]


def _decode_reply(data: bytes) -> RewardResult:
    reply = json.loads(data)
    return RewardResult(reward=float(reply["reward"]), failed=bool(reply["failed"]), error=str(reply["error"]))


class _WorkerSlot:
    """One verifier process and the parent's end of its pipe; used by one dispatcher thread."""

    def __init__(self, ctx: multiprocessing.context.ForkServerContext, index: int) -> None:
        self.index = index
        self._ctx = ctx
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.loaded: set[str] = set()
        """Reward functions this slot's current process has imported (see load)."""

    @property
    def alive(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        """Start the process; call wait_ready() before sending it work."""
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn,), name=f"math-verifier-{self.index}", daemon=True
        )
        try:
            process.start()
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()  # the child has its copy; closing ours lets the parent see EOF when it dies
        self._process, self._conn = process, parent_conn
        self.loaded = set()

    def load(self, ref: str) -> None:
        """Have the process import reward function `ref`, waiting up to _STARTUP_TIMEOUT_S (an
        import is start-up work, not scoring). A module that fails to import is not an error
        here: the call then fails the same way and reports it. Raises EOFError/OSError when the
        process died, TimeoutError when the import outlasted the wait."""
        assert self._conn is not None, "load() on a slot without a process"
        self._conn.send_bytes(json.dumps({"load": ref}).encode("utf-8"))
        if not self._conn.poll(_STARTUP_TIMEOUT_S):
            raise TimeoutError(f"importing {ref} took more than {_STARTUP_TIMEOUT_S:.0f} s")
        self._conn.recv_bytes(_MAX_REPLY_BYTES)
        self.loaded.add(ref)

    def wait_ready(self) -> None:
        """Block until the process has imported math-verify, or raise WorkerStartError."""
        assert self._conn is not None, "wait_ready() before start()"
        if not self._conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise WorkerStartError(f"verifier process {self.index} not ready after {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            message = self._conn.recv_bytes(_MAX_REPLY_BYTES)
        except (EOFError, OSError):
            exitcode = self.kill()
            raise WorkerStartError(
                f"verifier process {self.index} exited during startup (exit code {exitcode}); its stderr says why"
            ) from None
        if message != _READY_MESSAGE:
            self.kill()
            raise WorkerStartError(f"verifier process {self.index} sent {message[:100]!r} instead of ready")

    def run(self, payload: bytes, timeout_s: float, max_reply_bytes: int = _MAX_REPLY_BYTES) -> bytes | None:
        """Send one task and wait for its reply; None when the deadline passed first.

        Raises EOFError/OSError when the process died or broke the protocol.
        """
        assert self._conn is not None, "run() on a slot without a process"
        self._conn.send_bytes(payload)
        if not self._conn.poll(timeout_s):
            return None
        return self._conn.recv_bytes(max_reply_bytes)

    def kill(self) -> int | None:
        """SIGKILL the process (if any), reap it and return its exit code."""
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        process.kill()
        process.join()
        exitcode = process.exitcode
        process.close()
        return exitcode

    def stop(self) -> None:
        """Close the pipe so the process exits on EOF; kill it if it does not within the grace."""
        process, conn = self._process, self._conn
        if conn is not None:
            conn.close()
            self._conn = None
        if process is None:
            return
        process.join(_SHUTDOWN_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
        process.close()
        self._process = None


@dataclass(slots=True)
class _Task:
    """One completion waiting for a verifier process."""

    payload: bytes
    """JSON {"gold": ..., "completion": ...} as sent to the process."""
    completion_chars: int
    """Length of the completion, for log lines."""
    snippet: str
    """Start of the completion, for log lines."""
    future: Future
    """Resolved with the RewardResult by the dispatcher thread."""
    cache_key: tuple[str, str] | None
    """(gold, completion) under which a deterministic result is cached, or None: do not cache."""
    timeout_s: float | None = None
    """This task's deadline; None: the pool's timeout_s."""
    function_ref: str = ""
    """The reward function of a function task ("module:function")."""
    num_calls: int = 0
    """Reward-function calls in the payload (0: a math-verify task); the future then resolves to
    a list of that many FunctionScores."""


class VerifierPool:
    """A pool of math-verify processes with a hard per-sample deadline (see the module docstring).

    Built from a VerifierPoolConfig, or from its fields as keywords
    (`VerifierPool(num_processes=2, timeout_s=2.0)`), or both (the keywords override the config).

    Thread-safe and event-loop agnostic: dispatcher threads do the waiting, so `score` may be
    awaited from any event loop and `score_sync` called from any thread.

    A call's completions are queued one by one and taken by whichever process is free, so a slow
    completion holds one process while the others serve the rest of the call and other calls;
    inputs that the pre-checks reject or the fast path answers (quick_verdict) are resolved in the
    caller's thread and never queue at all.

    Results are deterministic in (gold, completion) except timeouts and process deaths, so the
    others are kept in an LRU cache of `cache_size` entries, and a completion repeated within one
    call is verified once. GRPO samples the same short answer many times (a demo step of 512
    rollouts has a few dozen distinct (gold, completion) pairs), and each verification costs a
    pipe round trip plus math-verify's parse: ~1-3 ms of CPU. `cache_size=0` turns both off.
    """

    def __init__(self, config: VerifierPoolConfig | None = None, /, **overrides: Any) -> None:
        config = replace(config or VerifierPoolConfig(), **overrides)
        self.config = config
        self.num_processes = config.num_processes or default_num_processes()
        self.timeout_s = float(config.timeout_s)
        self.cache_size = config.cache_size
        self.limits = config.limits
        self._cache: OrderedDict[tuple[str, str], RewardResult] = OrderedDict()
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._counts = dict.fromkeys(
            ("scored", "failed", "timeouts", "parse_errors", "verify_errors", "rejected", "fast_path", "crashes",
             "restarts", "cancelled", "cache_hits", "function_calls", "function_failed", "function_raised",
             "function_bad_returns", "function_timeouts", "function_crashes", "function_rejected"), 0
        )
        ctx = multiprocessing.get_context("forkserver")
        # Takes effect when this process's forkserver first starts (a no-op if one already runs).
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        self._slots = [_WorkerSlot(ctx, i) for i in range(self.num_processes)]
        self._start_all()
        self._threads = [
            threading.Thread(target=self._dispatch_loop, args=(slot,), name=f"verifier-dispatch-{slot.index}", daemon=True)
            for slot in self._slots
        ]
        for thread in self._threads:
            thread.start()
        logger.info(
            "verifier pool ready: %d processes, %.1f s deadline per sample, %s",
            self.num_processes, self.timeout_s, self.limits,
        )

    def _start_all(self) -> None:
        """Start every process at once (imports overlap), then wait for each; all or nothing."""
        try:
            for slot in self._slots:
                slot.start()
            for slot in self._slots:
                slot.wait_ready()
        except BaseException:
            for slot in self._slots:
                slot.kill()
            raise

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def score(self, completions: Sequence[str], gt_answer: str) -> list[RewardResult]:
        """Score completions against one gold answer, concurrently across the pool, in order."""
        futures = self._submit(completions, gt_answer)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def score_sync(self, completions: Sequence[str], gt_answer: str) -> list[RewardResult]:
        """Blocking form of `score`, for code without an event loop."""
        return [future.result() for future in self._submit(completions, gt_answer)]

    async def score_function(self, ref: str, calls: Sequence[Mapping[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """Score completions with the reward function `ref` ("module:function", see
        reward_functions) in the pool's processes, each call under the deadline (a batched
        function: the whole batch under one deadline). calls: {prompt, completion, token_ids,
        metadata} dicts, JSON-serialisable. A function that raises, hangs past the deadline,
        kills its process or returns a non-number gives those completions reward 0, failed, with
        the reason in `error`, counted in stats(); never an exception."""
        parts = self._submit_function(ref, calls, timeout_s)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in parts))
        return _in_order(len(calls), [indices for indices, _ in parts], results)

    def score_function_sync(self, ref: str, calls: Sequence[Mapping[str, Any]],
                            timeout_s: float | None = None) -> list[FunctionScore]:
        """Blocking form of `score_function`."""
        parts = self._submit_function(ref, calls, timeout_s)
        return _in_order(len(calls), [indices for indices, _ in parts], [f.result() for _, f in parts])

    def _submit_function(self, ref: str, calls: Sequence[Mapping[str, Any]],
                         timeout_s: float | None) -> list[tuple[list[int], Future]]:
        """(indices of the calls, future of their scores) per task. A completion longer than
        limits.max_completion_chars is rejected here, as for math-verify: no real completion is
        that long, and a megabyte would cost every process on its way through the pipe."""
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.score_function called after close()")
        # Importing it here too keeps a batched function's batch together (the process imports it
        # again; a module that fails here fails there the same way).
        try:
            batch = reward_functions.is_batched(reward_functions.load_function(ref))
        except reward_functions.RewardFunctionError:
            batch = False
        cap = self.limits.max_completion_chars
        parts: list[tuple[list[int], Future]] = []
        accepted = []
        for i, call in enumerate(calls):
            length = len(str(call.get("completion", "")))
            if length <= cap:
                accepted.append(i)
                continue
            rejected = reward_functions.failure(_REJECTED_ERROR, f"completion length {length} exceeds "
                                                                 f"max_completion_chars={cap}")
            self._record_function([rejected])
            future: Future = Future()
            future.set_result([rejected])
            parts.append(([i], future))
        groups = [accepted] if batch and accepted else [[i] for i in accepted]
        for indices in groups:
            group = [calls[i] for i in indices]
            task = _Task(payload=json.dumps({"function": ref, "calls": group}).encode("utf-8"),
                         completion_chars=sum(len(str(call.get("completion", ""))) for call in group),
                         snippet=f"{ref} on {str(group[0].get('completion', ''))[:_LOG_SNIPPET_CHARS]}",
                         future=Future(), cache_key=None, timeout_s=timeout_s, num_calls=len(group),
                         function_ref=ref)
            self._tasks.put(task)
            parts.append((indices, task.future))
        return parts

    def stats(self) -> dict[str, int]:
        """Counters since start: scored (results computed: by a process, a pre-check or the fast
        path), failed, and failures by kind (timeouts, parse_errors, verify_errors, rejected by a
        pre-check, crashes), fast_path (plain-number verdicts, no process), restarts (replacement
        processes started), cancelled (tasks dropped because their caller went away), cache_hits
        (samples answered from the cache or by an identical completion of the same call),
        num_processes; for reward functions (score_function): function_calls (completions
        scored), function_failed, and failures by kind: function_raised, function_bad_returns,
        function_timeouts, function_crashes, function_rejected (longer than
        limits.max_completion_chars, never sent to a process)."""
        with self._lock:
            return {**self._counts, "num_processes": self.num_processes}

    def close(self) -> None:
        """Fail queued samples, stop the dispatchers (each finishes its current sample) and processes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None and task.future.set_running_or_notify_cancel():
                task.future.set_exception(RuntimeError("VerifierPool closed before this sample was scored"))
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        for slot in self._slots:
            slot.stop()
        logger.info("verifier pool closed: %s", self.stats())

    def _submit(self, completions: Sequence[str], gt_answer: str) -> list[Future]:
        if not isinstance(gt_answer, str):
            raise TypeError(f"VerifierPool.score: gt_answer must be str, got {type(gt_answer).__name__}")
        if isinstance(completions, str):
            raise TypeError("VerifierPool.score: completions must be a list of str, got a single str")
        for i, completion in enumerate(completions):
            if not isinstance(completion, str):
                raise TypeError(f"VerifierPool.score: completions[{i}] must be str, got {type(completion).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.score called after close()")
        futures: list[Future] = []
        in_this_call: dict[str, Future] = {}
        for completion in completions:
            known = in_this_call.get(completion) or self._cached_future(gt_answer, completion)
            if known is not None:
                self._count("cache_hits")
                futures.append(known)
                continue
            cacheable = self.cache_size > 0 and len(completion) <= _MAX_CACHED_COMPLETION_CHARS
            cache_key = (gt_answer, completion) if cacheable else None
            future = self._answer_now(completion, gt_answer, cache_key)
            if future is None:
                future = self._enqueue(completion, gt_answer, cache_key)
            futures.append(future)
            if cacheable:
                in_this_call[completion] = future
        return futures

    def _answer_now(self, completion: str, gt_answer: str, cache_key: tuple[str, str] | None) -> Future | None:
        """A resolved Future when the pre-checks reject the completion or the fast path decides
        it (no process, no queue: a hostile input never waits for or holds a verifier), else None."""
        result = quick_verdict(completion, gt_answer, self.limits, self.config.fast_path)
        if result is None:
            return None
        if not result.failed:
            self._count("fast_path")
        self._record(result)
        if cache_key is not None:
            self._remember(cache_key, result)
        future: Future = Future()
        future.set_result(result)
        return future

    def _enqueue(self, completion: str, gt_answer: str, cache_key: tuple[str, str] | None) -> Future:
        task = _Task(
            payload=json.dumps({"gold": gt_answer, "completion": completion}).encode("utf-8"),
            completion_chars=len(completion),
            snippet=completion[:_LOG_SNIPPET_CHARS],
            future=Future(),
            cache_key=cache_key,
        )
        self._tasks.put(task)
        return task.future

    def _cached_future(self, gt_answer: str, completion: str) -> Future | None:
        """A resolved Future holding the cached result for (gt_answer, completion), or None."""
        if self.cache_size == 0:
            return None
        key = (gt_answer, completion)
        with self._lock:
            result = self._cache.get(key)
            if result is None:
                return None
            self._cache.move_to_end(key)
        future: Future = Future()
        future.set_result(result)
        return future

    def _remember(self, key: tuple[str, str], result: RewardResult) -> None:
        """Cache a result that another run of the same input would repeat (LRU eviction)."""
        kind = result.error.split(":", 1)[0]
        if kind in (_TIMEOUT_ERROR, _VERIFY_ERROR):  # load or a dying process, not the input
            return
        with self._lock:
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _dispatch_loop(self, slot: _WorkerSlot) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if not task.future.set_running_or_notify_cancel():
                self._count("cancelled")
                continue
            # A replacement that failed to start after a kill gets one more try per sample.
            had_process = slot.alive or self._restart(slot)
            if task.num_calls:
                scores = self._run_function_task(slot, task) if had_process else [reward_functions.failure(
                    "crash", f"verifier process {slot.index} could not be started (see log)")] * task.num_calls
                self._record_function(scores)
                task.future.set_result(scores)
                if had_process and not slot.alive:
                    self._restart(slot)
                continue
            try:
                result = self._run_task(slot, task) if had_process else _failure(
                    _VERIFY_ERROR, f"verifier process {slot.index} could not be started (see log)"
                )
            except Exception as exc:  # noqa: BLE001 - a dispatcher must outlive any one sample
                logger.exception("verifier dispatcher %d failed on a sample", slot.index)
                task.future.set_exception(exc)
                continue
            self._record(result)
            if task.cache_key is not None:
                self._remember(task.cache_key, result)
            task.future.set_result(result)
            if had_process and not slot.alive:
                self._restart(slot)  # after answering, so the caller does not wait for it

    def _run_function_task(self, slot: _WorkerSlot, task: _Task) -> list[FunctionScore]:
        """Run one reward-function task; kills the process on timeout, death or protocol failure."""
        timeout = self.timeout_s if task.timeout_s is None else task.timeout_s
        try:
            if task.function_ref not in slot.loaded:
                slot.load(task.function_ref)
            reply = slot.run(task.payload, timeout, _MAX_FUNCTION_REPLY_BYTES)
            scores = None if reply is None else [FunctionScore.from_json(s) for s in json.loads(reply)["scores"]]
            if scores is not None and len(scores) != task.num_calls:
                raise ValueError(f"{len(scores)} scores for {task.num_calls} calls")
        except (EOFError, OSError, ValueError, KeyError, TypeError, TimeoutError) as exc:
            exitcode = slot.kill()
            logger.error("verifier process %d died or broke protocol in %s (exit code %s): %r",
                         slot.index, task.snippet, exitcode, exc)
            return [reward_functions.failure("crash", f"verifier process died (exit code {exitcode})")] * task.num_calls
        if scores is None:
            slot.kill()
            logger.warning("reward function timeout after %.1f s (%s); replacing process %d", timeout, task.snippet,
                           slot.index)
            return [reward_functions.failure(_TIMEOUT_ERROR)] * task.num_calls
        return scores

    def _record_function(self, scores: list[FunctionScore]) -> None:
        with self._lock:
            for score in scores:
                self._counts["function_calls"] += 1
                if not score.failed:
                    continue
                self._counts["function_failed"] += 1
                kind = score.error.split(":", 1)[0]
                key = {"raised": "function_raised", "bad_return": "function_bad_returns",
                       _TIMEOUT_ERROR: "function_timeouts", _REJECTED_ERROR: "function_rejected"}.get(
                    kind, "function_crashes")
                self._counts[key] += 1

    def _run_task(self, slot: _WorkerSlot, task: _Task) -> RewardResult:
        """Run one task on the slot's process; kills the process on timeout or protocol failure."""
        try:
            reply = slot.run(task.payload, self.timeout_s)
            result = None if reply is None else _decode_reply(reply)
        except (EOFError, OSError, ValueError, KeyError) as exc:
            exitcode = slot.kill()
            self._count("crashes")
            logger.error("verifier process %d died or broke protocol (exit code %s): %r", slot.index, exitcode, exc)
            return _failure(_VERIFY_ERROR, f"verifier process died (exit code {exitcode})")
        if result is None:
            slot.kill()
            logger.warning(
                "verifier timeout after %.1f s on a %d-char completion starting %r; replacing process %d",
                self.timeout_s, task.completion_chars, task.snippet, slot.index,
            )
            return _failure(_TIMEOUT_ERROR)
        return result

    def _restart(self, slot: _WorkerSlot) -> bool:
        """Start a replacement process for a slot whose process was killed; False if it failed."""
        try:
            slot.start()
            slot.wait_ready()
        except (WorkerStartError, OSError):
            logger.exception("could not start a replacement verifier process %d", slot.index)
            return False
        self._count("restarts")
        return True

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _record(self, result: RewardResult) -> None:
        kind = result.error.split(":", 1)[0]
        with self._lock:
            self._counts["scored"] += 1
            if result.failed:
                self._counts["failed"] += 1
            if kind == _TIMEOUT_ERROR:
                self._counts["timeouts"] += 1
            elif kind == _PARSE_ERROR:
                self._counts["parse_errors"] += 1
            elif kind == _VERIFY_ERROR:
                self._counts["verify_errors"] += 1
            elif kind == _REJECTED_ERROR:
                self._counts["rejected"] += 1


class VerifierShardActor:
    """Ray actor shell over the VerifierPool of one node, reserving one verification slot per process.

    Created by VerifierPoolActor, pinned to its node; generation workers call it directly
    through a VerifierPoolClient. An async actor: concurrent `score` calls interleave on its
    event loop while the pool's processes do the work.
    """

    def __init__(self, num_processes: int, timeout_s: float | None) -> None:
        self._pool = VerifierPool(_pool_config(num_processes, timeout_s))

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        """See VerifierPool.score."""
        return await self._pool.score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """See VerifierPool.score_function."""
        return await self._pool.score_function(ref, calls, timeout_s)

    def stats(self) -> dict[str, int]:
        """See VerifierPool.stats."""
        return self._pool.stats()

    def node_id(self) -> str:
        """The Ray node this shard's processes run on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def _pool_config(num_processes: int | None, timeout_s: float | None) -> VerifierPoolConfig:
    """A VerifierPoolConfig from the actors' arguments, None meaning the config's default."""
    return VerifierPoolConfig(num_processes=num_processes, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)


def plan_verifier_shards(node_slots: Mapping[str, float], num_processes: int) -> dict[str, int]:
    """Verifier processes per node: dealt one at a time, round robin over the nodes (by id) that
    still have a free whole `verification_slot`, so they spread evenly. Nodes without a slot get
    none; when the slots run out first, the plan holds fewer than num_processes."""
    capacity = {node: int(slots) for node, slots in sorted(node_slots.items()) if slots >= 1}
    plan = dict.fromkeys(capacity, 0)
    remaining = num_processes
    while remaining > 0 and any(plan[node] < capacity[node] for node in plan):
        for node in plan:
            if remaining > 0 and plan[node] < capacity[node]:
                plan[node] += 1
                remaining -= 1
    return {node: count for node, count in plan.items() if count}


def _node_slots() -> dict[str, float]:
    """VERIFICATION_SLOT capacity of every live node of the connected cluster, by node id."""
    import ray

    return {
        node["NodeID"]: float(node["Resources"].get(VERIFICATION_SLOT, 0.0))
        for node in ray.nodes()
        if node["Alive"]
    }


def shard_actor_name(index: int) -> str:
    """Name of the pool's index-th shard actor ("math-verifier-pool-0", ...)."""
    from ray_env import VERIFIER_POOL_ACTOR_NAME

    return f"{VERIFIER_POOL_ACTOR_NAME}-{index}"


class _Router:
    """Sends each score call to the target with the fewest of this router's calls in flight; on a
    dead or unreachable target, tries the others once each. For one event loop (no locking)."""

    def __init__(self, targets: Sequence[Any], what: str) -> None:
        if not targets:
            raise ValueError("_Router needs at least one target")
        self._targets = list(targets)
        self._what = what
        self._inflight = [0] * len(self._targets)
        self._dead: set[int] = set()

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        return await self.call("score", completions, gt_answer)

    async def call(self, method: str, *args: Any) -> Any:
        """`method` of the least busy live target (score or score_function), failing over once per target."""
        from ray.exceptions import ActorDiedError, RayActorError

        tried: set[int] = set()
        if not self._candidates(tried):
            raise RuntimeError(f"every {self._what} ({len(self._targets)}) has died")
        while True:
            index = min(self._candidates(tried), key=self._inflight.__getitem__)
            tried.add(index)
            self._inflight[index] += 1
            try:
                return await getattr(self._targets[index], method).remote(*args)
            except RayActorError as exc:
                if isinstance(exc, ActorDiedError):
                    self._dead.add(index)
                if not self._candidates(tried):
                    raise
                logger.error("%s %d failed (%s); trying another", self._what, index, type(exc).__name__)
            finally:
                self._inflight[index] -= 1

    def _candidates(self, tried: set[int]) -> list[int]:
        return [i for i in range(len(self._targets)) if i not in tried and i not in self._dead]


class VerifierPoolActor:
    """The cluster's one verifier pool ("math-verifier-pool"), shared by every generation worker.

    Where its processes run depends on the cluster (decided once, when the actor starts):
    - Some nodes advertise the `verification_slot` custom resource (`ray start
      --resources='{"verification_slot": 100}'`): the processes are dealt over those nodes
      (plan_verifier_shards), and each node gets one VerifierShardActor that runs its share and
      reserves one slot per process, so Ray accounts for them and never over-commits a node.
      Generation workers score on the shards directly (VerifierPoolClient); `score` here
      forwards to them, for other callers.
    - No node does: the processes run in this actor's own process, wherever Ray placed it,
      outside Ray's resource accounting (num_cpus=0), which is logged once, here.

    Shards are detached like this actor and named shard_actor_name(i), so a restarted pool
    actor finds them again; `shutdown_verifier_pool` stops the lot. A node that joins later
    gets no share, and the share of a node that dies is lost until the pool is recreated.
    """

    def __init__(self, num_processes: int | None, timeout_s: float | None) -> None:
        # None: sized from this actor's node (default_num_processes), before the shards are planned.
        num_processes = num_processes or default_num_processes()
        self.num_processes = num_processes
        self._pool: VerifierPool | None = None
        self._shards: list[Any] = []
        self._plan: dict[str, int] = {}
        self._shard_nodes: list[Any] = []  # ObjectRefs of each shard's node id: resolved once it is up
        self._placement: dict[str, int] = {}
        plan = plan_verifier_shards(_node_slots(), num_processes)
        if not plan:
            self._start_unaccounted(num_processes, timeout_s)
            return
        if sum(plan.values()) < num_processes:
            logger.warning(
                "%d verifier processes asked for, but the cluster offers only %d %r slots: starting %d",
                num_processes, sum(plan.values()), VERIFICATION_SLOT, sum(plan.values()),
            )
        self._start_shards(plan, timeout_s)
        self._router = _Router(self._shards, "verifier shard")

    def _start_unaccounted(self, num_processes: int, timeout_s: float | None) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        logger.warning(
            "no node advertises the %r resource: all %d verifier processes run in the pool actor's "
            "process on node %s, outside Ray's CPU accounting (num_cpus=0). Give the nodes that should "
            "verify `ray start --resources='{\"%s\": N}'` to reserve and spread them.",
            VERIFICATION_SLOT, num_processes, node, VERIFICATION_SLOT,
        )
        self._pool = VerifierPool(_pool_config(num_processes, timeout_s))
        self._placement = {node: num_processes}

    def _start_shards(self, plan: dict[str, int], timeout_s: float | None) -> None:
        """One shard per planned node, all starting at once (`_started` waits for them)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ray_env import RAY_NAMESPACE

        shard_cls = ray.remote(VerifierShardActor)
        for index, (node, count) in enumerate(plan.items()):
            self._shards.append(shard_cls.options(
                name=shard_actor_name(index),
                namespace=RAY_NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                resources={VERIFICATION_SLOT: count},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
                max_restarts=_ACTOR_MAX_RESTARTS,
            ).remote(count, timeout_s))
        self._plan = plan
        self._shard_nodes = [shard.node_id.remote() for shard in self._shards]

    async def _started(self) -> None:
        """Wait (once) until every shard has its processes up; WorkerStartError after
        _SHARD_START_TIMEOUT_S, which almost always means their slots are held elsewhere."""
        if self._placement:
            return
        try:
            nodes = await asyncio.wait_for(asyncio.gather(*self._shard_nodes), _SHARD_START_TIMEOUT_S)
        except TimeoutError:
            raise WorkerStartError(
                f"verifier shards not started within {_SHARD_START_TIMEOUT_S:.0f} s: are their nodes' "
                f"{VERIFICATION_SLOT!r} slots taken by other actors? plan {self._plan}"
            ) from None
        if not self._placement:
            self._placement = dict(zip(nodes, self._plan.values()))
            logger.info(
                "verifier pool: %d processes over %d nodes %s", sum(self._plan.values()), len(nodes), self._placement
            )

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        """See VerifierPool.score (forwarded to the least busy shard when there are shards)."""
        if self._pool is not None:
            return await self._pool.score(completions, gt_answer)
        await self._started()
        return await self._router.score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        """See VerifierPool.score_function (forwarded to the least busy shard when there are shards)."""
        if self._pool is not None:
            return await self._pool.score_function(ref, calls, timeout_s)
        await self._started()
        return await self._router.call("score_function", ref, calls, timeout_s)

    async def stats(self) -> dict[str, int]:
        """VerifierPool.stats, summed over the shards, plus `shards` (0: processes run here)."""
        if self._pool is not None:
            return {**self._pool.stats(), "shards": 0}
        await self._started()
        totals: dict[str, int] = {}
        for shard_stats in await asyncio.gather(*(shard.stats.remote() for shard in self._shards)):
            for key, value in shard_stats.items():
                totals[key] = totals.get(key, 0) + value
        return {**totals, "shards": len(self._shards)}

    async def shards(self) -> list[Any]:
        """Handles of the shard actors, once started; [] when the processes run in this actor."""
        if self._shards:
            await self._started()
        return list(self._shards)

    async def placement(self) -> dict[str, int]:
        """Verifier processes per Ray node id."""
        if self._shards:
            await self._started()
        return dict(self._placement)

    def close(self) -> None:
        """Stop the processes that run in this actor (shards are stopped by shutdown_verifier_pool)."""
        if self._pool is not None:
            self._pool.close()


class VerifierPoolClient:
    """What a generation worker scores through (vllm_worker.RewardScorer): the shards of the
    cluster's pool directly, each call to the one with the fewest of this client's calls in
    flight, or the pool actor itself when it has no shards. A call's completions stay together
    (one shard dedupes and caches them); many prompts in flight spread over the shards."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._router: _Router | None = None

    async def score(self, completions: list[str], gt_answer: str) -> list[RewardResult]:
        return await (await self._connected()).score(completions, gt_answer)

    async def score_function(self, ref: str, calls: list[dict[str, Any]],
                             timeout_s: float | None = None) -> list[FunctionScore]:
        return await (await self._connected()).call("score_function", ref, calls, timeout_s)

    async def _connected(self) -> _Router:
        if self._router is None:
            shards = await self._pool.shards.remote()
            if self._router is None:  # another call may have connected meanwhile
                self._router = _Router(shards or [self._pool], "verifier shard" if shards else "verifier pool")
        return self._router


def get_or_create_verifier_pool(num_processes: int | None = None, timeout_s: float | None = None):
    """The cluster's one verifier pool actor ("math-verifier-pool" in the project namespace).
    None for either argument means VerifierPoolConfig's default (the pool's size then comes from
    the cores of the node the actor starts on).

    The first caller creates it with its arguments (detached: it outlives its creator); every later
    caller gets that same actor and its arguments are ignored, so start the component that should
    size it (the seed's --global_num_verifiers) first, or pass the same values everywhere.
    `stats()["num_processes"]` tells a caller what it got, `placement()` where the processes run
    (VerifierPoolActor: on the nodes offering `verification_slot`, else in the actor's process).
    num_cpus=0: the actor itself only waits and routes.
    """
    import ray

    from ray_env import ON_HEAD_NODE, RAY_NAMESPACE, VERIFIER_POOL_ACTOR_NAME

    actor_cls = ray.remote(VerifierPoolActor)
    return actor_cls.options(
        name=VERIFIER_POOL_ACTOR_NAME,
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        resources=ON_HEAD_NODE,  # never on a worker node that can be lost mid-run
        max_restarts=_ACTOR_MAX_RESTARTS,
    ).remote(num_processes, timeout_s)


def connect_verifier_pool(num_processes: int | None = None, timeout_s: float | None = None) -> VerifierPoolClient:
    """A VerifierPoolClient over the cluster's pool (created with these arguments if it does not exist)."""
    return VerifierPoolClient(get_or_create_verifier_pool(num_processes, timeout_s))


def shutdown_verifier_pool() -> None:
    """Kill the cluster's pool actor and its shards (releasing their slots); a no-op without them."""
    import ray

    from ray_env import RAY_NAMESPACE, VERIFIER_POOL_ACTOR_NAME

    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == RAY_NAMESPACE and (
            name == VERIFIER_POOL_ACTOR_NAME or name.startswith(f"{VERIFIER_POOL_ACTOR_NAME}-")
        ):
            try:
                ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE))
            except ValueError:  # gone meanwhile
                pass
