"""The reward-model registry (``ppo_core/registry/rewards.py``): versions r0001, r0002, ... are
numbered by promotion, a rejection changes nothing, a version changed on disk or an edited
registry is refused by name, and a promotion killed at any step is finished or abandoned by the
next write so that nothing needs a hand edit."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppo_core.files import tree_sha256
from ppo_core.registry.rewards import (
    RewardRegistryError,
    check_reward_version,
    current_reward,
    load_reward_registry,
    record_reward_decision,
    resolve_reward_spec,
    roll_back_reward,
)

ROOT = Path(__file__).resolve().parents[2]
ENTRY = {"reasons": ["PASS: accuracy"], "data_hash": "abc", "score_mean": 0.25, "score_std": 2.0}


def model_folder(tmp_path: Path, name: str, weights: str) -> Path:
    """A stand-in for a reward model folder: a config and a small weights file."""
    folder = tmp_path / "candidates" / name
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_labels": 1}))
    (folder / "sub" / "model.safetensors").write_text(weights)
    return folder


def promote(versions: Path, tmp_path: Path, weights: str, passes: bool = True) -> dict:
    return record_reward_decision(
        versions, model_folder(tmp_path, weights, weights), passes, {**ENTRY, "data_hash": weights}
    )


def listing(versions: Path) -> list[str]:
    """The folder's entries, the registry's lock file aside."""
    return sorted(p.name for p in versions.iterdir() if p.name != ".registry.json.lock")


def test_promotions_are_numbered_and_a_rejection_records_no_version(tmp_path):
    versions = tmp_path / "rewards"
    assert current_reward(versions) is None
    first = promote(versions, tmp_path, "w1")
    assert first["decision"] == "promoted" and first["version"] == "r0001"
    assert first["content_sha256"] == tree_sha256(versions / "r0001")

    rejected = promote(versions, tmp_path, "w2", passes=False)
    assert rejected["decision"] == "rejected"
    assert not {"version", "path", "content_sha256"} & rejected.keys()
    current = current_reward(versions)
    assert current is not None and current.name == "r0001"
    assert (current.score_mean, current.score_std) == (0.25, 2.0)
    assert listing(versions) == ["r0001", "registry.json"]

    second = promote(versions, tmp_path, "w3")
    assert second["version"] == "r0002"
    assert (versions / "r0002" / "sub" / "model.safetensors").read_text() == "w3"
    registry = load_reward_registry(versions)
    assert registry["current"] == "r0002"
    assert [e["decision"] for e in registry["entries"]] == ["promoted", "rejected", "promoted"]
    assert [e["data_hash"] for e in registry["entries"]] == ["w1", "w2", "w3"]
    assert listing(versions) == ["r0001", "r0002", "registry.json"]


@pytest.mark.parametrize("change", ["edited", "added", "added link"])
def test_a_version_changed_on_disk_is_refused_naming_its_folder(tmp_path, change):
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    promote(versions, tmp_path, "w2")
    folder = versions / "r0001"
    if change == "edited":
        (folder / "sub" / "model.safetensors").write_text("wX")
    elif change == "added":
        (folder / "extra.bin").write_text("")
    else:
        (folder / "extra.bin").symlink_to(folder / "config.json")
    refused = f"reward version r0001 in {folder} no longer matches the content hash"
    for lookup in (
        lambda: check_reward_version(versions, "r0001"),
        lambda: resolve_reward_spec("reward:r0001", versions, "model.reward"),
        lambda: roll_back_reward(versions, "r0001", "r0002 regressed", "ops"),
    ):
        with pytest.raises(RewardRegistryError, match=refused) as raised:
            lookup()
        assert "\n" not in str(raised.value)
    # the current version is checked the same way
    (versions / "r0002" / "config.json").write_text("{}")
    for lookup in (
        lambda: current_reward(versions),
        lambda: resolve_reward_spec("reward:current", versions, "model.reward"),
    ):
        with pytest.raises(RewardRegistryError, match=f"r0002 in {versions / 'r0002'} no longer"):
            lookup()
    assert load_reward_registry(versions)["current"] == "r0002"


def test_reward_specs_resolve_to_checked_versions(tmp_path):
    versions = tmp_path / "rewards"
    with pytest.raises(RewardRegistryError) as raised:
        resolve_reward_spec("reward:current", versions, "model.reward")
    message = str(raised.value)
    assert message.startswith("model.reward='reward:current', but ")
    assert "no current reward version yet" in message and "`ppo reward`" in message
    assert not versions.exists()  # a lookup writes nothing

    promote(versions, tmp_path, "w1")
    promote(versions, tmp_path, "w2")
    current = resolve_reward_spec("reward:current", versions, "model.reward")
    assert current is not None and current.name == "r0002" and current.spec == "reward:r0002"
    earlier = resolve_reward_spec("reward:r0001", versions, "model.reward")
    assert earlier is not None and earlier.folder == versions / "r0001"
    for spec in ("reward:bad", "reward:r1", "reward:", "reward:../r0001"):
        with pytest.raises(RewardRegistryError, match=r"^eval\.check_reward="):
            resolve_reward_spec(spec, versions, "eval.check_reward")
    with pytest.raises(RewardRegistryError, match="has no promoted version r0009"):
        resolve_reward_spec("reward:r0009", versions, "model.reward")
    for other in ("builtin:afinn", "models/rm", "sentiment:distilbert", "rewards:r0001"):
        assert resolve_reward_spec(other, versions, "model.reward") is None


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.update(current="../x"),
        lambda r: r["entries"][0].update(version="../x"),
        lambda r: r["entries"][0].update(version="r0001/../../x"),
        lambda r: r.update(current="/tmp/r0001"),
        lambda r: r.update(current="r0001\n"),
    ],
)
def test_an_edited_registry_cannot_name_a_folder_elsewhere(tmp_path, edit):
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    registry = json.loads((versions / "registry.json").read_text())
    edit(registry)
    (versions / "registry.json").write_text(json.dumps(registry))
    before = (versions / "registry.json").read_bytes()
    for action in (
        lambda: load_reward_registry(versions),
        lambda: current_reward(versions),
        lambda: check_reward_version(versions, "r0001"),
        lambda: promote(versions, tmp_path, "w2"),
        lambda: roll_back_reward(versions, "r0001", "why", "ops"),
    ):
        with pytest.raises(RewardRegistryError, match="reward versions are r0001, r0002"):
            action()
        shutil.rmtree(tmp_path / "candidates", ignore_errors=True)
    assert (versions / "registry.json").read_bytes() == before
    assert listing(versions) == ["r0001", "registry.json"]


@pytest.mark.parametrize(
    "stats",
    [
        {"score_mean": None},
        {"score_std": None},
        {"score_std": 0.0},
        {"score_std": -1.0},
        {"score_std": "2.0"},
        {"score_mean": float("nan")},
        {"score_std": float("nan")},
        {"score_mean": float("inf")},
        {"score_std": float("inf")},
        {"score_mean": True},
    ],
)
def test_a_version_without_usable_normalisation_is_refused(tmp_path, stats):
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    registry = json.loads((versions / "registry.json").read_text())
    for key, value in stats.items():
        if value is None:
            del registry["entries"][0][key]
        else:
            registry["entries"][0][key] = value
    (versions / "registry.json").write_text(json.dumps(registry))
    with pytest.raises(RewardRegistryError, match="r0001 records no usable normalisation"):
        current_reward(versions)
    with pytest.raises(RewardRegistryError, match="no usable normalisation"):
        resolve_reward_spec("reward:r0001", versions, "model.reward")


def test_a_passing_model_without_usable_normalisation_is_not_promoted(tmp_path):
    """Checked before anything is copied: promoted, it would make ``reward:current`` unusable."""
    versions = tmp_path / "rewards"
    candidate = model_folder(tmp_path, "c", "w1")
    for stats in ({"score_std": 0.0}, {"score_mean": float("nan")}, {"score_std": None}):
        with pytest.raises(RewardRegistryError, match="no usable normalisation.*nothing was"):
            record_reward_decision(versions, candidate, True, {**ENTRY, **stats})
    assert listing(versions) == []
    # a rejection records whatever was measured
    assert promote(versions, tmp_path, "w2", passes=False)["decision"] == "rejected"


def test_numbering_goes_on_past_r9999(tmp_path):
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    (versions / "r0001").rename(versions / "r9999")
    registry = json.loads((versions / "registry.json").read_text())
    registry["current"] = registry["entries"][0]["version"] = "r9999"
    (versions / "registry.json").write_text(json.dumps(registry))
    assert promote(versions, tmp_path, "w2")["version"] == "r10000"
    current = resolve_reward_spec("reward:current", versions, "model.reward")
    assert current is not None and current.name == "r10000"
    assert roll_back_reward(versions, "r9999", "drill", "ops")["previous"] == "r10000"


def test_a_link_in_place_of_the_staging_folder_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    versions = tmp_path / "rewards"
    versions.mkdir()
    (versions / ".r0001.staging").symlink_to(elsewhere)
    assert promote(versions, tmp_path, "w1")["version"] == "r0001"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert listing(versions) == ["r0001", "registry.json"]
    assert not (versions / "r0001").is_symlink()


def test_a_rollback_makes_an_earlier_version_current_and_records_it(tmp_path):
    versions = tmp_path / "rewards"
    with pytest.raises(RewardRegistryError, match="has no promoted version r0001"):
        roll_back_reward(versions, "r0001", "why", "ops")
    promote(versions, tmp_path, "w1")
    promote(versions, tmp_path, "w2")
    promote(versions, tmp_path, "w3", passes=False)
    with pytest.raises(RewardRegistryError, match="needs a reason"):
        roll_back_reward(versions, "r0001", "  ", "ops")
    with pytest.raises(RewardRegistryError, match="r0002 is already the current"):
        roll_back_reward(versions, "r0002", "why", "ops")
    entry = roll_back_reward(versions, "r0001", "r0002 prefers long replies", "ops@host")
    assert {k: v for k, v in entry.items() if k != "date"} == {
        "decision": "rolled back",
        "rolled_back_to": "r0001",
        "previous": "r0002",
        "reason": "r0002 prefers long replies",
        "by": "ops@host",
    }
    current = current_reward(versions)
    assert current is not None and current.name == "r0001"
    # the next promotion numbers on, never reusing r0002
    assert promote(versions, tmp_path, "w4")["version"] == "r0003"
    assert listing(versions) == ["r0001", "r0002", "r0003", "registry.json"]


def test_a_decision_judged_against_a_parent_no_longer_current_is_refused(tmp_path):
    """`ppo rollback --reward r0001` while a reward model judged against r0002 trained: its
    decision is refused under the registry's lock, nothing recorded, r0001 stays current. Seen
    failing before the check (r0003 became current, a child of the rolled-back r0002)."""
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    promote(versions, tmp_path, "w2")
    roll_back_reward(versions, "r0001", "r0002 prefers long replies", "ops")
    before = load_reward_registry(versions)
    for passes in (True, False):
        with pytest.raises(RewardRegistryError, match="judged against r0002, but the current"):
            record_reward_decision(
                versions,
                model_folder(tmp_path, f"w3{passes}", "w3"),
                passes,
                {**ENTRY, "parent": "r0002"},
            )
    assert load_reward_registry(versions) == before
    assert listing(versions) == ["r0001", "r0002", "registry.json"]
    # judged against the current version, it is recorded
    entry = record_reward_decision(
        versions, model_folder(tmp_path, "w4", "w4"), True, {**ENTRY, "parent": "r0001"}
    )
    assert entry["version"] == "r0003"


# --- A promotion killed at each step -------------------------------------------------------

# Runs record_reward_decision in a process of its own that SIGKILLs itself at the marked
# point: no `finally`, no handler and no lock release other than the kernel's runs, as when a
# machine or the OOM killer stops a real `ppo reward`.
KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path

    import ppo_core.files.copying as copying
    import ppo_core.registry.rewards as rewards
    import ppo_core.registry.staging as staging

    versions, candidate, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    copy_file, copy_tree = copying._copy_file, rewards.copy_regular_tree
    write, rename = rewards._write, os.rename

    def copy_one_then_die(*args, **kwargs):  # mid-copy: one file of the staging copy written
        copy_file(*args, **kwargs)
        die()

    def copy_then_die(*args, **kwargs):
        copy_tree(*args, **kwargs)
        die()

    def write_then_maybe_die(folder, registry):
        decisions = [e["decision"] for e in registry["entries"]]
        if point == "before the final write" and decisions[-1] == "promoted":
            die()
        write(folder, registry)
        if point == "after the promoting entry" and decisions[-1] == "promoting":
            die()

    def rename_then_die(source, target):
        rename(source, target)
        die()

    if point == "during the staging copy":
        copying._copy_file = copy_one_then_die
    elif point == "after the staging copy":
        rewards.copy_regular_tree = copy_then_die
    elif point == "after the rename":
        staging.os.rename = rename_then_die
    rewards._write = write_then_maybe_die
    rewards.record_reward_decision(
        versions, candidate, True, {"reasons": ["PASS"], "score_mean": 0.0, "score_std": 1.0}
    )
    sys.exit("not killed")
    """
)
KILL_POINTS = {
    # point: what the registry makes of it at the next write
    "during the staging copy": "unrecorded",
    "after the staging copy": "unrecorded",
    "after the promoting entry": "abandoned",
    "after the rename": "completed",
    "before the final write": "completed",
}


