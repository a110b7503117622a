"""Verifiers: a reply against the answer its row carries (math-verify in a worker process,
exact match, formats, DAPO's overlong penalty); hostile replies end in a counted verdict within
the time bound, never in an exception or in code being run."""

from __future__ import annotations

import time

import pytest

from ppo_core.rewards.verifiers import (
    MathAnswerChecker,
    Verdict,
    exact_match,
    final_answer,
    json_format,
    normalise_answer,
    overlong_penalty,
    regex_format,
)


@pytest.mark.parametrize(
    ("reply", "stated"),
    [
        ("so it is \\boxed{\\frac{1}{2}} then", "\\frac{1}{2}"),
        ("first \\boxed{1}, finally \\boxed{x^{2}}", "x^{2}"),
        ("48 + 24 = 72\n#### 72", "72"),
        ("The answer is 72.\nThanks", "72."),
        ("Answer: seven", "seven"),
        ("no answer stated", None),
        ("\\boxed{1", None),  # an unclosed box
    ],
)
def test_the_final_answer_a_reply_states(reply, stated):
    assert final_answer(reply) == stated


def test_exact_match_compares_normalised_final_answers():
    assert normalise_answer("  The Answer.  ") == "the answer"
    assert normalise_answer("1,000") == "1000" and normalise_answer("$42$") == "42"
    assert exact_match("The answer is Paris.", "paris") == Verdict(1.0, "correct")
    assert exact_match("#### 1,000", "1000") == Verdict(1.0, "correct")
    assert exact_match("London", "Paris") == Verdict(0.0, "wrong")
    assert exact_match("   ", "Paris") == Verdict(0.0, "empty")


def test_formats_and_the_overlong_penalty():
    assert regex_format(" <think>a</think> 4 ", r"<think>.*</think>\s*\d+") == Verdict(
        1.0, "matched"
    )
    assert regex_format("4", r"<think>.*</think>\s*\d+").reason == "unmatched"
    assert json_format('{"name": "x", "age": 3}', ["name", "age"]) == Verdict(1.0, "matched")
    assert json_format('Here:\n```json\n{"name": "x"}\n```', ["name", "age"]) == Verdict(
        0.5, "missing_keys"
    )
    assert json_format("[1, 2]", ["name"]).reason == "unparsed"
    assert json_format("{" * 100_000, ["name"]).reason == "unparsed"  # nesting, not a crash
    # DAPO eq. 13 with L_max 20, L_cache 4: 0 up to 16 tokens, -(L - 16)/4 to 20, -1 past
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 18, 20, 21)] == [0, 0, -0.5, -1, -1]
    with pytest.raises(ValueError, match="cache"):
        overlong_penalty(3, 20, 0)


@pytest.fixture(scope="module")
def checker():
    with MathAnswerChecker(seconds=3) as math:
        yield math


@pytest.mark.parametrize(
    ("reply", "reference", "reason"),
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", "correct"),  # symbolically, not as text
        ("48+24 = 72 clips.\n#### 72", "72", "correct"),
        ("The answer is 72.", "72", "correct"),
        ("I think 2x+2x = 4x, the answer is \\boxed{4x}", "2x \\cdot 2", "correct"),
        ("the answer is \\boxed{71}", "72", "wrong"),
        ("I do not know", "72", "unparsed"),
        ("\\boxed{1}", "", "error"),  # a reference that states nothing
    ],
)
def test_math_answers_against_the_reference(checker, reply, reference, reason):
    assert checker.check(reply, reference).reason == reason


