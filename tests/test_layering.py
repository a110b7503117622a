"""The layers of docs/design.md section 2: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
import re
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
    """The project's Python files under ``folder``: not those of the environments the benches
    build inside it (``bench/.trl-venv``, ``bench/.llama-venv``), hidden folders all."""
    found = sorted(
        path
        for path in folder.rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    assert found, f"no Python files under {folder}"
    return found


# The one mechanism of the open sets (ppo_core/catalog.py): it imports nothing of the project,
# and every room, math included, may import it.
UNDER_EVERYTHING = {"ppo_core.catalog"}
UNDER_EVERYTHING_ROOMS = {"catalog"}


def test_math_layer_imports_torch_and_itself_only():
    for path in sources(ROOT / "ppo_core" / "math"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            allowed = (
                top in STDLIB
                or top == "torch"
                or name.startswith("ppo_core.math")
                or name in UNDER_EVERYTHING
            )
            assert allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_ppo_core_never_imports_orchestration():
    forbidden = {"prefect", "dvc", "dvclive", "great_expectations", "flows"}
    for path in sources(ROOT / "ppo_core"):
        for name in imported_modules(path):
            assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


# Each room of ppo_core and the rooms it may import (docs/design.md section 2). Under everything:
# catalog (the open sets' mechanism). Layer 1: math and files; layer 2, model I/O: prompts,
# references, feedback, models, base_sources, rewards, checkpoints; layer 3, composition: config, parallel,
# registry, experience, training, preference, evaluation. A room missing here fails the test, so a
# new room states its place.
ROOM_IMPORTS: dict[str, set[str]] = {
    "catalog": set(),
    "math": set(),
    "files": set(),
    "prompts": {"files"},
    "references": {"files", "prompts"},
    "feedback": {"files", "prompts"},
    "models": {"math", "files", "prompts"},
    "base_sources": {"files", "models"},
    "rewards": {"math", "files", "models", "prompts", "base_sources"},
    "checkpoints": {"files"},
    "config": {"math", "files", "prompts"},
    "parallel": {"config", "models"},
    "registry": {"config", "files", "models"},
    "training": {
        "math",
        "files",
        "prompts",
        "references",
        "models",
        "rewards",
        "checkpoints",
        "config",
        "parallel",
        "registry",
        "experience",
    },
    "preference": {
        "math",
        "files",
        "prompts",
        "feedback",
        "models",
        "rewards",
        "checkpoints",
        "config",
        "parallel",
        "registry",
    },
    "experience": {
        "math",
        "files",
        "prompts",
        "models",
        "rewards",
        "config",
        "parallel",
        "registry",
    },
    # evaluation samples and judges with experience/, never with training/
    "evaluation": {
        "math",
        "files",
        "prompts",
        "references",
        "models",
        "rewards",
        "config",
        "parallel",
        "registry",
        "experience",
    },
}


def room_of(module: str) -> str:
    """``ppo_core.models.lora`` -> ``models``; ``ppo_core.prompts`` -> ``prompts``."""
    return module.split(".")[1]


def room_climbs(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` from one room of ppo_core to a room ROOM_IMPORTS does not allow."""
    found = []
    for module, imported in sorted(graph.items()):
        if not module.startswith("ppo_core."):
            continue
        room = room_of(module)
        if room not in ROOM_IMPORTS:
            found.append(f"{module}: the room {room!r} has no place in ROOM_IMPORTS")
            continue
        for other in sorted(imported):
            allowed = {room, *ROOM_IMPORTS[room], *UNDER_EVERYTHING_ROOMS}
            if other.startswith("ppo_core.") and room_of(other) not in allowed:
                found.append(f"{module} ({room}) imports {other} ({room_of(other)})")
    return found


def test_each_room_imports_only_the_rooms_below_it():
    assert room_climbs(project_import_graph()) == []


def test_the_room_check_sees_a_climb_and_a_room_without_a_place():
    graph = {
        "ppo_core.models.lora": {"ppo_core.training.loop", "ppo_core.files.atomic"},
        "ppo_core.attic.old": set(),
        "flows.stages": {"ppo_core.training.loop"},
    }
    assert room_climbs(graph) == [
        "ppo_core.attic.old: the room 'attic' has no place in ROOM_IMPORTS",
        "ppo_core.models.lora (models) imports ppo_core.training.loop (training)",
    ]


def rooms_without_tests(tests: Path) -> list[str]:
    """Each room of ppo_core (a package or a module) and of flows (``flows`` itself,
    ``orchestration``) that has no ``tests/<room>/`` folder holding a test module."""
    rooms = [
        p.stem
        for p in (ROOT / "ppo_core").iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    ]
    rooms = sorted({*rooms, "flows"} - {"__init__"})
    missing = []
    for room in rooms:
        folder = tests / room
        if not any(folder.glob("test_*.py")):
            missing.append(room)
    return missing


def test_every_room_has_its_test_folder():
    """tests/ mirrors the rooms: ``tests/models/`` for ``ppo_core/models/``, ``tests/prompts/``
    for ``ppo_core/prompts.py``, ``tests/flows/`` for flows (its ``orchestration/`` included)."""
    assert rooms_without_tests(TESTS) == []


def test_the_test_folder_check_sees_a_room_without_tests(tmp_path):
    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "test_gae.py").write_text("")
    missing = rooms_without_tests(tmp_path)
    assert "math" not in missing and {"models", "prompts", "flows"} <= set(missing)


def test_each_room_says_its_job():
    for folder in sorted(p for p in (ROOT / "ppo_core").iterdir() if (p / "__init__.py").exists()):
        text = (folder / "__init__.py").read_text()
        assert text.startswith('"""'), f"{folder.name}/__init__.py has no docstring"


