"""Verifiers (layer 2): a reply checked against what its prompt row carries.

Each verifier returns a :class:`Verdict`, a score and a reason a report can count (``correct``,
``wrong``, ``unparsed``, ``timeout``, ``error``, ...), never an exception for a reply it cannot
read:

- :func:`exact_match`: the reply's final answer, normalised, equal to the reference's;
- :class:`MathAnswerChecker`: the final boxed, ``####`` or "answer is" expression of the reply
  against the reference, symbolically, by ``math-verify`` (Hugging Face); in a worker process
  of its own, each reply bounded in time (a reply that stalls the parser is a ``timeout``, its
  worker killed and started again);
- :func:`regex_format`, :func:`json_format`: a format, the reply matching a pattern, or
  parsing as a JSON object that holds the required keys;
- :func:`overlong_penalty`: DAPO's soft penalty on replies near the length limit (Yu et al.
  2025, "DAPO", eq. 13).

Model output is never executed: ``math-verify`` reads LaTeX with an ANTLR grammar and plain
expressions only where a pattern of digits and arithmetic operators matched them (so
``__import__`` never reaches sympy's ``parse_expr``). Only the last :data:`ANSWER_TAIL_CHARS`
characters of a reply are read for its final answer.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import subprocess
import sys
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ANSWER_TAIL_CHARS",
    "FAILED_REASONS",
    "VERDICT_REASONS",
    "MathAnswerChecker",
    "Verdict",
    "exact_match",
    "final_answer",
    "json_format",
    "normalise_answer",
    "overlong_penalty",
    "reason_counts",
    "regex_format",
]

ANSWER_TAIL_CHARS = 4096
"""How much of a reply's end is searched for its final answer (a megabyte reply costs what this
much costs)."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one reply: ``score`` (1.0 right, 0.0 wrong, or a format's
    share) and ``reason``, one word a report counts."""

    score: float
    reason: str


_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = "####"
_ANSWER_IS = re.compile(r"(?i)\banswer\s*(?:is|:)\s*")


VERDICT_REASONS = (
    "correct",
    "wrong",
    "empty",
    "unparsed",
    "matched",
    "unmatched",
    "missing_keys",
    "timeout",
    "error",
)
"""Every reason a built-in verifier gives, in the order reports list them."""

FAILED_REASONS = ("timeout", "error")
"""Verdict reasons that say the verifier failed on a reply (scored 0.0 and counted), not that
the reply was wrong."""


def reason_counts(reward_fn: object) -> dict[str, int]:
    """How many replies of the reward's last call each verdict reason covered (a built-in
    verifier's ``last_reasons``, read through the loaded reward's ``source``); ``{}`` for a
    reward that gives no reasons."""
    source = getattr(reward_fn, "source", reward_fn)
    reasons = getattr(source, "last_reasons", None)
    if not isinstance(reasons, dict):
        return {}
    return {str(k): int(v) for k, v in reasons.items() if isinstance(v, int)}


def final_answer(reply: str) -> str | None:
    """The final answer a reply states, as text: the content of its last ``\\boxed{...}``,
    else what follows its last ``####`` (GSM8K's mark), else what follows its last "answer is"
    or "answer:", up to the end of that line; None when it states none. Read from the reply's
    last :data:`ANSWER_TAIL_CHARS` characters."""
    tail = reply[-ANSWER_TAIL_CHARS:]
    boxed = list(_BOXED.finditer(tail))
    if boxed:
        start = boxed[-1].end()
        depth = 1
        for index in range(start, len(tail)):
            depth += {"{": 1, "}": -1}.get(tail[index], 0)
            if depth == 0:
                return tail[start:index].strip()
        return None  # an unclosed box
    if _HASHES in tail:
        return tail.rsplit(_HASHES, 1)[1].strip().split("\n", 1)[0].strip() or None
    said = list(_ANSWER_IS.finditer(tail))
    if said:
        return tail[said[-1].end() :].split("\n", 1)[0].strip() or None
    return None


def normalise_answer(text: str) -> str:
    """Text as answers are compared: Unicode NFKC, case folded, whitespace collapsed,
    surrounding ``$``, quotes, brackets of a lone ``\\text{}`` and final punctuation removed,
    thousands separators of a number dropped (``1,000`` is ``1000``)."""
    text = unicodedata.normalize("NFKC", text).casefold().strip()
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    text = text.strip().strip("$").strip()
    text = text.strip("\"'`").rstrip(".!?;:").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return " ".join(text.split())


def exact_match(reply: str, answer: str) -> Verdict:
    """1.0 where the reply's final answer (:func:`final_answer`; the whole reply when it states
    none) equals ``answer``, both normalised (:func:`normalise_answer`): ``correct``,
    ``wrong``, or ``empty`` for a blank reply."""
    if not reply.strip():
        return Verdict(0.0, "empty")
    stated = final_answer(reply)
    said = normalise_answer(stated if stated is not None else reply[-ANSWER_TAIL_CHARS:])
    return Verdict(1.0, "correct") if said == normalise_answer(answer) else Verdict(0.0, "wrong")


def regex_format(reply: str, pattern: str | re.Pattern[str]) -> Verdict:
    """1.0 where the whole reply (stripped) matches ``pattern`` (``re.fullmatch``, DOTALL):
    ``matched`` or ``unmatched``."""
    compiled = re.compile(pattern, re.DOTALL) if isinstance(pattern, str) else pattern
    matched = compiled.fullmatch(reply.strip()) is not None
    return Verdict(1.0, "matched") if matched else Verdict(0.0, "unmatched")


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def json_format(reply: str, keys: Sequence[str] = ()) -> Verdict:
    """1.0 where the reply (or the last fenced ```json block in it) parses as a JSON object
    holding every one of ``keys``: ``matched``; ``unparsed`` when it does not parse as an
    object, ``missing_keys`` (score: the share of keys present) when keys are missing."""
    fenced = _FENCE.findall(reply)
    text = fenced[-1] if fenced else reply
    try:
        value = json.loads(text.strip())
    except (ValueError, RecursionError):
        return Verdict(0.0, "unparsed")
    if not isinstance(value, dict):
        return Verdict(0.0, "unparsed")
    present = sum(key in value for key in keys)
    if present < len(keys):
        return Verdict(present / len(keys), "missing_keys")
    return Verdict(1.0, "matched")


def overlong_penalty(length: int, max_length: int, cache: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a reply of ``length``
    tokens: 0 up to ``max_length - cache``, then falling linearly to -1 at ``max_length``,
    and -1 past it."""
    if not 0 < cache <= max_length:
        raise ValueError(f"the cache must be in 1..{max_length}, got {cache}")
    start = max_length - cache
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache
    return -1.0


class MathAnswerChecker:
    """``math-verify`` in a worker process (``python -m ppo_core.rewards.math_worker``): each
    reply's final answer against its reference, within ``seconds`` (past it the worker is
    killed and the next reply starts a fresh one: ``timeout``). Use as a context manager, or
    call :meth:`close`."""

    def __init__(self, seconds: float = 5.0) -> None:
        if seconds <= 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        self.seconds = seconds
        self._process: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "ppo_core.rewards.math_worker", f"{self.seconds:g}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        self._process = process
        # its first line says its imports are done: a start is not a reply's time
        ready = self._read_line(START_SECONDS)
        if ready is None or json.loads(ready) != "ready":
            self.close()
            raise RuntimeError(
                f"the math-verify worker did not start in {START_SECONDS:g} s"
                + (f": {json.loads(ready)}" if ready else "")
            )
        return process

    def _read_line(self, seconds: float) -> str | None:
        process = self._process
        assert process is not None and process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], seconds)
        if not ready:
            return None
        return process.stdout.readline() or None

    def check(self, reply: str, reference: str) -> Verdict:
        """The verdict on one reply: ``correct``, ``wrong``, ``unparsed`` (no final answer, or
        one that is not mathematics), ``timeout`` or ``error`` (the reference did not parse,
        or math-verify raised)."""
        process = self._process
        if process is None or process.poll() is not None:
            process = self._start()
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps([reply[-ANSWER_TAIL_CHARS:], str(reference)]) + "\n")
            process.stdin.flush()
        except OSError:
            self.close()
            return Verdict(0.0, "error")
        line = self._read_line(self.seconds)
        if line is None:
            stalled = process.poll() is None
            self.close()  # stalled or dead: the next reply starts a fresh worker
            return Verdict(0.0, "timeout" if stalled else "error")
        score, reason = json.loads(line)
        return Verdict(float(score), str(reason))

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> MathAnswerChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


START_SECONDS = 120.0
"""Longest the worker may take to import math-verify and sympy (about 2 s)."""
