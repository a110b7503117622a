"""The one mechanism of the open sets (ppo_core/catalog.py), every catalog of the project, and the
"where to change what" table of docs/design.md against them."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from ppo_core.catalog import Catalog, declared_in

ROOT = Path(__file__).resolve().parents[2]

# Every catalog: the module that defines it, its name there, and the module that registers its
# entries (its home). test_every_catalog_is_listed keeps this list whole.
CATALOGS = [
    ("ppo_core.math.declarations", "ADVANTAGE_ESTIMATOR_CATALOG", "ppo_core.math.advantages"),
    ("ppo_core.math.declarations", "KL_ESTIMATOR_CATALOG", "ppo_core.math.kl"),
    ("ppo_core.math.declarations", "LOSS_AGGREGATION_CATALOG", "ppo_core.math.losses"),
    ("ppo_core.rewards.scorers", "BUILTIN_REWARDS", "ppo_core.rewards.scorers"),
    ("ppo_core.base_sources.kinds", "BASE_SOURCES", "ppo_core.base_sources.kinds"),
    ("flows.stages", "STAGES", "flows.stages"),
]


def catalog_of(module: str, name: str) -> Catalog:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(("module", "name", "home"), CATALOGS, ids=[c[1] for c in CATALOGS])
def test_the_text_declares_what_the_import_registers(module, name, home):
    """The names and traits the config and ``--help`` read from the home's text (no import) are
    the ones importing the home registers, in the same order."""
    catalog = catalog_of(module, name)
    importlib.import_module(home)
    assert catalog.home == Path(importlib.import_module(home).__file__)
    assert catalog.names() == tuple(catalog.entries)
    assert dict(catalog.declared) == catalog.registered_traits
    assert catalog.names(), f"{name} registers nothing"


def test_every_catalog_is_listed():
    """Each ``Catalog(...)`` built in ppo_core or flows is one of :data:`CATALOGS`."""
    built = set()
    for path in [*ROOT.joinpath("ppo_core").rglob("*.py"), *ROOT.joinpath("flows").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.AnnAssign | ast.Assign):
                continue
            if getattr(getattr(node.value, "func", None), "id", None) == "Catalog":
                target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                built.add((module.removesuffix(".__init__"), target.id))
    assert built == {(module, name) for module, name, _ in CATALOGS}


def test_registrations_are_read_from_the_text_with_their_traits():
    source = (
        "@entry('gae', critic=True, groups=False)\ndef _a(inputs): ...\n\n"
        "@other\n@entry('toy', critic=False, groups=True)\nclass _B: ...\n"
        "@other('x')\ndef _c(inputs): ...\n"
    )
    assert declared_in(source, "entry") == {
        "gae": {"critic": True, "groups": False},
        "toy": {"critic": False, "groups": True},
    }


@pytest.mark.parametrize(
    "decorator",
    ["@entry(NAME, critic=True)", "@entry('x', critic=FLAG)", "@entry()", "@entry('x', **traits)"],
)
def test_a_registration_the_text_cannot_tell_is_refused(decorator):
    with pytest.raises(ValueError, match="as literals"):
        declared_in(f"{decorator}\ndef _x(inputs): ...\n", "entry")


def test_a_registration_with_other_traits_is_refused(tmp_path):
    home = tmp_path / "home.py"
    home.write_text("@entry('x', critic=True)\ndef _x(inputs): ...\n")
    catalog = Catalog("toy estimator", home, "entry", traits=("critic", "groups"))
    with pytest.raises(ValueError, match=r"gives \['critic'\]; a toy estimator gives exactly"):
        catalog.names()
    with pytest.raises(ValueError, match=r"gives \['critic'\]; a toy estimator gives exactly"):
        catalog.register("x", critic=True)


def test_two_entries_of_one_name_are_refused():
    from ppo_core.math.advantages import estimator
    from ppo_core.math.kl import kl_estimator

    with pytest.raises(ValueError, match="two advantage estimators are named 'rloo'"):
        estimator("rloo", critic=False, groups=True)(lambda inputs: (inputs.scores, None))
    with pytest.raises(ValueError, match="two KL estimators are named 'k3'"):
        kl_estimator("k3")(lambda d: d)


def test_an_unknown_name_is_refused_with_the_choices():
    from ppo_core.math.losses import LOSS_AGGREGATIONS

    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'mean'; choose one of"):
        LOSS_AGGREGATIONS["mean"]
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'mean'; choose one of"):
        LOSS_AGGREGATIONS.check("mean")


# --- the "where to change what" table of docs/design.md -------------------------------------


def change_table() -> dict[str, str]:
    """Each row of the table: what is added -> the one file its second column names."""
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("| to add | write it in | and also |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        what, where, _ = (cell.strip() for cell in line.strip("|").split("|"))
        files = re.findall(r"`([\w/.]+\.(?:py|yaml|md))`", where)
        assert len(files) == 1, f"the row {what!r} names {files or 'no file'}: name one"
        rows[what] = files[0]
    return rows


def test_every_row_names_one_file_that_exists():
    rows = change_table()
    assert len(rows) >= 8
    for what, file in rows.items():
        assert (ROOT / file).is_file(), f"the row {what!r} names {file}, which does not exist"


@pytest.mark.parametrize(("module", "name", "home"), CATALOGS, ids=[c[1] for c in CATALOGS])
def test_every_catalog_has_its_row_naming_its_home(module, name, home):
    catalog = catalog_of(module, name)
    where = str(catalog.home.relative_to(ROOT))
    rows = [what for what, file in change_table().items() if file == where]
    assert rows, f"no row of 'where to change what' names {where}, the home of a {catalog.kind}"
    assert any(f"@{catalog.decorator}" in what or catalog.kind in what for what in rows), rows
