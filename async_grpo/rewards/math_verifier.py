"""Answer checks with math-verify: which answer of a completion counts, the cheap pre-checks
that turn hostile shapes away, the plain-number fast path, and math-verify's verdict. Pure: no
processes, no Ray; the verifier pool (math_verify_pool.py) runs `verify_with_math_verify` in processes
it can kill at a deadline, since math-verify itself cannot be interrupted (see there).

    result = score_completion("so the sum is \\boxed{7}", "7")   # RewardResult(1.0, False, "")

Two kinds of input are answered without math-verify (`quick_verdict`, the same rules in
`score_completion`; ~0.1-0.3 ms for a 4k-character completion, ~7 ms at the 131k-character cap):
    - pre-checks (AnswerLimits): a completion longer than `max_completion_chars`, a boxed
      answer longer than `max_answer_chars`, brackets nested deeper than `max_nesting_depth`,
      an exponent tower higher than `max_exponent_tower` (`5^{5^{5^5}}`, `2**3**4**5`) or a
      numeric power of more than `max_power_digits` digits (`9^{9^{9}}`) is rejected: reward 0,
      failed, error "rejected: <measure> exceeds <cap>". These shapes hang math-verify
      (measured: 20 nested parentheses ~4 s, 20 nested braces over 15 s, a tower or a huge
      power indefinitely), and rejected they cost neither a deadline nor a process restart.
      A 20k-character `$x...x$` span (6.8 s) still passes: the pool's deadline is for such shapes;
    - the plain-number fast path: when the extracted answer and the gold answer are both plain
      numerals ("-12", "3.50": no sign other than a leading minus, no leading zeros, at most
      15 digits and 6 decimals, where math-verify's comparison is exact), they are compared
      as exact decimals, which is math-verify's verdict on them (tested against it).
Everything else goes to math-verify, which the pool runs under its deadline: the backstop for
hostile shapes the pre-checks do not know.

What a result means (`kind` is the typed reason, reward_failure.FailureKind; `error` says it in words):
    reward 1.0, failed False, error ""   math_verify.verify(parse(gold), parse(completion)) is true
    reward 0.0, failed False, error ""   an answer was found and it does not match the gold
    reward 0.0, failed True,  error "timeout"            the deadline passed; the process was killed
    reward 0.0, failed True,  error "parse_error: ..."   no answer could be extracted from the
                                         completion (or from the gold answer, a dataset problem)
    reward 0.0, failed True,  error "verify_error: ..."  verify raised, or the process died
    reward 0.0, failed True,  error "rejected: ..."      a pre-check cap (the error names it)

An output without any extractable answer earns 0 like a wrong one, but is flagged (failed=True,
counted in the pool's stats()) so callers can tell "wrong" from "unscorable".

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

`math_verify_reward` is the same verdict as a plug-in reward function
(`async_grpo.rewards.math_verifier:math_verify_reward`, reward_functions.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Mapping, Sequence

from async_grpo.rewards.reward_failure import FailureKind

# Error strings come from exception messages that may quote a megabyte of input: keep them short.
_MAX_ERROR_CHARS = 300
# Characters of a boxed answer quoted in a parse error.
_ERROR_SNIPPET_CHARS = 80
# Distinct gold answers whose parse a process keeps: the n rollouts of a prompt share one gold.
_GOLD_CACHE_SIZE = 1024
# What last_boxed() scans for: `\boxed{` (spaces allowed before the brace), an escaped brace
# (literal text in LaTeX, never a group), or a plain brace.
_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|\\[{}]|[{}]")
_BOXED_PREFIX = "\\boxed"
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
    "rejected: <which pre-check cap>" when failed. For people: counters read `kind`."""
    kind: FailureKind | None = None
    """Why it failed (the error's first word, as a typed value); None when it did not fail, or
    for a failure that has no single kind (a verdict combined from several reward functions)."""

    def __post_init__(self) -> None:
        if self.kind is not None and not self.failed:
            raise ValueError(f"RewardResult.kind is {self.kind!r} on a result that did not fail")


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


def _truncate(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def failure(kind: FailureKind, detail: str = "") -> RewardResult:
    """A failed result: reward 0, `kind`, and error "<kind>: <detail>" (detail shortened)."""
    error = f"{kind}: {_truncate(detail)}" if detail else str(kind)
    return RewardResult(reward=0.0, failed=True, error=error, kind=kind)


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
    return failure(FailureKind.REJECTED, f"{measured} exceeds {cap}={getattr(limits, cap)}")


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
    is math-verify's verdict on them: tests/rewards/test_math_verifier.py), else None."""
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
        return failure(FailureKind.PARSE_ERROR, f"gold answer {gold!r}: {type(exc).__name__}: {exc}")
    if not gold_parsed:
        return failure(FailureKind.PARSE_ERROR, f"gold answer {gold!r} has no parsable answer")
    boxed = last_boxed(completion)
    try:
        answer = completion if boxed is None else f"\\boxed{{{boxed}}}"
        predicted = parse(answer, parsing_timeout=None, raise_on_error=True)
    except Exception as exc:  # noqa: BLE001
        return failure(FailureKind.PARSE_ERROR, f"{type(exc).__name__}: {exc}")
    if not predicted:
        where = "completion" if boxed is None else f"the last \\boxed{{{_truncate(boxed, _ERROR_SNIPPET_CHARS)}}}"
        return failure(FailureKind.PARSE_ERROR, f"no answer found in {where}")
    try:
        # raise_on_error=False: math-verify tries every (gold, prediction) pair and counts a pair
        # that raises as a mismatch; raising would abort the pairs that could still match.
        matched = verify(gold_parsed, predicted, timeout_seconds=None, raise_on_error=False)
    except Exception as exc:  # noqa: BLE001
        return failure(FailureKind.VERIFY_ERROR, f"{type(exc).__name__}: {exc}")
    return RewardResult(reward=1.0 if matched else 0.0, failed=False, error="")


def math_verify_reward(prompt: Mapping[str, Any], completion: str, token_ids: Sequence[int],
                       metadata: Mapping[str, Any]) -> float:
    """math-verify as a reward function (`async_grpo.rewards.math_verifier:math_verify_reward`): 1.0 when the
    completion's answer matches prompt["gt_answer"] (score_completion's rules), else 0.0. Run
    under the pool's deadline like any reward function; the default when RewardConfig names none
    runs the same verdict through VerifierPool.score, with its cache."""
    return score_completion(completion, str(prompt["gt_answer"])).reward