def killed_promotion(tmp_path: Path, point: str) -> Path:
    """A reward folder with r0001 and r0002 promoted, r0002 current, and the promotion of a
    third model killed at ``point``."""
    versions = tmp_path / "rewards"
    promote(versions, tmp_path, "w1")
    promote(versions, tmp_path, "w2")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    candidate = model_folder(tmp_path, "killed", "w-killed")
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(versions), str(candidate), point],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return versions


def assert_recovered(versions: Path, outcome: str) -> None:
    """The killed promotion of a third model is in place as r0003 with its hash ("completed"),
    or recorded as abandoned ("abandoned"), or was never recorded ("unrecorded"); no staging
    copy is left in any case."""
    registry = load_reward_registry(versions)
    assert not [e for e in registry["entries"] if e["decision"] == "promoting"]
    assert not [p.name for p in versions.iterdir() if p.name.endswith(".staging")]
    killed = [e for e in registry["entries"] if e.get("reasons", [""])[0] == "PASS"]
    if outcome == "unrecorded":
        assert killed == []
        return
    [entry] = killed
    if outcome == "completed":
        assert entry["decision"] == "promoted" and entry["version"] == "r0003"
        assert tree_sha256(versions / "r0003") == entry["content_sha256"]
        assert check_reward_version(versions, "r0003").folder == versions / "r0003"
    else:
        assert entry["decision"] == "abandoned"
        assert "interrupted before it was in place" in entry["reasons"][-1]
        # the number goes back when nothing lies under it, and stays taken when something does
        leftover = os.path.lexists(versions / "r0003") and entry.get("version") == "r0003"
        assert leftover or not {"version", "path"} & entry.keys()


