"""A reward is code, and code is never imported from a folder of models, data, checkpoints or
reports: `promote.check_reward=models.candidate.check:score` would run a file a trained model
folder brought along, because the working folder is first on the import path."""

from __future__ import annotations

import pytest

from ppo_core.config import load_config
from ppo_core.evaluation.judging import check_reward_fn
from ppo_core.parallel.runtime import setup_runtime
from ppo_core.rewards.loading import RewardError

PLANTED = "import pathlib\npathlib.Path('RAN').write_text('code from a model folder ran')\n"


@pytest.mark.parametrize(
    "spec",
    [
        "models.candidate.check:score",  # a namespace package holding the output folders
        "check:score",  # a module with the folder itself on the path
    ],
)
def test_a_check_reward_in_a_model_folder_is_refused_before_it_runs(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    candidate = tmp_path / "models" / "candidate"
    candidate.mkdir(parents=True)
    (candidate / "check.py").write_text(
        PLANTED + "def score(prompts, responses):\n    return [1.0]\n"
    )
    if spec.startswith("check"):
        monkeypatch.syspath_prepend(str(candidate))
    config = load_config(overrides=[f"promote.check_reward={spec}"])
    with pytest.raises(RewardError, match="code is never imported from there") as refused:
        check_reward_fn(config, setup_runtime(config, distributed=False))
    assert "promote.check_reward" in str(refused.value)
    assert not (tmp_path / "RAN").exists()


def test_a_reward_module_of_the_project_still_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def score(prompts, responses):\n    return [0.5]\n")
    config = load_config(overrides=["promote.check_reward=my_rewards:score"])
    scorer = check_reward_fn(config, setup_runtime(config, distributed=False))
    assert scorer(["a"], ["b"]).tolist() == [0.5]
