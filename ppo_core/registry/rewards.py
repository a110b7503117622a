"""The reward-model registry: versions ``r0001``, ``r0002``, ... of the reward model trained
from people's feedback, beside the policy's production versions (docs/design.md section 3,
"Reward versions").

``<versions_dir>/registry.json`` holds ``{"current": <rNNNN or null>, "entries": [...]}``; a
version's folder ``<versions_dir>/rNNNN/`` is a sequence-classification model folder, never
overwritten. Each entry records the decision, its reasons, the date, the feedback data's hash,
the base, the parent (the version current when it was judged), held-out metrics of both, the
normalisation statistics (``score_mean``, ``score_std``: its scores on its reference set) and
``content_sha256`` of the folder, checked whenever the version is used.

A promotion is made so that a kill at any point loses nothing and blocks nothing
(:mod:`ppo_core.registry.staging`, as production's): staged and hashed, recorded as
``"promoting"``, renamed into place, completed; the next registry write finishes or abandons
what a kill interrupted.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_core.files import (
    atomic_write_text,
    copy_regular_tree,
    exclusive_run,
)
from ppo_core.registry.staging import (
    PROMOTING,
    holds,
    put_in_place,
    recover_interrupted,
    stage,
)

__all__ = [
    "REWARD_SPEC_PREFIX",
    "RewardRegistryError",
    "RewardVersion",
    "check_reward_version",
    "current_reward",
    "load_reward_registry",
    "record_reward_decision",
    "resolve_reward_spec",
    "roll_back_reward",
]

REWARD_SPEC_PREFIX = "reward:"
"""``model.reward=reward:current`` (the current version) or ``reward:r0002`` (that one)."""
VERSION_PATTERN = re.compile(r"r[0-9]{4,}")
REGISTRY_FILE = "registry.json"


class RewardRegistryError(ValueError):
    """The reward registry is unreadable, names no such version, or a version changed on disk."""


@dataclass(frozen=True)
class RewardVersion:
    """A promoted reward model: its name, folder and the normalisation of its scores."""

    name: str  # r0001, ...
    folder: Path
    score_mean: float
    score_std: float
    entry: dict[str, Any]

    @property
    def spec(self) -> str:
        """The ``model.reward`` value that names exactly this version."""
        return f"{REWARD_SPEC_PREFIX}{self.name}"


def registry_path(versions_dir: str | Path) -> Path:
    return Path(versions_dir) / REGISTRY_FILE


def load_reward_registry(versions_dir: str | Path) -> dict[str, Any]:
    """The registry in ``versions_dir``, or an empty one before the first decision. Anything
    that is not a registry (not JSON, no ``entries`` list, a version name other than rNNNN) is
    one :class:`RewardRegistryError`, never a reset."""
    path = registry_path(versions_dir)
    if not path.exists():
        return {"current": None, "entries": []}
    broken = f"reward registry {path}"
    try:
        registry = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RewardRegistryError(f"{broken} is not valid JSON ({exc}); restore it") from None
    if not isinstance(registry, dict) or not isinstance(registry.get("entries"), list):
        raise RewardRegistryError(f"{broken} has no 'entries' list; restore it")
    if not all(isinstance(entry, dict) for entry in registry["entries"]):
        raise RewardRegistryError(f"{broken} has an entry that is not an object; restore it")
    names = [registry.get("current")] + [e.get("version") for e in registry["entries"]]
    for name in names:
        # names become folder names: only rNNNN, so an edited file cannot point elsewhere
        if name is not None and not (isinstance(name, str) and VERSION_PATTERN.fullmatch(name)):
            raise RewardRegistryError(
                f"{broken} names version {name!r}; reward versions are r0001, r0002, ..."
            )
    return registry


def _promoted(registry: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next(
        (
            e
            for e in registry["entries"]
            if e.get("version") == name and e.get("decision") == "promoted"
        ),
        None,
    )


def check_reward_version(versions_dir: str | Path, name: str) -> RewardVersion:
    """Promoted version ``name``, its folder checked against the recorded content hash."""
    if not VERSION_PATTERN.fullmatch(name):
        raise RewardRegistryError(f"{name!r} is not a reward version name (r0001, r0002, ...)")
    registry = load_reward_registry(versions_dir)
    entry = _promoted(registry, name)
    if entry is None:
        raise RewardRegistryError(
            f"the reward registry {registry_path(versions_dir)} has no promoted version {name}"
        )
    folder = Path(versions_dir) / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the reward registry names {name} but {folder} is missing; restore it (e.g. "
            "`dvc pull`) before going on"
        )
    recorded = entry.get("content_sha256")
    if not holds(folder, recorded):
        raise RewardRegistryError(
            f"reward version {name} in {folder} no longer matches the content hash the registry "
            "recorded when it was promoted; a file in it was changed, added (a link too) or "
            "removed. Restore "
            "it (e.g. `dvc pull` or `dvc checkout`)"
        )
    normalisation = _normalisation(entry)
    if normalisation is None:
        raise RewardRegistryError(
            f"reward version {name} records no usable normalisation (score_mean="
            f"{entry.get('score_mean')!r}, score_std={entry.get('score_std')!r}); restore the "
            "registry"
        )
    return RewardVersion(name, folder, *normalisation, entry)


def _normalisation(entry: dict[str, Any]) -> tuple[float, float] | None:
    """``(score_mean, score_std)`` of an entry when both are finite numbers (not booleans) and
    the standard deviation is above zero, else None."""
    numbers = [
        float(v)
        for v in (entry.get("score_mean"), entry.get("score_std"))
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]
    if len(numbers) != 2 or not numbers[1] > 0:
        return None
    return numbers[0], numbers[1]


def current_reward(versions_dir: str | Path) -> RewardVersion | None:
    """The current reward version, checked, or None before the first promotion."""
    current = load_reward_registry(versions_dir).get("current")
    return None if current is None else check_reward_version(versions_dir, current)


def resolve_reward_spec(spec: str, versions_dir: str | Path, key: str) -> RewardVersion | None:
    """The version a ``reward:`` spec names (``reward:current`` or ``reward:rNNNN``), or None
    for any other spec. ``reward:current`` before the first promotion is an error naming ``key``
    and what to do."""
    if not spec.startswith(REWARD_SPEC_PREFIX):
        return None
    name = spec.removeprefix(REWARD_SPEC_PREFIX)
    if name == "current":
        version = current_reward(versions_dir)
        if version is None:
            raise RewardRegistryError(
                f"{key}={spec!r}, but {registry_path(versions_dir)} has no current reward "
                "version yet; put preference pairs in data.feedback_dir and run `ppo prepare`, "
                "`ppo validate` and `ppo reward` first"
            )
        return version
    if not VERSION_PATTERN.fullmatch(name):
        raise RewardRegistryError(
            f"{key}={spec!r}: a reward version is reward:current or reward:rNNNN (r0001, ...)"
        )
    return check_reward_version(versions_dir, name)


def _lock(versions_dir: str | Path, what: str):
    path = registry_path(versions_dir)
    return exclusive_run(path.with_name(f".{REGISTRY_FILE}.lock"), f"{what} {path}")


def _write(versions_dir: str | Path, registry: dict[str, Any]) -> None:
    atomic_write_text(registry_path(versions_dir), json.dumps(registry, indent=1))


def record_reward_decision(
    versions_dir: str | Path,
    candidate_dir: str | Path,
    promote: bool,
    entry: dict[str, Any],
) -> dict[str, Any]:
    """Append a gate decision; on a pass, copy ``candidate_dir`` into the next version folder
    and make it current. ``entry`` holds the reasons, metrics, data hash, parent and the
    normalisation statistics. Returns the entry as recorded."""
    versions_dir = Path(versions_dir)
    versions_dir.mkdir(parents=True, exist_ok=True)
    with _lock(versions_dir, "reward promotion into"):
        registry = load_reward_registry(versions_dir)
        if recover_interrupted(versions_dir, registry, "r"):
            _write(versions_dir, registry)
        entry = {
            **entry,
            "decision": "rejected",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _check_parent_still_current(registry, entry, candidate_dir)
        if not promote:
            registry["entries"].append(entry)
            _write(versions_dir, registry)
            return entry
        if _normalisation(entry) is None:
            raise RewardRegistryError(
                f"the reward model in {candidate_dir} passed but has no usable normalisation "
                f"(score_mean={entry.get('score_mean')!r}, score_std="
                f"{entry.get('score_std')!r}), so it could not be used; nothing was promoted"
            )
        numbers = [int(e["version"][1:]) for e in registry["entries"] if e.get("version")]
        name = f"r{max(numbers, default=0) + 1:04d}"
        target = versions_dir / name
        if target.exists():
            raise FileExistsError(
                f"{target} exists but the reward registry does not know it; move it aside "
                "(a reward version is never overwritten)"
            )
        staging, content_sha256 = stage(
            versions_dir, name, lambda folder: copy_regular_tree(candidate_dir, folder)
        )
        # hashed before it is in place: a kill after this point is finished by the next write
        entry.update(version=name, path=str(target), content_sha256=content_sha256)
        entry["decision"] = PROMOTING
        registry["entries"].append(entry)
        _write(versions_dir, registry)
        put_in_place(staging, target)
        entry["decision"] = "promoted"
        registry["current"] = name
        _write(versions_dir, registry)
        return entry


def _check_parent_still_current(
    registry: dict[str, Any], entry: dict[str, Any], candidate_dir: str | Path
) -> None:
    """A :class:`RewardRegistryError` when the decision was judged against a ``parent`` that is
    no longer the current version (a rollback or another promotion came while the reward model
    trained): decided against the old current, it would undo the change. Checked under the
    registry's lock; an entry without a ``parent`` key is not checked."""
    if "parent" not in entry or entry["parent"] == registry.get("current"):
        return
    raise RewardRegistryError(
        f"the reward model in {candidate_dir} was judged against {entry['parent'] or 'no version'}"
        f", but the current reward version is now {registry.get('current') or 'none'} (a "
        "rollback or another promotion came while it trained): nothing was recorded; run "
        "`ppo reward` again to judge it against the current version"
    )


def roll_back_reward(versions_dir: str | Path, name: str, reason: str, by: str) -> dict[str, Any]:
    """Make the earlier reward version ``name`` current again, checked first; recorded as
    ``{"decision": "rolled back", "rolled_back_to", "previous", "reason", "by", "date"}``."""
    if not reason.strip():
        raise RewardRegistryError("a rollback needs a reason (--reason): the registry records it")
    with _lock(versions_dir, "reward rollback in"):
        registry = load_reward_registry(versions_dir)
        if recover_interrupted(versions_dir, registry, "r"):
            _write(versions_dir, registry)
        check_reward_version(versions_dir, name)
        previous = registry.get("current")
        if previous == name:
            raise RewardRegistryError(f"{name} is already the current reward version")
        entry = {
            "decision": "rolled back",
            "rolled_back_to": name,
            "previous": previous,
            "reason": reason,
            "by": by,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        registry["current"] = name
        registry["entries"].append(entry)
        _write(versions_dir, registry)
        return entry
