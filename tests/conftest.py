"""Test-wide settings."""

import os

import torch
from hypothesis import settings

# Tiny models run fastest on one thread, and a second process on the same cores (a parallel
# build, a DDP test) no longer makes OpenMP threads spin against each other.
torch.set_num_threads(int(os.environ.get("PPO_TEST_THREADS", "1")))

# `make test` draws the same examples on every run (derived from each test's source) and remembers
# nothing between runs, so a run passes or fails for the code alone. `make fuzz` explores: new
# random examples, PPO_FUZZ_SCALE times as many, with failures kept in .hypothesis/ and replayed
# until they are pinned with @example.
settings.register_profile("deterministic", derandomize=True, database=None, deadline=None)
settings.register_profile("fuzz", deadline=None, print_blob=True, max_examples=1000)
settings.load_profile(os.environ.get("PPO_HYPOTHESIS_PROFILE", "deterministic"))


import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A briefly warm-started tiny default: real GPT-2 and tokenizer, built locally in seconds."""
    from ppo_core.base_sources.tiny_default import build_tiny_default

    folder = tmp_path_factory.mktemp("models") / "base"
    return build_tiny_default(folder, seed=0, n_sentences=2000, steps=40, num_threads=1)


@pytest.fixture(scope="session")
def prompt_files(tmp_path_factory) -> tuple[Path, Path]:
    """Train and eval prompt files (JSONL) from the default prompt pool."""
    from ppo_core.base_sources.review_grammar import default_prompts

    folder = tmp_path_factory.mktemp("prompts")
    prompts = default_prompts(160, seed=0)
    paths = []
    for name, chunk in (("train", prompts[:128]), ("eval", prompts[128:])):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chunk))
        paths.append(path)
    return paths[0], paths[1]


# The longest tests first, so that the two workers run them side by side (tests/scheduling.py).
from tests.scheduling import pytest_collection_modifyitems  # noqa: E402, F401