def test_replies_built_to_stall_or_to_run_code_stay_within_the_bound(checker, tmp_path):
    """A tower of powers, thousands of nested brackets, a megabyte reply and Python that would
    write a file if it were run: each a verdict within the 3 s bound (plus a restart), none
    raising, nothing run; the checker still judges the next reply."""
    planted = tmp_path / "ran"
    hostile = [
        "\\boxed{2^{2^{2^{2^{2^{2^{2^{2}}}}}}}}",
        "\\boxed{10**10**10}",
        "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
        "x" * 2_000_000 + " so the answer is 5",
        f"__import__('pathlib').Path('{planted}').touch() the answer is 3",
    ]
    for reply in hostile:
        started = time.perf_counter()
        verdict = checker.check(reply, "5")
        assert time.perf_counter() - started < 3 + 10, verdict  # 10 s: a worker's restart
        assert verdict.score in (0.0, 1.0) and verdict.reason
    assert not planted.exists()
    assert checker.check("\\boxed{5}", "5") == Verdict(1.0, "correct")


def test_a_worker_past_its_time_is_killed_and_counted(tmp_path):
    """The parent's bound holds even where math-verify's own does not end a stall: a worker
    that never answers (here, SIGSTOPped) is a ``timeout`` after ``seconds``, and the next
    reply is judged by a fresh worker."""
    import os
    import signal

    with MathAnswerChecker(seconds=1) as checker:
        assert checker.check("\\boxed{2}", "2").reason == "correct"
        assert checker._process is not None
        os.kill(checker._process.pid, signal.SIGSTOP)
        started = time.perf_counter()
        assert checker.check("\\boxed{2}", "2") == Verdict(0.0, "timeout")
        assert time.perf_counter() - started < 2
        assert checker.check("\\boxed{3}", "3") == Verdict(1.0, "correct")


# -- rewards that take the rows' reference fields -----------------------------------------------


def answer_reward(prompts, responses, *, answer, **rest):
    """A user's reward in TRL's style: the reference field as a keyword."""
    return [float(r.strip() == a) for r, a in zip(responses, answer, strict=True)]


def two_argument_reward(prompts, responses):
    return [float(len(r)) for r in responses]


def reward_asking_for_tests(prompts, responses, tests):
    return [0.0 for _ in responses]


def test_rewards_take_the_reference_fields_they_name_and_two_arguments_still_work():
    """A keyword reward gets its fields (read from its signature once, at load); a
    two-argument one is called as before; a reward asking for a field the rows lack fails at
    load, naming it; built-in verifiers score against ``answer`` and count their reasons."""
    from ppo_core.rewards.loading import RewardError, build_reward_fn

    references = {"answer": ["4", "5"], "source": ["a", "b"]}
    fields = ["answer", "source"]
    keyword = build_reward_fn(f"{__name__}:answer_reward", reference_fields=fields)
    assert keyword(["2+2", "2+3"], [" 4", "6"], references).tolist() == [1.0, 0.0]
    plain = build_reward_fn(f"{__name__}:two_argument_reward", reference_fields=fields)
    assert plain(["p", "q"], ["ab", "c"], references).tolist() == [2.0, 1.0]
    assert plain(["p"], ["abc"]).tolist() == [3.0]  # no references at all
    with pytest.raises(RewardError, match=r"asks for the keyword 'tests'.*answer, source"):
        build_reward_fn(f"{__name__}:reward_asking_for_tests", reference_fields=fields)
    with pytest.raises(RewardError, match=r"asks for the keyword 'answer'.*: none"):
        build_reward_fn(f"{__name__}:answer_reward")
    with pytest.raises(RewardError, match=r"takes the reference field 'answer'"):
        keyword(["p"], ["4"], {"source": ["a"]})

    exact = build_reward_fn("builtin:exact_match", reference_fields=["answer"])
    assert exact(["q", "q"], ["The answer is 4.", "five"], references).tolist() == [1.0, 0.0]
    math = build_reward_fn("builtin:math_answer", reference_fields=["answer"])
    scores = math(["q"] * 3, ["\\boxed{4}", "#### 5.0", "no idea"], {"answer": ["4", "5", "6"]})
    assert scores.tolist() == [1.0, 1.0, 0.0]
