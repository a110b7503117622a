"""Pictures of a run, for people who would rather look than read."""

from __future__ import annotations

import io
from pathlib import Path

from ppo_core.files import atomic_write_bytes

CURVES = (
    ("rollout/score", "score (mean reward of the scorer)"),
    ("rollout/kl", "KL to reference (nats / sequence)"),
    ("ppo/approx_kl", "approx KL per update"),
    ("ppo/clipfrac", "clip fraction"),
    ("ppo/entropy", "entropy (nats / token)"),
    ("rollout/response_length", "response length (tokens)"),
)


def plot_training_curves(history: list[dict[str, float]], path: str | Path) -> Path:
    """Six panels of the per-iteration metrics, saved as a PNG (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
    steps = [row["iteration"] for row in history]
    for axis, (key, title) in zip(axes.flat, CURVES, strict=True):
        axis.plot(steps, [row.get(key, float("nan")) for row in history], linewidth=1.5)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    figure.suptitle("PPO training")
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    plt.close(figure)
    return atomic_write_bytes(path, image.getvalue())
