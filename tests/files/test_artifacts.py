"""The artifact files' shared readers (ppo_core/files/artifacts.py)."""

import json

from ppo_core.files.artifacts import TRAINING_SUMMARY, metric_group, read_training_summary


def test_metric_group_reads_one_side_of_a_flat_mapping():
    flat = {
        "candidate/score": 0.7,
        "candidate/kl_to_reference": 2.0,
        "baseline/score": 0.1,
        "delta/score": 0.6,
        "num_prompts": 64,
    }
    assert metric_group(flat, "candidate") == {"score": 0.7, "kl_to_reference": 2.0}
    assert metric_group(flat, "baseline") == {"score": 0.1}
    assert metric_group(flat, "production") == {}


def test_a_candidate_without_a_summary_reads_as_empty(tmp_path):
    assert read_training_summary(tmp_path) == {}
    (tmp_path / TRAINING_SUMMARY).write_text(json.dumps({"seed": 3}))
    assert read_training_summary(tmp_path) == {"seed": 3}
