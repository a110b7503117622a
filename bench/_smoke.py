"""What the benchmarks' ``--smoke`` modes share. A helper, not a benchmark: files in ``bench/``
whose names start with ``_`` are imported or run by the benchmarks, and
``tests/test_bench_smoke.py`` runs every other script there.

A smoke run checks that a benchmark still runs on today's code and still measures something, in
seconds: the smallest sizes, one repeat, and its outputs in a new temporary folder (under
``$TMPDIR``), never in ``bench/results/`` or ``docs/``. Its numbers mean nothing.

The benchmarks import this module inside ``main`` (``import _smoke``: a script's own folder is
first on ``sys.path``), so that a module imported by its dotted name, as the trainer imports a
reward function ``bench.memory_scaling:varied_reward``, never needs it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

HELP = (
    "a run of a few seconds at the smallest sizes, one repeat, with its outputs in a new "
    "temporary folder: it checks that the benchmark runs; its numbers mean nothing"
)


def output_folder(name: str) -> Path:
    """A new temporary folder for the outputs of the smoke run of benchmark ``name``; it is
    kept, and its path printed, so that the run's numbers can be read afterwards.

    Also turns off transformers' progress bars (a bar per model loaded or written, read when
    transformers is first imported) for this process and its children: noise in a smoke log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    folder = Path(tempfile.mkdtemp(prefix=f"bench-smoke-{name}-"))
    print(f"smoke run: outputs go to {folder}", flush=True)
    return folder


def tiny_model(folder: Path, seed: int = 0, steps: int = 2, n_positions: int = 64) -> Path:
    """The tiny default's recipe at its smallest (one layer of width 32, a tokenizer of a few
    hundred reviews, ``steps`` training steps) saved to ``folder``: a real GPT-2 with its
    tokenizer and generation config, built in well under a second once transformers is imported.
    Two builds with the same ``seed`` share their tokenizer whatever their ``steps``."""
    from ppo_core.base_sources.tiny_default import build_tiny_default

    return build_tiny_default(
        folder,
        seed=seed,
        n_sentences=300,
        steps=steps,
        batch_size=8,
        warmup_steps=1,
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_positions=n_positions,
        num_threads=1,
    )


def prompt_files(folder: Path, n_train: int = 32, n_eval: int = 8) -> tuple[Path, Path]:
    """Train and held-out prompt files (JSONL, one ``{"prompt": ...}`` a line) from the default
    prompt pool, written to ``folder``."""
    from ppo_core.base_sources.review_grammar import default_prompts

    folder.mkdir(parents=True, exist_ok=True)
    prompts = default_prompts(n_train + n_eval, seed=0)
    paths = (folder / "train.jsonl", folder / "eval.jsonl")
    for path, chosen in zip(paths, (prompts[:n_train], prompts[n_train:]), strict=True):
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen))
    return paths
