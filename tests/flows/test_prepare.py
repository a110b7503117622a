import json

import pandas as pd
import pytest

from flows.stages import prepare
from ppo_core.config import load_config
from ppo_core.modeling.data import PromptFileError


def config_for(tmp_path, *extra):
    return load_config(overrides=[f"data.raw_dir={tmp_path / 'raw'}",
                                  f"data.interim_dir={tmp_path / 'prepared'}",
                                  "data.eval_fraction=0.3", *extra])


def write_raw(tmp_path, lines):
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    (raw / "a.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))


def test_clean_dedupe_split_and_manifest(tmp_path):
    prompts = [f"The movie number {i} was" for i in range(40)]
    write_raw(tmp_path, [*prompts, "  The   movie number 3 was ", "", "   "])
    out = prepare(config_for(tmp_path))
    train = pd.read_parquet(out / "train.parquet")["prompt"].tolist()
    evals = pd.read_parquet(out / "eval.parquet")["prompt"].tolist()
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(train + evals) == sorted(prompts)
    assert not set(train) & set(evals)
    assert manifest["counts"] == {"raw": 43, "empty": 2, "duplicates": 1,
                                  "train": len(train), "eval": len(evals)}
    assert 4 <= len(evals) <= 20
    # deterministic: the same input gives the same data version
    again = prepare(config_for(tmp_path))
    assert json.loads((again / "manifest.json").read_text())["content_hash"] == manifest["content_hash"]


def test_new_data_keeps_old_prompts_on_their_side(tmp_path):
    write_raw(tmp_path, [f"Prompt {i}" for i in range(50)])
    out = prepare(config_for(tmp_path))
    before = set(pd.read_parquet(out / "eval.parquet")["prompt"])
    write_raw(tmp_path, [f"Prompt {i}" for i in range(100)])
    after = set(pd.read_parquet(prepare(config_for(tmp_path)) / "eval.parquet")["prompt"])
    assert before <= after


def test_malformed_raw_data_fails_and_keeps_the_previous_version(tmp_path):
    write_raw(tmp_path, [f"Prompt {i}" for i in range(50)])
    out = prepare(config_for(tmp_path))
    previous = (out / "manifest.json").read_text()
    with (tmp_path / "raw" / "a.jsonl").open("a") as handle:
        handle.write('{"prompt": "fine"}\n{broken\n')
    with pytest.raises(PromptFileError, match=r"a.jsonl:52: not valid JSON"):
        prepare(config_for(tmp_path))
    assert (out / "manifest.json").read_text() == previous
