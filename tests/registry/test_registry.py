"""The promotion gate and the registry: a worse candidate is rejected, a better one promoted,
and a rejection changes no production version."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from ppo_core.config import PromoteConfig
from ppo_core.files import OUTPUT_MARKER, UnsafeCopyError
from ppo_core.registry.gate import gate
from ppo_core.registry.versions import (
    RegistryError,
    check_version,
    current_production,
    load_registry,
    record_decision,
)

GOOD = {"score": 0.80, "kl_to_reference": 2.5, "kl_to_origin": 2.5, "eos_rate": 0.99}
RULES = PromoteConfig(
    min_improvement=0.02,
    max_kl=4.0,
    min_eos_rate=0.85,
    max_distinct_2_drop=None,
    max_nll_increase=None,
)
"""The score, KL and EOS rules alone (the guards are tested on their own below)."""


def test_gate_hand_computed():
    assert gate(GOOD, {"score": 0.5}, RULES).promote
    # 0.51 - 0.50 = 0.01 < 0.02
    worse = gate({**GOOD, "score": 0.51}, {"score": 0.50}, RULES)
    assert not worse.promote and any("FAIL: score" in r for r in worse.reasons)
    drifted = gate({**GOOD, "kl_to_reference": 4.5}, {"score": 0.1}, RULES)
    assert not drifted.promote and any("FAIL: KL" in r for r in drifted.reasons)
    no_eos = gate({**GOOD, "eos_rate": 0.5}, {"score": 0.1}, RULES)
    assert not no_eos.promote and any("FAIL: EOS" in r for r in no_eos.reasons)


def test_the_gain_in_standard_errors_hand_computed():
    """``promote.min_gain_se``: accuracy 0.60 over 100 replies (sd 0.49) against 0.45 over 100
    (sd 0.50): SE = sqrt(0.49^2/100 + 0.50^2/100) = 0.0700, gain 0.15 = 2.14 SE."""
    candidate = {**GOOD, "score": 0.60, "score_std": 0.49, "num_samples": 100}
    baseline = {"score": 0.45, "score_std": 0.50, "num_samples": 100}
    two = dataclasses.replace(RULES, min_gain_se=2.0)
    passed = gate(candidate, baseline, two)
    assert passed.promote
    assert "pass: score gain +0.1500 is 2.14 standard errors (0.0700; needs >= 2" in "\n".join(
        passed.reasons
    )
    three = gate(candidate, baseline, dataclasses.replace(RULES, min_gain_se=3.0))
    assert not three.promote and reasons_of(three, "FAIL:")[0].startswith("FAIL: score gain")
    unmeasured = gate({**GOOD, "score": 0.6}, baseline, two)
    assert reasons_of(unmeasured, "FAIL:") == [
        "FAIL: cannot judge: candidate num_samples is missing from metrics.json"
    ]
    assert gate({**GOOD, "score": 0.6}, {"score": 0.45}, RULES).promote  # off by default


def test_drift_from_the_origin_is_bounded():
    # three generations of 3.5 nats each: every one within max_kl=4, 10.5 from the origin
    chained = {**GOOD, "kl_to_reference": 3.5, "kl_to_origin": 10.5}
    bounded = dataclasses.replace(RULES, max_kl_from_origin=10.0)
    refused = gate(chained, {"score": 0.1}, bounded)
    assert reasons_of(refused, "FAIL:") == [
        "FAIL: KL to the chain's origin 10.500 nats (promote.max_kl_from_origin 10.0)"
    ]
    assert gate(chained, {"score": 0.1}, dataclasses.replace(bounded, max_kl_from_origin=11.0))
    assert gate(chained, {"score": 0.1}, dataclasses.replace(RULES, max_kl_from_origin=None))


def test_an_eos_failure_says_what_the_baseline_had_and_which_keys_change_it():
    decision = gate({**GOOD, "eos_rate": 0.792}, {"score": 0.5, "eos_rate": 0.458}, RULES, 64)
    assert reasons_of(decision, "FAIL:") == [
        "FAIL: EOS rate 0.792 (needs >= 0.85); the baseline's is 0.458 (below the floor too); "
        "responses without EOS were cut at generation.max_new_tokens=64: raise it, or lower "
        "promote.min_eos_rate"
    ]


GUARDED = dataclasses.replace(RULES, max_distinct_2_drop=0.25, max_nll_increase=1.0)
BASE = {"score": 0.36, "distinct_2": 0.86, "reference_nll": 2.10, "check_score": 0.30}
FAIR = {**GOOD, "distinct_2": 0.80, "reference_nll": 2.40, "check_score": 0.55}


def reasons_of(decision, start: str) -> list[str]:
    return [r for r in decision.reasons if r.startswith(start)]


def test_the_guards_hand_computed():
    assert gate(FAIR, BASE, GUARDED).promote
    # repetition: distinct-2 0.86 -> 0.05 falls by 0.81 > 0.25
    repeated = gate({**FAIR, "distinct_2": 0.05}, BASE, GUARDED)
    assert not repeated.promote
    assert reasons_of(repeated, "FAIL:") == [
        "FAIL: distinct-2 0.0500 vs baseline 0.8600: change -0.8100 (may fall by at most 0.25)"
    ]
    # token soup: the reference's NLL 2.10 -> 3.20 rises by 1.10 > 1.0; 3.10 (+1.00) passes
    assert not gate({**FAIR, "reference_nll": 3.20}, BASE, GUARDED).promote
    assert gate({**FAIR, "reference_nll": 3.10}, BASE, GUARDED).promote
    # the check score only counts with promote.check_reward: 0.30 -> 0.15 falls by 0.15 > 0.1
    lexicon_gamed = {**FAIR, "check_score": 0.15}
    assert gate(lexicon_gamed, BASE, GUARDED).promote
    checked = dataclasses.replace(GUARDED, check_reward="builtin:afinn", max_check_drop=0.1)
    refused = gate(lexicon_gamed, BASE, checked)
    assert reasons_of(refused, "FAIL:") == [
        "FAIL: check score 0.1500 vs baseline 0.3000: change -0.1500 (may fall by at most 0.1)"
    ]
    # each guard is off with its key
    assert gate({**FAIR, "distinct_2": 0.0, "reference_nll": 9.0}, BASE, RULES).promote


def test_a_guard_whose_metric_is_missing():
    # not measured for the candidate: fails, naming the key that asked for it
    unmeasured = gate({k: v for k, v in FAIR.items() if k != "reference_nll"}, BASE, GUARDED)
    [reason] = reasons_of(unmeasured, "FAIL:")
    assert "reference_nll" in reason and "promote.max_nll_increase" in reason
    # not measurable for the baseline (another tokenizer): the gate cannot judge, and says
    # which key turns the guard off
    other = {k: v for k, v in BASE.items() if k != "reference_nll"}
    [reason] = reasons_of(gate(FAIR, other, GUARDED), "FAIL:")
    assert reason == (
        "FAIL: cannot judge: baseline reference_nll is missing from metrics.json "
        "(promote.max_nll_increase asks for it; set it to null to promote without this guard)"
    )
    # no baseline at all: nothing is compared, so nothing is promoted
    alone = gate(FAIR, None, GUARDED)
    assert not alone.promote
    assert [r.split(":")[0] for r in alone.reasons if "no baseline metrics" in r] == ["FAIL"] * 3


ALL_RULES = dataclasses.replace(
    GUARDED, check_reward="builtin:afinn", max_check_drop=0.1, max_kl_from_origin=12.0
)
READ = {
    "candidate": [
        "score",
        "kl_to_reference",
        "kl_to_origin",
        "eos_rate",
        "distinct_2",
        "reference_nll",
        "check_score",
    ],
    "baseline": ["score", "distinct_2", "reference_nll", "check_score"],
}
"""Every metric a rule of :data:`ALL_RULES` reads, by side."""


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None, "0.9"])
@pytest.mark.parametrize(
    ("side", "metric"), [(side, metric) for side, keys in READ.items() for metric in keys]
)
def test_a_metric_the_gate_cannot_judge_is_a_rejection_naming_it(side, metric, bad):
    sides = {"candidate": dict(FAIR), "baseline": dict(BASE)}
    assert gate(sides["candidate"], sides["baseline"], ALL_RULES).promote
    if bad is None:
        del sides[side][metric]
    else:
        sides[side][metric] = bad
    decision = gate(sides["candidate"], sides["baseline"], ALL_RULES)
    assert not decision.promote
    [reason] = reasons_of(decision, "FAIL:")
    assert reason.startswith(f"FAIL: cannot judge: {side} {metric} is "), reason


def candidate(tmp_path, name: str, content: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_text(content)
    return folder


def test_better_is_promoted_worse_is_rejected(tmp_path):
    registry, production = tmp_path / "models" / "registry.json", tmp_path / "models" / "production"
    assert current_production(registry, production) is None
    first = record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=candidate(tmp_path, "c1", "weights-1"),
        decision=gate(GOOD, {"score": 0.1}, RULES),
        lineage={"data_hash": "abc"},
    )
    assert first["decision"] == "promoted" and first["version"] == "v0001"
    assert current_production(registry, production) == production / "v0001"

    worse = record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=candidate(tmp_path, "c2", "weights-2"),
        decision=gate({**GOOD, "score": 0.7}, GOOD, RULES),
        lineage={"data_hash": "def"},
    )
    assert worse["decision"] == "rejected" and "version" not in worse
    assert (production / "v0001" / "model.safetensors").read_text() == "weights-1"
    assert sorted(p.name for p in production.iterdir()) == ["v0001"]

    better = record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=candidate(tmp_path, "c3", "weights-3"),
        decision=gate({**GOOD, "score": 0.9}, GOOD, RULES),
        lineage={"data_hash": "ghi"},
    )
    assert better["version"] == "v0002"
    book = load_registry(registry)
    assert book["current"] == "v0002"
    assert [e["decision"] for e in book["entries"]] == ["promoted", "rejected", "promoted"]
    assert [e["data_hash"] for e in book["entries"]] == ["abc", "def", "ghi"]


def test_a_broken_registry_is_an_error_not_a_reset(tmp_path):
    registry = tmp_path / "registry.json"
    registry.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_registry(registry)
    registry.write_text(json.dumps({"current": "v0009", "entries": []}))
    with pytest.raises(FileNotFoundError, match="v0009"):
        current_production(registry, tmp_path / "production")


def test_a_second_promotion_at_once_refuses_and_changes_nothing(tmp_path):
    from ppo_core.files import RunLockedError, exclusive_run

    registry, production = tmp_path / "models" / "registry.json", tmp_path / "models" / "production"
    other_run = exclusive_run(registry.with_name(".registry.json.lock"), "promotion")
    with other_run, pytest.raises(RunLockedError, match="another promotion"):
        record_decision(
            registry_path=registry,
            production_dir=production,
            candidate_dir=candidate(tmp_path, "c1", "weights-1"),
            decision=gate(GOOD, {"score": 0.1}, RULES),
            lineage={},
        )
    assert not registry.exists() and not production.exists()


@pytest.mark.parametrize(
    "content",
    [
        b'[1, "x"]',
        b'{"versions": 5}',
        b'{"current": null, "entries": 5}',
        b'{"current": null, "entries": [1, "x"]}',
        b'{"current": null, "entries": [null]}',
        b'{"current": null, "entries": [["v0001"]]}',
        b'{"current": 5, "entries": []}',
        b'{"current": null, "entries": [{"version": 5}]}',
        b"\xff\xfe{}",  # not UTF-8
        b"[" * 100_000,  # nested past the parser's recursion limit
    ],
)
def test_a_malformed_registry_is_one_registry_error(tmp_path, content):
    registry = tmp_path / "registry.json"
    registry.write_bytes(content)
    for action in (
        lambda: load_registry(registry),
        lambda: current_production(registry, tmp_path / "production"),
        lambda: record_decision(
            registry_path=registry,
            production_dir=tmp_path / "production",
            candidate_dir=candidate(tmp_path, "c1", "weights-1"),
            decision=gate(GOOD, {"score": 0.1}, RULES),
            lineage={},
        ),
    ):
        with pytest.raises(RegistryError, match=f"model registry {registry}") as raised:
            action()
        assert "\n" not in str(raised.value)
        shutil.rmtree(tmp_path / "c1", ignore_errors=True)
    assert registry.read_bytes() == content
    assert not (tmp_path / "production").exists()


def test_a_registry_that_is_a_folder_is_an_error(tmp_path):
    registry = tmp_path / "registry.json"
    registry.mkdir()
    with pytest.raises(RegistryError, match="is not a file"):
        load_registry(registry)


def test_promotion_copies_no_link_and_changes_nothing(tmp_path):
    secret = tmp_path / "id_ed25519"
    secret.write_text("private")
    folder = candidate(tmp_path, "c1", "weights-1")
    (folder / "key").symlink_to(secret)
    registry, production = tmp_path / "models" / "registry.json", tmp_path / "models" / "production"
    with pytest.raises(UnsafeCopyError, match="key is a symbolic link"):
        record_decision(
            registry_path=registry,
            production_dir=production,
            candidate_dir=folder,
            decision=gate(GOOD, {"score": 0.1}, RULES),
            lineage={},
        )
    assert not registry.exists()
    assert not production.exists() or list(production.iterdir()) == []
    (folder / "key").unlink()
    entry = record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=folder,
        decision=gate(GOOD, {"score": 0.1}, RULES),
        lineage={},
    )
    promoted = production / entry["version"]
    assert (promoted / "model.safetensors").read_text() == "weights-1"
    assert sorted(p.name for p in promoted.iterdir()) == [
        OUTPUT_MARKER,
        "config.json",
        "model.safetensors",
    ]


@pytest.mark.parametrize("change", ["edited", "added", "removed"])
def test_a_production_version_changed_on_disk_is_refused_by_name(tmp_path, change):
    """The registry records each promoted version's content hash; a version whose files were
    edited, added to or removed since is refused instead of being used as the baseline or
    replaced, and the error names the folder."""
    from ppo_core.files import tree_sha256

    registry, production = tmp_path / "registry.json", tmp_path / "production"
    entry = record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=candidate(tmp_path, "c1", "weights-1"),
        decision=gate(GOOD, {"score": 0.1}, RULES),
        lineage={"data_hash": "abc"},
    )
    version = production / "v0001"
    assert entry["content_sha256"] == tree_sha256(version)
    assert current_production(registry, production) == version
    if change == "edited":
        (version / "model.safetensors").write_text("weights-X")
    elif change == "added":
        (version / "extra.bin").write_text("")
    else:
        (version / "config.json").unlink()
        (version / "adapter_config.json").write_text("{}")  # still looks like a model folder
    with pytest.raises(RegistryError, match=r"production version v0001 in .*v0001 no longer"):
        current_production(registry, production)


def test_the_code_version_is_the_commit_and_whether_tracked_files_differ(tmp_path):
    import subprocess

    from flows.provenance import code_version

    assert code_version(tmp_path) == {"commit": None, "dirty": None}  # not a git work tree

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    for name in ("code.py", "dvc.lock"):
        (tmp_path / name).write_text("one\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "dvc.lock").write_text("rewritten by the pipeline\n")
    (tmp_path / "new.py").write_text("untracked\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "code.py").write_text("two\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": True}


@pytest.mark.parametrize("recorded", ["null", "absent", "not a hash"])
def test_a_registry_entry_cannot_switch_the_content_check_off(tmp_path, recorded):
    """An entry whose ``content_sha256`` was edited away is refused like a changed version, not
    taken as one written before hashes were recorded."""
    registry, production = tmp_path / "registry.json", tmp_path / "production"
    record_decision(
        registry_path=registry,
        production_dir=production,
        candidate_dir=candidate(tmp_path, "c1", "weights-1"),
        decision=gate(GOOD, {"score": 0.1}, RULES),
        lineage={"data_hash": "abc"},
    )
    (production / "v0001" / "model.safetensors").write_text("weights-X")
    edited = json.loads(registry.read_text())
    entry = edited["entries"][0]
    if recorded == "absent":
        del entry["content_sha256"]
    else:
        entry["content_sha256"] = None if recorded == "null" else "abc"
    registry.write_text(json.dumps(edited))
    with pytest.raises(RegistryError, match="production version v0001 has no content hash"):
        current_production(registry, production)


@pytest.mark.parametrize("name", ["v٠٠٠٢", "v０００２", "v𝟎𝟎𝟎𝟐"])
def test_a_version_name_with_digits_of_another_script_is_refused(tmp_path, name):
    """``\\d`` matches the digits of every script: a registry edited to name ``v٠٠٠٢`` (Arabic-
    Indic digits) as its current version, with the folder renamed to match, is refused like
    any other name that is not ``vNNNN``, and so is looking that name up."""
    registry, production = tmp_path / "registry.json", tmp_path / "production"
    for n in (1, 2):
        record_decision(
            registry_path=registry,
            production_dir=production,
            candidate_dir=candidate(tmp_path, f"c{n}", f"weights-{n}"),
            decision=gate(GOOD, {"score": 0.1}, RULES),
            lineage={},
        )
    edited = json.loads(registry.read_text())
    edited["entries"][1]["version"] = edited["current"] = name
    registry.write_text(json.dumps(edited))
    (production / "v0002").rename(production / name)
    with pytest.raises(RegistryError, match=f"names version '{name}'; versions are v0001"):
        current_production(registry, production)
    with pytest.raises(RegistryError, match=f"'{name}' is not a version name"):
        check_version(tmp_path / "other.json", production, name)
