"""LoRA adapter folders (layer 2): what makes one, and the record of the base it applies to.

An adapter folder is what ``peft`` writes (``adapter_config.json``, ``adapter_model.safetensors``)
plus, when this project wrote it, ``adapter_base.json``: the base model folder it applies to,
named as the project records paths, and the SHA-256 of that folder's config and weights
(:func:`base_fingerprint`), so that an adapter is never applied to another base, a rebuilt base
of the same shapes included. Reading these needs no ``peft``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from ppo_core.files import file_sha256, first_line, printable
from ppo_core.models.folders import ADAPTER_CONFIG, ModelFolderError, check_model_folder

__all__ = [
    "ADAPTER_BASE_FILE",
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "AdapterError",
    "adapter_base_folder",
    "base_fingerprint",
    "base_record_path",
    "check_adapter_folder",
    "check_base_matches",
    "is_adapter_folder",
    "point_adapter_at",
    "recorded_fingerprint",
]

ADAPTER_CONFIG_FILE = ADAPTER_CONFIG


ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


ADAPTER_BASE_FILE = "adapter_base.json"


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class AdapterError(ModelFolderError):
    """An adapter cannot be added or loaded: unknown target modules, another base, a damaged
    folder. The message names the config key or the folder."""


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a ``peft`` adapter rather than a whole model."""
    return (Path(folder) / ADAPTER_CONFIG_FILE).is_file()


_FINGERPRINTS: dict[tuple, str] = {}


def base_fingerprint(base: str | Path) -> str:
    """SHA-256 over a model folder's ``config.json`` and weight files (``*.safetensors``, by
    name and content). Remembered per process while the files' sizes and times are unchanged:
    checkpoints record it every few iterations, and the weights of an 8B model take a while."""
    folder = Path(base).resolve()
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")])
    stats = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())
    key = (str(folder), stats)
    if key not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for name, *_ in stats:
            digest.update(f"\0{name}\0{file_sha256(folder / name)}".encode())
        _FINGERPRINTS[key] = digest.hexdigest()
    return _FINGERPRINTS[key]


def adapter_base_folder(folder: str | Path) -> Path:
    """The base model folder an adapter written by this project applies to (relative paths are
    the project's, i.e. the working folder's), checked against its recorded fingerprint."""
    folder = Path(folder)
    record_file = folder / ADAPTER_BASE_FILE
    if not record_file.is_file():
        raise AdapterError(
            f"adapter folder {str(folder)!r} has no {ADAPTER_BASE_FILE}, so the base it applies "
            "to is unknown; load it on its base with model.policy=BASE model.lora.adapter=FOLDER"
        )
    try:
        record = json.loads(record_file.read_text())
        base, fingerprint = Path(record["base"]), _fingerprint_of(record, record_file)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise AdapterError(f"{record_file} is damaged ({first_line(exc)})") from None
    stored = folder.parent / STORED_BASES / fingerprint
    if stored.is_dir() and stored.resolve() != base.resolve() and not _is_base(base, fingerprint):
        # a production version promoted before versions named their stored base: its base
        # folder was replaced (the next generation's import), the stored copy was not
        base = stored
    if is_adapter_folder(base):
        # a base that is an adapter would name a base of its own, and so on
        raise AdapterError(
            f"{record_file} names {str(base)!r} as the base, which is itself an adapter "
            "folder; an adapter's base is a whole model"
        )
    check_model_folder(base, f"the base model of adapter {str(folder)!r}")
    check_base_matches(folder, base, fingerprint)
    return base


STORED_BASES = "bases"
"""Beside production versions, the whole models they apply to, each in a folder named by its
fingerprint (``ppo_core.registry.lineage.store_base``): where an adapter version's base is found when
the folder its record names holds another model."""


def _is_base(base: Path, fingerprint: str) -> bool:
    """Whether ``base`` is a whole model folder with the fingerprint ``fingerprint``."""
    return (base / "config.json").is_file() and base_fingerprint(base) == fingerprint


def _fingerprint_of(record: object, record_file: Path) -> str:
    """The ``base_sha256`` of an ``adapter_base.json`` record: a SHA-256 in hex, never absent or
    null (which would let the adapter load onto any base)."""
    fingerprint = record.get("base_sha256") if isinstance(record, dict) else None
    if not isinstance(fingerprint, str) or not SHA256_HEX.fullmatch(fingerprint):
        raise AdapterError(
            f"{record_file} is damaged (base_sha256 is {fingerprint!r}, not a SHA-256); the "
            "base the adapter was trained on cannot be checked"
        )
    return fingerprint


