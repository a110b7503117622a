"""Rewards named by the config: a user's module from the working folder, and clear failures."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
import torch

from ppo_core.rewards.loading import RewardError, RewardTimeoutError, build_reward_fn


def test_a_module_in_the_working_folder_is_imported(tmp_path, monkeypatch):
    (tmp_path / "my_reward_module.py").write_text(
        "def score(prompts, responses):\n    return [float(len(r)) for r in responses]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_reward_module", raising=False)
    path_before = list(sys.path)
    reward = build_reward_fn("my_reward_module:score")
    assert reward(["a", "b"], ["xy", "xyz"]).tolist() == [2.0, 3.0]
    assert sys.path == path_before  # the working folder was searched, not left on the path


def test_a_missing_module_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as caught:
        build_reward_fn("no_such_reward_module:score")
    message = str(caught.value)
    assert "model.reward='no_such_reward_module:score'" in message
    assert f"looked in the working folder {tmp_path}" in message


def test_a_module_without_the_function_is_named(tmp_path, monkeypatch):
    (tmp_path / "other_reward_module.py").write_text(
        "def rate(prompts, responses):\n    return []\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "other_reward_module", raising=False)
    with pytest.raises(RewardError, match=r"other_reward_module has no callable 'score'"):
        build_reward_fn("other_reward_module:score")


def test_the_afinn_check_reward_hand_computed():
    check = build_reward_fn("builtin:afinn", key="promote.check_reward")
    # AFINN-165: great +3, boring -3, dull -2; plain prompts are scored with their response, a
    # chat's response alone
    chat = [{"role": "user", "content": "A terrible film?"}]
    scores = check(["It was", "It was", chat], [" great.", " dull and boring.", " great"])
    assert scores.tolist() == pytest.approx([math.tanh(3 / 5), math.tanh(-5 / 5), math.tanh(3 / 5)])


def test_a_reward_error_names_the_key_that_set_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as caught:
        build_reward_fn("builtin:vibes", key="promote.check_reward")
    assert str(caught.value) == (
        "promote.check_reward='builtin:vibes' is not a built-in reward; the built-in ones are "
        "builtin:sentiment, builtin:afinn, builtin:exact_match, builtin:math_answer, "
        "builtin:reasoning_gym"
    )
    with pytest.raises(RewardError, match=r"^promote.check_reward='no_such_module:f': cannot"):
        build_reward_fn("no_such_module:f", key="promote.check_reward")


# --- the watchdog (model.reward_timeout) ---------------------------------------------------------


class _Hanging:
    """Stands in for any reward: records the thread that calls it, then waits until released."""

    def __init__(self):
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, prompts, responses):
        self.threads.append(threading.current_thread())
        self.release.wait(60)
        return [1.0] * len(prompts)


@pytest.fixture
def hanging():
    reward = _Hanging()
    yield reward
    reward.release.set()  # ends the abandoned call


@pytest.mark.parametrize("kind", ["module", "builtin", "folder"])
def test_every_kind_of_reward_is_stopped_after_the_timeout(kind, hanging, tmp_path, monkeypatch):
    """The watchdog wraps the reward function whatever built it: a user's function, the built-in
    scorer and a reward-model folder (their loaders are replaced by the hanging stand-in)."""
    from ppo_core.rewards import loading as reward_loading
    from ppo_core.rewards import scorers as rewards

    if kind == "module":
        (tmp_path / "hanging_reward_module.py").write_text(
            "import threading\nRELEASE = threading.Event()\n"
            "def score(prompts, responses):\n    RELEASE.wait(60)\n    return [0.0] * len(prompts)\n"
        )
        monkeypatch.chdir(tmp_path)
        monkeypatch.delitem(sys.modules, "hanging_reward_module", raising=False)
        spec = "hanging_reward_module:score"
    elif kind == "builtin":
        monkeypatch.setitem(rewards.BUILTIN_REWARDS.entries, "builtin:sentiment", lambda: hanging)
        spec = "builtin:sentiment"
    else:
        (tmp_path / "reward-model").mkdir()
        monkeypatch.setattr(reward_loading, "_RewardModel", lambda *args: hanging)
        spec = str(tmp_path / "reward-model")
    reward = build_reward_fn(spec, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RewardTimeoutError) as caught:
        reward(["a", "b"], ["x", "y"])
    waited = time.monotonic() - started
    assert 0.5 <= waited < 5.0
    assert isinstance(caught.value, RewardError)  # so `ppo` prints one line and exits with 2
    assert str(caught.value) == (
        f"the reward {spec!r} did not return within 0.5 s (model.reward_timeout=0.5) for a batch "
        "of 2 responses; fix or speed up the reward, or raise model.reward_timeout (0 waits "
        "without limit)"
    )
    if kind == "module":
        sys.modules["hanging_reward_module"].RELEASE.set()
    else:
        [thread] = hanging.threads
        assert thread is not threading.main_thread() and thread.daemon


def test_a_reward_within_the_timeout_returns_its_scores_and_errors(monkeypatch):
    from ppo_core.rewards import scorers as rewards

    calls = []

    def fine(prompts, responses):
        calls.append(torch.is_grad_enabled())
        return [float(len(r)) for r in responses]

    monkeypatch.setitem(rewards.BUILTIN_REWARDS.entries, "builtin:sentiment", lambda: fine)
    reward = build_reward_fn("builtin:sentiment", timeout=5)
    with torch.no_grad():
        assert reward(["a"], ["xyz"]).tolist() == [3.0]
    assert calls == [False]  # the caller's grad mode holds in the watchdog's thread

    def broken(prompts, responses):
        raise RuntimeError("scorer backend is down")

    monkeypatch.setitem(rewards.BUILTIN_REWARDS.entries, "builtin:sentiment", lambda: broken)
    with pytest.raises(RewardError, match=r"raised RuntimeError: scorer backend is down"):
        build_reward_fn("builtin:sentiment", timeout=5)(["a"], ["b"])


def test_no_timeout_calls_the_reward_in_the_calling_thread(monkeypatch):
    from ppo_core.rewards import scorers as rewards

    seen = []

    def slow(prompts, responses):
        seen.append(threading.current_thread())
        time.sleep(0.3)
        return [0.0] * len(prompts)

    monkeypatch.setitem(rewards.BUILTIN_REWARDS.entries, "builtin:sentiment", lambda: slow)
    assert build_reward_fn("builtin:sentiment", timeout=0)(["a"], ["b"]).tolist() == [0.0]
    assert seen == [threading.current_thread()]


def test_a_negative_reward_timeout_is_refused(tiny_model_dir):
    from ppo_core.config import ConfigError, ModelConfig, load_config
    from ppo_core.experience.judges import build_reward

    with pytest.raises(ConfigError, match=r"model.reward_timeout must be >= 0, got -1"):
        load_config(overrides=["model.reward_timeout=-1"])
    # and a ModelConfig built in code, which no load checked
    with pytest.raises(ConfigError, match=r"model.reward_timeout must be >= 0 \(0: no limit\)"):
        build_reward(ModelConfig(reward_timeout=-1), torch.device("cpu"))