def rejection(versions: Path, tmp_path: Path) -> None:
    promote(versions, tmp_path, "w-rejected", passes=False)


def rollback(versions: Path, tmp_path: Path) -> None:
    roll_back_reward(versions, "r0001", "drill", "ops")


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("after", [promote, rejection, rollback])
def test_a_promotion_killed_at_each_step_is_finished_or_abandoned_by_the_next_write(
    tmp_path, point, after
):
    versions = killed_promotion(tmp_path, point)
    # a reader is not held up by the half promotion: r0002 stays current until a write
    current = current_reward(versions)
    assert current is not None and current.name == "r0002"

    outcome = KILL_POINTS[point]
    completed = outcome == "completed"
    # what the kill left: a staging copy until the rename, the folder in place after it
    assert (versions / ".r0003.staging").is_dir() == (not completed)
    assert (versions / "r0003").is_dir() == completed
    if after is promote:
        entry = promote(versions, tmp_path, "w-next")
        # an abandoned number is taken again; a completed one never is
        assert entry["version"] == ("r0004" if completed else "r0003")
        assert (versions / entry["version"] / "sub" / "model.safetensors").read_text() == "w-next"
        assert load_reward_registry(versions)["current"] == entry["version"]
    else:
        after(versions, tmp_path)
    assert_recovered(versions, outcome)
    # and the promotion after that succeeds, numbered past every version in place
    entry = promote(versions, tmp_path, "w-last")
    assert check_reward_version(versions, entry["version"]).name == entry["version"]
    in_place = sorted(p.name for p in versions.iterdir() if re.fullmatch(r"r\d{4}", p.name))
    assert in_place[-1] == entry["version"]
    assert not [p.name for p in versions.iterdir() if p.name.endswith(".staging")]


