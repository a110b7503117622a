import json
import re

import pandas as pd
import pytest

from flows.stages import prepare
from ppo_core.config import load_config
from ppo_core.prompts import PromptFileError


def config_for(tmp_path, *extra):
    return load_config(
        overrides=[
            f"data.raw_dir={tmp_path / 'raw'}",
            f"data.interim_dir={tmp_path / 'prepared'}",
            "data.eval_fraction=0.3",
            *extra,
        ]
    )


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
    assert manifest["counts"] == {
        "raw": 43,
        "empty": 2,
        "duplicates": 1,
        "train": len(train),
        "eval": len(evals),
    }
    assert 4 <= len(evals) <= 20
    # deterministic: the same input gives the same data version
    again = prepare(config_for(tmp_path))
    assert (
        json.loads((again / "manifest.json").read_text())["content_hash"]
        == manifest["content_hash"]
    )


def test_new_data_keeps_old_prompts_on_their_side(tmp_path):
    def sides(out):
        return tuple(
            set(pd.read_parquet(out / f"{split}.parquet")["prompt"]) for split in ("train", "eval")
        )

    write_raw(tmp_path, [f"Prompt {i}" for i in range(50)])
    train_before, eval_before = sides(prepare(config_for(tmp_path)))
    # new prompts first: the split does not depend on a prompt's position in the files
    write_raw(
        tmp_path, [f"Prompt {i}" for i in range(100, 50, -1)] + [f"Prompt {i}" for i in range(50)]
    )
    train_after, eval_after = sides(prepare(config_for(tmp_path)))
    assert train_before < train_after and eval_before < eval_after  # both sides got new prompts
    assert not train_after & eval_after


def test_malformed_raw_data_fails_and_keeps_the_previous_version(tmp_path):
    write_raw(tmp_path, [f"Prompt {i}" for i in range(50)])
    out = prepare(config_for(tmp_path))
    previous = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with (tmp_path / "raw" / "a.jsonl").open("a") as handle:
        handle.write('{"prompt": "fine"}\n{broken\n')
    with pytest.raises(PromptFileError) as info:
        prepare(config_for(tmp_path))
    raw = tmp_path / "raw" / "a.jsonl"
    assert (
        str(info.value)
        == f"{raw}:52: not valid JSON (Expecting property name enclosed in double quotes)"
    )
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "raw"]  # no temporary folder


def test_a_raw_file_over_the_row_cap_fails_naming_the_file_and_the_key(tmp_path):
    write_raw(tmp_path, [f"Prompt {i}" for i in range(40)])
    with pytest.raises(PromptFileError) as info:
        prepare(config_for(tmp_path, "data.max_rows_per_file=30"))
    assert str(info.value) == (
        f"{tmp_path / 'raw' / 'a.jsonl'}:31: more than data.max_rows_per_file=30 prompts; "
        "split the file or raise the limit"
    )
    assert not (tmp_path / "prepared").exists()


def test_a_raw_file_over_the_byte_cap_fails_naming_the_file_and_the_key(tmp_path):
    write_raw(tmp_path, [f"Prompt {i}" for i in range(40)])
    raw = tmp_path / "raw" / "a.jsonl"
    with pytest.raises(PromptFileError) as info:
        prepare(config_for(tmp_path, "data.max_bytes_per_file=100"))
    assert str(info.value) == (
        f"{raw}: {raw.stat().st_size} bytes, more than data.max_bytes_per_file=100; "
        "split the file or raise the limit"
    )


def test_a_split_over_the_row_cap_fails_before_anything_is_written(tmp_path):
    """Each file is under the cap, the train split is not: `ppo train` could not read it."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in "abc":
        lines = [json.dumps({"prompt": f"Prompt {name} {i}"}) + "\n" for i in range(20)]
        (raw / f"{name}.jsonl").write_text("".join(lines))
    with pytest.raises(PromptFileError) as info:
        prepare(config_for(tmp_path, "data.max_rows_per_file=20"))
    assert re.match(
        rf"{re.escape(str(tmp_path))}/prepared/train\.parquet would hold \d+ ", str(info.value)
    )
    assert str(info.value).endswith(
        "data.max_rows_per_file=20, so `ppo train` could not read it; raise the limit"
    )
    assert not (tmp_path / "prepared").exists()


@pytest.mark.parametrize("inside", [True, False])
def test_the_manifest_names_sources_relative_to_the_working_folder(tmp_path, monkeypatch, inside):
    """Absolute paths would record the user's folders in a file that DVC shares."""
    write_raw(tmp_path, [f"Prompt {i}" for i in range(40)])
    cwd = tmp_path if inside else tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    out = prepare(config_for(tmp_path))  # data.raw_dir is absolute
    (source,) = json.loads((out / "manifest.json").read_text())["sources"]
    assert source["file"] == ("raw/a.jsonl" if inside else "a.jsonl")
    monkeypatch.chdir(tmp_path)
    relative = prepare(config_for(tmp_path, "data.raw_dir=raw"))  # as configured when relative
    assert json.loads((relative / "manifest.json").read_text())["sources"][0]["file"] == (
        "raw/a.jsonl"
    )


def test_a_split_over_the_byte_cap_fails_and_leaves_nothing(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in "abc":
        lines = [json.dumps({"prompt": f"Prompt {name} {i}"}) + "\n" for i in range(20)]
        (raw / f"{name}.jsonl").write_text("".join(lines))
    assert max(path.stat().st_size for path in raw.iterdir()) < 600
    with pytest.raises(PromptFileError) as info:
        prepare(config_for(tmp_path, "data.max_bytes_per_file=600"))
    assert re.fullmatch(
        rf"{re.escape(str(tmp_path))}/prepared/train\.parquet would hold \d+ bytes uncompressed, "
        r"more than data\.max_bytes_per_file=600, so `ppo train` could not read it; raise the "
        r"limit",
        str(info.value),
    ), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no temporary folder either
