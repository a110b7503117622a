"""The math-verify worker (``python -m ppo_core.rewards.math_worker SECONDS``): reads lines of
``[reply, reference]`` JSON from standard input and writes ``[score, reason]`` lines
(:class:`ppo_core.rewards.verifiers.MathAnswerChecker` starts it, and kills it when a reply
takes longer than its limit). Its first line is ``"ready"``, or the reason it cannot start."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from ppo_core.rewards.verifiers import final_answer


def judge(
    reply: str, reference: str, configs: list, limit: int, parse: Callable, verify: Callable
) -> tuple[float, str]:
    """``(1.0, "correct")`` where the reply's final answer equals the reference symbolically;
    else 0.0 with ``wrong``, ``unparsed`` (the reply states no mathematics), ``timeout``
    (math-verify's own limit) or ``error`` (the reference does not parse, or math-verify
    raised)."""
    try:
        gold = parse(as_math(reference), extraction_config=configs, parsing_timeout=limit)
        if not gold:
            return 0.0, "error"
        stated = final_answer(reply)
        said = parse(
            as_math(stated) if stated is not None else reply,
            extraction_config=configs,
            parsing_timeout=limit,
        )
        if not said:
            return 0.0, "unparsed"
        right = verify(gold, said, timeout_seconds=limit)
    except Exception as error:
        if type(error).__name__ in {"TimeoutException", "TimeoutError"}:
            return 0.0, "timeout"
        # a reply math-verify cannot handle is the reply's fault, counted
        return 0.0, "error"
    return (1.0, "correct") if right else (0.0, "wrong")


def as_math(text: str) -> str:
    """A bare answer (``42``, ``\\frac{1}{2}``, ``72.``) put in ``$...$`` so that math-verify
    reads it as LaTeX; text already holding ``$`` as it is."""
    text = text.strip().rstrip(".!;:").strip()
    return text if "$" in text else f"${text}$"


def main(argv: list[str]) -> int:
    seconds = float(argv[1]) if len(argv) > 1 else 5.0
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as error:
        print(json.dumps(f"math-verify is not installed ({error})"), flush=True)
        return 1
    configs: list[Any] = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # math-verify's own limits (signal.alarm, in this process's main thread, whole seconds)
    # end first; the parent's kill at ``seconds`` is the backstop for a stall they do not end
    limit = max(1, int(seconds) - 1)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        reply, reference = json.loads(line)
        print(json.dumps(judge(reply, reference, configs, limit, parse, verify)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
