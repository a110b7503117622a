"""The layers of docs/design.md section 2: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_math_layer_imports_torch_and_itself_only():
    for path in (ROOT / "ppo_core" / "math").rglob("*.py"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            allowed = top in STDLIB or top == "torch" or name.startswith("ppo_core.math")
            assert allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_ppo_core_never_imports_orchestration():
    forbidden = {"prefect", "dvc", "dvclive", "great_expectations", "flows"}
    for path in (ROOT / "ppo_core").rglob("*.py"):
        for name in imported_modules(path):
            assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_model_io_layer_never_imports_composition():
    """Model I/O uses the math layer, itself and the file-safety module only."""
    lower = ("ppo_core.math", "ppo_core.modeling", "ppo_core.files")
    for path in (ROOT / "ppo_core" / "modeling").rglob("*.py"):
        for name in imported_modules(path):
            if name.startswith("ppo_core"):
                assert name.startswith(lower), f"{path.relative_to(ROOT)} imports {name}"


def test_file_safety_module_is_standalone():
    """``ppo_core.files`` sits under every layer, so it imports no project code."""
    path = ROOT / "ppo_core" / "files.py"
    for name in imported_modules(path):
        assert not name.startswith("ppo_core"), f"ppo_core/files.py imports {name}"
