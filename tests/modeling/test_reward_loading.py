"""Rewards named by the config: a user's module from the working folder, and clear failures."""

from __future__ import annotations

import sys

import pytest

from ppo_core.modeling.reward_loading import RewardError, build_reward_fn


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
