"""The embedded default, end to end: warm-started tiny GPT-2, PPO with params.yaml, held-out
evaluation. The trained policy must be positive without buying it with degenerate text."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_core.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_run_makes_reviews_positive_within_budget(tmp_path):
    from flows import stages
    from ppo_core.evaluation.evaluate import evaluate

    out = tmp_path
    config = load_config(
        ROOT / "params.yaml",
        [
            f"data.raw_dir={ROOT / 'data' / 'raw'}",
            f"data.interim_dir={out / 'interim'}",
            f"data.prepared_dir={out / 'prepared'}",
            f"data.train_file={out / 'interim' / 'train.parquet'}",
            f"data.eval_file={out / 'interim' / 'eval.parquet'}",
            f"model.policy={out / 'base'}",
            f"train.output_dir={out / 'candidate'}",
            f"train.checkpoint_dir={out / 'checkpoints'}",
            f"train.metrics_dir={out / 'metrics'}",
            f"eval.output_dir={out / 'eval'}",
        ],
    )
    stages.prepare(config)
    stages.base(config)
    from ppo_core.training.loop import train

    train(config)
    reports = evaluate(config, out / "candidate", out / "base")
    trained, base = reports["candidate"].metrics, reports["baseline"].metrics
    assert trained["num_samples"] >= 128  # 64 held-out prompts x 2 samples
    assert base["score"] < 0.3
    assert trained["score"] >= 0.7
    assert trained["positive_rate"] >= 0.9
    assert trained["kl_to_reference"] <= 4.0
    assert trained["eos_rate"] >= 0.85
    assert trained["distinct_2"] >= 0.35
    assert (out / "eval" / "report.md").is_file()
