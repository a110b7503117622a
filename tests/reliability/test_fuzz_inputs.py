"""Fuzzed raw prompt files and configs: every bad case ends in one clear error that names the file
and line (or the config key), never a traceback, and nothing prepared earlier is overwritten."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from flows.stages import prepare
from ppo_core.config import ConfigError, load_config
from ppo_core.modeling.data import MAX_LINE_BYTES, PromptFileError, load_prompts

GOOD = [f"I thought the movie number {i} was" for i in range(40)]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
record = st.one_of(
    st.fixed_dictionaries({"prompt": json_values}),  # wrong types under the right key
    st.dictionaries(st.sampled_from(["prompt", "text", "Prompt", ""]), json_values, max_size=2),
    json_values,  # not an object at all
).map(lambda v: json.dumps(v).encode() + b"\n")
lines = st.one_of(
    record,
    st.binary(max_size=60),  # random bytes, mostly invalid UTF-8 or invalid JSON
    st.sampled_from([b"\xff\xfe\n", b'{"prompt": "\\ud800"}\n', b"[" * 5000 + b"\n",
                     b'{"prompt": NaN}\n', b"\n", b"   \n", b'{"prompt": "ok"']),
)
raw_files = st.lists(lines, max_size=6).map(b"".join)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "raw").mkdir()
    (root / "raw" / "a_good.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GOOD))
    config = load_config(overrides=[f"data.raw_dir={root / 'raw'}",
                                    f"data.interim_dir={root / 'prepared'}", "data.eval_fraction=0.3"])
    prepare(config)
    return root, config


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.too_slow])
@given(content=raw_files, parquet=st.booleans())
def test_fuzzed_raw_files_fail_cleanly_and_keep_the_prepared_version(project, content, parquet):
    root, config = project
    bad = root / "raw" / ("b_fuzz.parquet" if parquet else "b_fuzz.jsonl")
    bad.write_bytes(content)
    before = snapshot(root / "prepared")
    try:
        prepare(config)
    except PromptFileError as exc:
        message = str(exc)
        assert str(bad) in message, message
        if not parquet and any(c.isdigit() for c in message.split(str(bad))[1][:3]):
            assert f"{bad}:" in message  # a line error reads file:line
        assert snapshot(root / "prepared") == before
    else:  # the fuzzer wrote a valid file: the new version must load back
        load_prompts(root / "prepared" / "train.parquet")
    finally:
        bad.unlink()
        # restore the good version for the next example
        if snapshot(root / "prepared") != before:
            shutil.rmtree(root / "prepared")
            prepare(config)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "no prompts"),
        (b"\xff\xfe\xfa\n", ":1: not valid UTF-8"),
        (b'{"prompt": "fine"}\n{"text": "x"}\n', ":2: field 'prompt' is missing"),
        (b'{"prompt": 3}\n', ":1: field 'prompt' is missing or not a non-empty string"),
        (b"[1, 2]\n", ":1: expected a JSON object, got list"),
        (b"[" * 100_000 + b"\n", ":1: JSON nested too deeply"),
        (b'{"prompt": "\\ud800 lone"}\n', ":1: field 'prompt' holds a lone UTF-16 surrogate"),
        (b'{"prompt": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n', ":1: line longer than the limit"),
    ],
)
def test_each_bad_input_kind_is_named(tmp_path, content, expected):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=None) as info:
        load_prompts(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_a_damaged_parquet_file_is_named(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(PromptFileError, match="not a readable parquet file"):
        load_prompts(path)


def test_the_cli_prints_one_line_and_no_traceback(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(b'{"prompt": "fine"}\n\xff\n')
    result = CliRunner().invoke(app, ["prepare", f"data.raw_dir={raw}",
                                      f"data.interim_dir={tmp_path / 'out'}"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and f"{raw / 'a.jsonl'}:2" in result.output
    assert not (tmp_path / "out").exists()


# Config fuzzing: any key (real or not) with any value either loads or raises ConfigError.
KEYS = ["seed", "ppo.rollout_batch_size", "ppo.mini_batch_size", "ppo.micro_batch_size",
        "ppo.epochs", "ppo.clip_eps", "ppo.lam", "ppo.loss_agg_mode", "kl.estimator", "kl.coef",
        "optim.lr", "optim.name", "optim.betas", "generation.top_p", "generation.max_new_tokens",
        "train.iterations", "device", "precision", "model.critic", "ppo", "data", "nope",
        "ppo.nope", "ppo.epochs.deeper"]
values = st.one_of(
    st.integers(-3, 300).map(str), st.floats(allow_nan=True).map(str),
    st.sampled_from(["null", "true", "[]", "[1,2]", "{}", "k3", "token-mean", "abc", "", "1e-4",
                     "inf", "-0", "${oops}", "[0.9,0.95]"]),
    st.text(string.printable, max_size=8),
)


@settings(max_examples=400)
@given(overrides=st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=3))
def test_fuzzed_configs_load_or_fail_with_a_config_error(overrides):
    try:
        config = load_config(overrides=[f"{k}={v}" for k, v in overrides])
    except ConfigError as exc:
        message = str(exc)  # names an override's key, or the batch-size rule it breaks
        named = [k for k, _ in overrides if k.split(".")[-1] in message or k.split(".")[0] in message]
        assert named or "batch" in message, message
        assert "\n" not in message.strip(), message
        return
    ppo = config.ppo  # whatever loads is consistent
    assert ppo.rollout_batch_size >= ppo.mini_batch_size >= ppo.micro_batch_size > 0
    assert ppo.mini_batch_size % ppo.micro_batch_size == 0 and ppo.epochs > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ppo.rollout_batch_size=0"], "rollout_batch_size must be a positive integer, got 0"),
        (["ppo.micro_batch_size=-4"], "micro_batch_size must be a positive integer, got -4"),
        (["ppo.micro_batch_size=32"], "micro_batch_size=32"),
        (["ppo.mini_batch_size=128"], "mini_batch_size=128 is larger than rollout_batch_size=64"),
        (["precision=fp8"], "precision"),
        (["model.critic=twin"], "model.critic"),
        (["ppo.epochs=two"], "ppo.epochs"),
        (["optim.lr=-1"], "optim.lr"),
        (["kl.coef=nan"], "kl.coef"),
    ],
)
def test_named_config_mistakes(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(overrides=overrides)