@pytest.mark.parametrize("leftover", ["changed", "file", "link inside"])
def test_a_leftover_folder_of_an_abandoned_promotion_blocks_nothing(tmp_path, leftover):
    """A killed promotion whose target holds something other than the recorded content (a hand
    restore, a file system without an atomic rename) is abandoned; what lies there is kept, and
    the next promotion neither overwrites it nor stops at it."""
    versions = killed_promotion(tmp_path, "after the rename")
    target = versions / "r0003"
    if leftover == "changed":
        (target / "sub" / "model.safetensors").write_text("half restored")
    elif leftover == "file":
        shutil.rmtree(target)
        target.write_text("not a model")
    else:
        (target / "key").symlink_to(tmp_path / "candidates" / "w1" / "config.json")
    entry = promote(versions, tmp_path, "w-next")
    assert entry["version"] == "r0004"
    assert load_reward_registry(versions)["current"] == "r0004"
    assert_recovered(versions, "abandoned")
    with pytest.raises(RewardRegistryError, match="has no promoted version r0003"):
        check_reward_version(versions, "r0003")
    [abandoned] = [
        e for e in load_reward_registry(versions)["entries"] if e["reasons"][0] == "PASS"
    ]
    assert abandoned["version"] == "r0003"
    assert f"{target} does not hold the content recorded" in abandoned["reasons"][-1]
    # kept as it was, for whoever wants to look at it
    if leftover == "changed":
        assert (target / "sub" / "model.safetensors").read_text() == "half restored"
    elif leftover == "file":
        assert target.read_text() == "not a model"
    else:
        assert (target / "key").is_symlink()
    assert promote(versions, tmp_path, "w-last")["version"] == "r0005"