def test_the_stages_never_import_the_prefect_side():
    """flows/ holds the stages and the `ppo` command; flows/orchestration/ the Prefect side. Only
    the front doors (the command's subcommands and the flow) may use both."""
    front_doors = {"flows.cli", "flows.operations", "flows.pipeline"}
    for module, imported in sorted(project_import_graph().items()):
        stage_side = module.startswith("flows.") and not module.startswith("flows.orchestration")
        if stage_side and module not in front_doors:
            climbs = sorted(o for o in imported if o.startswith("flows.orchestration"))
            assert not climbs, f"{module} imports {climbs}"


def test_file_safety_module_is_standalone():
    """``ppo_core.files`` sits under every layer, so it imports no project code but its own
    modules (each of them directly, not through the package)."""
    for path in sources(ROOT / "ppo_core" / "files"):
        for name in imported_modules(path):
            if name.startswith("ppo_core"):
                own = name.startswith("ppo_core.files.") or path.name == "__init__.py"
                assert own, f"{path.relative_to(ROOT)} imports {name}"


def test_relative_imports_are_resolved():
    """A relative import cannot slip past the checks above."""
    source = "from ..prompts import load_prompts\nfrom . import lora\nfrom .policy import x\n"
    assert imports_in(source, ["ppo_core", "models"]) == {
        "ppo_core.prompts",
        "ppo_core.models",
        "ppo_core.models.policy",
    }


def project_modules() -> dict[str, Path]:
    """Each module of ``ppo_core`` and ``flows`` by its dotted name, with its file."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for folder in ("ppo_core", "flows")
        for path in sources(ROOT / folder)
    }


def project_import_graph() -> dict[str, set[str]]:
    """Each module of ``ppo_core`` and ``flows`` (dotted) and the project modules it imports,
    at the top or inside a function (an import a function defers still ties the two)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported in imported_modules(path):
            parts = imported.split(".")
            # `from ppo_core.models import lora` names the module lora, or the package
            target = next(
                (
                    ".".join(parts[:k])
                    for k in range(len(parts), 0, -1)
                    if ".".join(parts[:k]) in modules
                ),
                None,
            )
            if target is not None and target != name:
                graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves through imports, one list per circle (Tarjan's
    strongly connected components of more than one module)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return circles


def test_no_import_circles():
    assert import_circles(project_import_graph()) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_stages_never_import_prefect():
    """`ppo <stage>` runs without Prefect (under `dvc repro`, torchrun, or by hand): the stages
    and every project module they import, at the top or in a function, keep Prefect out."""
    graph, modules = project_import_graph(), project_modules()
    seen, todo = set(), ["flows.stages"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    for module in sorted(seen):
        prefect = {n for n in imported_modules(modules[module]) if n.split(".")[0] == "prefect"}
        assert not prefect, f"{module} (reached from flows.stages) imports {sorted(prefect)}"


# -- the tests' own layering --------------------------------------------------------------------

TESTS = ROOT / "tests"
# A reward or worker named by text, as `model.reward=tests.helpers:varied_reward` names one.
NAMED_FUNCTION = re.compile(r"\b(tests(?:\.\w+)+):\w+")


def is_test_module(name: str) -> bool:
    return name.split(".")[-1].startswith("test_")


def other_test_modules(source: str, module: str) -> set[str]:
    """The ``test_*`` modules that ``source``, the text of module ``module`` (dotted), imports
    or names as ``module:function`` in a string (which loads that module just as well), other
    than itself."""
    package = module.split(".")[:-1]
    used = set(imports_in(source, package))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):  # from tests.flows import test_deployment
            used.update(
                f"{base}.{alias.name}"
                for base in imports_in(ast.unparse(node), package)
                for alias in node.names
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(m.group(1) for m in NAMED_FUNCTION.finditer(node.value))
    return {name for name in used if is_test_module(name) and name != module}


def test_no_test_module_uses_another():
    """Shared builders live in helper modules (tests/helpers.py, tests/math/toy.py, the
    conftest files); a test module that imports another one runs that module's import-time code
    and ties the two files' fates together. Every Python file under tests/ is checked."""
    found = {}
    for path in sources(TESTS):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if used := other_test_modules(path.read_text(), module):
            found[str(path.relative_to(ROOT))] = sorted(used)
    assert found == {}, f"modules that use other test modules: {found}"


def test_the_test_module_check_sees_every_form():
    """Each way one module can reach another test module is seen; helpers and itself are not."""
    # "{t}" for "tests": this file's own strings name no test module to the check above
    source = (
        "from tests.test_trainer import small_config\n"
        "import tests.math.test_gae\n"
        "from tests.flows import test_deployment, conftest\n"
        "from . import test_chat\n"
        "from tests.helpers import VARIED\n"
        "from tests.math.toy import ToyPolicy\n"
        "R = 'model.reward={t}.models.test_families:varied_reward'\n"
        "S = 'model.reward={t}.models.test_probe:own_reward'\n"
        "T = 'model.reward={t}.helpers:varied_reward'\n"
    ).format(t="tests")
    assert other_test_modules(source, "tests.models.test_probe") == {
        "tests.test_trainer",
        "tests.math.test_gae",
        "tests.flows.test_deployment",
        "tests.models.test_chat",
        "tests.models.test_families",
    }


# The house's size limits (docs/design.md, "Where to change what"): a file a reader can hold, a
# function that reads as one piece.
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_file_or_function_is_over_the_house_limits():
    found = []
    for folder in ("ppo_core", "flows", "bench"):
        for path in sources(ROOT / folder):
            source = path.read_text()
            where = path.relative_to(ROOT)
            if source.count("\n") > MAX_FILE_LINES:
                found.append(f"{where}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not found, (
        f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {found}"
    )
