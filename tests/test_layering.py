"""The layers of docs/design.md section 2: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imports_in(source: str, package: list[str]) -> set[str]:
    """Every module ``source`` imports, relative imports resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add(node.module or "")
            else:
                base = package[: len(package) - node.level + 1]
                names.add(".".join([*base, *([node.module] if node.module else [])]))
    return names


def imported_modules(path: Path) -> set[str]:
    return imports_in(path.read_text(), list(path.relative_to(ROOT).parts[:-1]))


def sources(folder: Path) -> list[Path]:
    found = sorted(folder.rglob("*.py"))
    assert found, f"no Python files under {folder}"
    return found


def test_math_layer_imports_torch_and_itself_only():
    for path in sources(ROOT / "ppo_core" / "math"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            allowed = top in STDLIB or top == "torch" or name.startswith("ppo_core.math")
            assert allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_ppo_core_never_imports_orchestration():
    forbidden = {"prefect", "dvc", "dvclive", "great_expectations", "flows"}
    for path in sources(ROOT / "ppo_core"):
        for name in imported_modules(path):
            assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_model_io_layer_never_imports_composition():
    """Model I/O uses the math layer, itself and the file-safety module only."""
    lower = ("ppo_core.math", "ppo_core.modeling", "ppo_core.files")
    for path in sources(ROOT / "ppo_core" / "modeling"):
        for name in imported_modules(path):
            if name.startswith("ppo_core"):
                assert name.startswith(lower), f"{path.relative_to(ROOT)} imports {name}"


def test_file_safety_module_is_standalone():
    """``ppo_core.files`` sits under every layer, so it imports no project code."""
    path = ROOT / "ppo_core" / "files.py"
    for name in imported_modules(path):
        assert not name.startswith("ppo_core"), f"ppo_core/files.py imports {name}"


def test_relative_imports_are_resolved():
    """A relative import cannot slip past the checks above."""
    source = "from ..trainer import train\nfrom . import data\nfrom .policy import x\n"
    assert imports_in(source, ["ppo_core", "modeling"]) == {
        "ppo_core.trainer",
        "ppo_core.modeling",
        "ppo_core.modeling.policy",
    }
