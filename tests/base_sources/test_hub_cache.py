"""Models from a local Hugging Face cache, laid out as the hub client lays it out: a snapshot
folder of links into the repository's `blobs/`, or a hub id resolved from `refs/main`, never
downloaded; a link anywhere else stays refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.stages import base
from ppo_core.base_sources.hub_cache import HubCacheError, snapshot_of
from ppo_core.config import load_config
from ppo_core.files import UnsafeCopyError
from ppo_core.models.policy import load_actor_critic

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache, hub_id: str, folder) -> object:
    """Put the model ``folder`` in ``cache`` as the hub client does: each file once in `blobs/`
    under its SHA-256, `snapshots/<commit>/` of relative links to them, `refs/main`; returns the
    snapshot folder."""
    org, name = hub_id.split("/")
    repo = cache / f"models--{org}--{name}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, repo / "blobs" / digest)
            link = snapshot / path.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(repo / "blobs" / digest, link.parent), link)
    return snapshot


@pytest.fixture
def cache(tmp_path, tiny_model_dir, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache, lay_out_hub_cache(cache, "example-org/tiny-reviews", tiny_model_dir)


def test_a_snapshot_folder_is_imported_as_regular_files(tmp_path, cache, tiny_model_dir):
    _, snapshot = cache
    assert all(path.is_symlink() for path in snapshot.iterdir())
    path = base(
        load_config(overrides=[f"base.source={snapshot}", f"model.policy={tmp_path / 'b'}"])
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert not (path / name).is_symlink()
        assert (path / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    load_actor_critic(path)


def test_a_hub_id_resolves_from_the_cache_without_a_download(tmp_path, cache):
    path = base(
        load_config(
            overrides=["base.source=example-org/tiny-reviews", f"model.policy={tmp_path / 'b'}"]
        )
    )
    record = json.loads((path / "imported_from.json").read_text())
    assert record["source"] == "example-org/tiny-reviews" and record["format"] == "folder"
    load_actor_critic(path)


def test_a_hub_id_that_is_not_cached_is_refused_by_name(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["base", "base.source=other-org/missing", "model.policy=b"])
    assert result.exit_code == 2, result.output
    assert "base.source='other-org/missing' is neither a local path nor in the Hugging Face " in (
        result.output
    )
    assert "never downloaded" in result.output and not (tmp_path / "b").exists()


def test_a_snapshot_link_outside_the_repositorys_blobs_is_refused(tmp_path, cache):
    _, snapshot = cache
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (snapshot / "vocab.txt").symlink_to(secret)
    import_refused(tmp_path, str(snapshot), UnsafeCopyError, "vocab.txt is a symbolic link")


def import_refused(tmp_path, source: str, error: type, match: str) -> None:
    """`ppo base base.source=SOURCE` raises ``error`` matching ``match``, writing nothing."""
    config = load_config(overrides=[f"base.source={source}", f"model.policy={tmp_path / 'b'}"])
    with pytest.raises(error, match=match):
        base(config)
    assert not (tmp_path / "b").exists()


def test_a_link_into_another_repositorys_blobs_is_refused(tmp_path, cache, tiny_model_dir):
    root, snapshot = cache
    other = lay_out_hub_cache(root, "example-org/other", tiny_model_dir)
    target = os.path.realpath(other / "config.json")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(target)
    config = load_config(overrides=[f"base.source={snapshot}", f"model.policy={tmp_path / 'b'}"])
    with pytest.raises(UnsafeCopyError, match="config.json is a symbolic link"):
        base(config)


def test_a_damaged_ref_names_the_cache_entry(cache):
    root, _ = cache
    (root / "models--example-org--tiny-reviews" / "refs" / "main").write_text("not a commit")
    with pytest.raises(HubCacheError, match="has no readable refs/main"):
        snapshot_of("example-org/tiny-reviews", "base.source")


def test_a_reward_model_by_hub_id_loads_from_the_cache(tmp_path, monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    from ppo_core.rewards.loading import build_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=64, num_labels=1
    )
    folder = tmp_path / "reward"
    GPT2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    lay_out_hub_cache(tmp_path / "cache", "example-org/reward", folder)
    scores = build_reward_fn("example-org/reward", "cpu")(["a film"], ["it was great"])
    assert scores.shape == (1,)


def private_folder_as_blobs(tmp_path, snapshot) -> None:
    """Make the entry's `blobs/` a link to a private folder holding a key, and a snapshot file
    a link to the key through it (the attack: the snapshot's links pass a check made against
    the real path of `blobs/`)."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_text("PRIVATE KEY")
    repo = snapshot.parent.parent
    shutil.rmtree(repo / "blobs")
    # the model's files stay reachable: they move into the private folder too
    for link in snapshot.iterdir():
        target = os.path.realpath(link)
        if os.path.exists(target):
            shutil.copyfile(target, private / os.path.basename(target))
    (repo / "blobs").symlink_to(private)
    (snapshot / "vocab.txt").symlink_to(os.path.relpath(repo / "blobs" / "id_rsa", snapshot))


@pytest.mark.parametrize("given", ["path", "hub id"])
def test_a_cache_entry_whose_blobs_are_a_link_is_refused(tmp_path, cache, given):
    _, snapshot = cache
    private_folder_as_blobs(tmp_path, snapshot)
    source = str(snapshot) if given == "path" else "example-org/tiny-reviews"
    import_refused(
        tmp_path, source, HubCacheError, "blobs' is a link, not a folder of its cache entry"
    )


def test_a_snapshot_that_is_a_link_to_another_folder_is_refused(tmp_path, cache, tiny_model_dir):
    _, snapshot = cache
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_model_dir, elsewhere)
    (elsewhere / "id_rsa").write_text("PRIVATE KEY")
    shutil.rmtree(snapshot)
    snapshot.symlink_to(elsewhere)
    with pytest.raises(HubCacheError, match="is a link, not a folder of the cache entry"):
        snapshot_of("example-org/tiny-reviews", "base.source")
    config = load_config(
        overrides=["base.source=example-org/tiny-reviews", f"model.policy={tmp_path / 'b'}"]
    )
    with pytest.raises(HubCacheError):
        base(config)
    assert not (tmp_path / "b").exists()


def test_model_code_of_a_snapshot_is_left_out_without_trust_remote_code(tmp_path, tiny_model_dir):
    folder = tmp_path / "with-code"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "modeling_custom.py").write_text("raise SystemExit('model code ran')\n")
    path = base(load_config(overrides=[f"base.source={folder}", f"model.policy={tmp_path / 'b'}"]))
    assert not (path / "modeling_custom.py").exists()
    record = json.loads((path / "imported_from.json").read_text())
    assert record["left_out"] == ["modeling_custom.py"]
