"""``requirements.lock`` pins every package the project installs, within what ``pyproject.toml``
allows, and the tests run with exactly those versions (``make`` installs from the lock)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def locked() -> dict[str, str]:
    """``{package: version}`` of every ``name==version`` line of the lock."""
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not pinned with =="
            pins[canonicalize_name(name)] = version
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return [Requirement(name) for name in names]


def test_every_declared_dependency_is_pinned_within_its_range():
    pins = locked()
    assert "torch" not in pins  # chosen by TORCH_SPEC: the CPU or a CUDA build
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in pins, f"{requirement.name} is not in requirements.lock (make lock)"
        assert Version(pins[name]) in requirement.specifier, (
            f"requirements.lock pins {name}=={pins[name]}, pyproject.toml asks {requirement}"
        )


def test_the_tests_run_with_the_locked_versions():
    """Fails when the environment drifted from the lock (a package installed or upgraded by
    hand): ``make`` reinstalls from the lock whenever it changes."""
    differ = {}
    for name, version in locked().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            differ[name] = (version, installed)
    assert not differ, f"locked vs installed: {differ}"