def check_base_matches(adapter: str | Path, base: str | Path, recorded: str | None) -> None:
    """Raise :class:`AdapterError` when ``base``'s fingerprint is not the one the adapter was
    trained on (``recorded``; nothing to compare for an adapter written elsewhere)."""
    if recorded is None:
        return
    actual = base_fingerprint(base)
    if actual != recorded:
        raise AdapterError(
            f"adapter folder {str(adapter)!r} was trained on a base with fingerprint "
            f"{recorded[:12]}, but {str(base)!r} has {actual[:12]}: it is another model (or a "
            "rebuilt one); give the base it was trained on"
        )


def recorded_fingerprint(adapter: str | Path) -> str | None:
    record_file = Path(adapter) / ADAPTER_BASE_FILE
    if not record_file.is_file():
        return None
    try:
        record = json.loads(record_file.read_text())
    except json.JSONDecodeError:
        raise AdapterError(f"{record_file} is damaged") from None
    return _fingerprint_of(record, record_file)


def check_adapter_folder(folder: str | Path, role: str) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"{role} folder {str(folder)!r} does not exist")
    if not is_adapter_folder(folder):
        raise AdapterError(
            f"{role} folder {str(folder)!r} has no {ADAPTER_CONFIG_FILE}; it is not a peft "
            "adapter folder"
        )
    if not (folder / ADAPTER_WEIGHTS_FILE).is_file():
        raise AdapterError(
            f"{role} folder {str(folder)!r} has no {ADAPTER_WEIGHTS_FILE} (adapters load from "
            "safetensors only)"
        )
    try:
        config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
        kind = config.get("peft_type")
    except (json.JSONDecodeError, AttributeError):
        raise AdapterError(f"{folder / ADAPTER_CONFIG_FILE} is not valid JSON") from None
    if kind != "LORA":
        raise AdapterError(f"{role} folder {str(folder)!r} holds a {kind} adapter, not LoRA")
    _refuse_patterns(config, folder / ADAPTER_CONFIG_FILE)
    return folder


REGEX_CHARACTERS = re.compile(r"[\\^$*+?{}()|\[\]]")


def _refuse_patterns(config: dict, where: Path) -> None:
    """peft matches a string ``target_modules`` / ``exclude_modules`` and every key of
    ``rank_pattern`` / ``alpha_pattern`` as a regular expression against each module name: a
    pattern such as ``(.*.*)*X`` backtracks for minutes. An adapter needs none of them (this
    project writes module lists), so a pattern is refused by name; plain module names pass."""
    for key in ("target_modules", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, str) and value != "all-linear":
            raise AdapterError(
                f"{where}: {key} is the regular expression {printable(value)!r}; adapters are "
                "loaded with a list of module names only"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        odd = [k for k in patterns if not isinstance(k, str) or REGEX_CHARACTERS.search(k)]
        if odd:
            raise AdapterError(
                f"{where}: {key} holds the regular expression {printable(str(odd[0]))!r}; "
                "adapters are loaded with module names only"
            )


def base_record_path(base: str | Path) -> str:
    """How an adapter names its base: relative to the project (the working folder) when the
    base lies inside it, as ``models/base`` does, so the project can move; else the absolute
    path, because the adapter cannot be used without finding its base there."""
    path = Path(base)
    if not path.is_absolute():
        return path.as_posix()
    real = Path(os.path.realpath(path))
    try:
        return real.relative_to(os.path.realpath(os.getcwd())).as_posix()
    except ValueError:
        return str(real)


def point_adapter_at(folder: str | Path, base: str | Path, fingerprint: str) -> None:
    """Make the adapter in ``folder`` name ``base`` (with the fingerprint ``fingerprint``) as
    the model it applies to: ``adapter_base.json`` and the ``base_model_name_or_path`` of
    ``adapter_config.json``, both naming it as :func:`base_record_path` does."""
    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG_FILE
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_record_path(base)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    record = {"base": base_record_path(base), "base_sha256": fingerprint}
    (folder / ADAPTER_BASE_FILE).write_text(json.dumps(record, indent=1))
