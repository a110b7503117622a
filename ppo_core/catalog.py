"""Named open sets: one mechanism for every set of choices a user picks by name.

An open set (advantage estimators, KL estimators, loss aggregation modes, built-in rewards, base
sources, the pipeline's stages) is a :class:`Catalog`. Its entries live in one file, its
*home*, each under the catalog's decorator::

    @kl_estimator("k3")
    def _k3(d): ...

Adding an entry is writing it there; the config's choices, the checks, ``--help`` and the
dispatch all read the catalog. The config must check its choices without importing torch (the
Prefect flow and ``ppo ingest`` never import it: docs/benchmarks.md, "Orchestration overhead"),
so :meth:`Catalog.declared` reads the names and traits from the home's text instead of importing
it; the decorator's arguments are therefore literals. A test checks, for every catalog, that
what the text declares is what importing the home registers (``tests/catalog/test_catalog.py``).

This module imports nothing from the project: every room may use it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = ["Catalog", "declared_in"]

Entry = TypeVar("Entry")


def declared_in(source: str, decorator: str) -> dict[str, dict[str, Any]]:
    """Each entry that ``source`` (a module's text) registers with ``@decorator("name", **traits)``
    on a function or a class, with its traits, in the order they are written.

    Raises:
        ValueError: a registration whose name or traits are not literals.
    """
    found: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        for call in node.decorator_list:
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == decorator):
                continue
            try:
                name = ast.literal_eval(call.args[0])
                traits = {_keyword(k): ast.literal_eval(k.value) for k in call.keywords}
            except (IndexError, ValueError) as error:
                raise ValueError(
                    f"@{decorator} on {node.name} must name the entry and give its traits as "
                    f"literals: {ast.unparse(call)}"
                ) from error
            found[name] = traits
    return found


def _keyword(keyword: ast.keyword) -> str:
    if keyword.arg is None:  # **traits: not a literal
        raise ValueError("**")
    return keyword.arg


@dataclass
class Catalog(Generic[Entry]):
    """An open set of named entries, registered in one file by one decorator.

    Args:
        kind: what an entry is, for messages ("KL estimator").
        home: the file whose ``@decorator("name", ...)`` lines register the entries.
        decorator: the decorator's name in ``home`` (``home`` binds it to :meth:`register`).
        traits: the keyword arguments every registration gives (``critic``, ``groups``).
    """

    kind: str
    home: Path
    decorator: str
    traits: tuple[str, ...] = ()
    entries: dict[str, Entry] = field(default_factory=dict, repr=False)
    registered_traits: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    def register(self, name: str, **traits: Any) -> Callable[[Entry], Entry]:
        """The decorator that makes a function or class the entry ``name``."""
        if set(traits) != set(self.traits):
            raise ValueError(
                f"@{self.decorator}({name!r}) gives {sorted(traits)}; a {self.kind} gives "
                f"exactly {sorted(self.traits)}"
            )

        def add(entry: Entry) -> Entry:
            if name in self.entries:
                raise ValueError(f"two {self.kind}s are named {name!r}")
            self.entries[name] = entry
            self.registered_traits[name] = traits
            return entry

        return add

    @cached_property
    def declared(self) -> Mapping[str, dict[str, Any]]:
        """Each entry's name and traits as the home's text writes them (no import)."""
        found = declared_in(self.home.read_text(encoding="utf-8"), self.decorator)
        for name, traits in found.items():
            if set(traits) != set(self.traits):
                raise ValueError(
                    f"@{self.decorator}({name!r}) in {self.home.name} gives {sorted(traits)}; a "
                    f"{self.kind} gives exactly {sorted(self.traits)}"
                )
        return found

    def names(self) -> tuple[str, ...]:
        """Every entry's name, in the order the home writes them."""
        return tuple(self.declared)

    def trait(self, name: str, trait: str) -> Any:
        """One trait of the entry ``name``, read from the home's text."""
        return self.declared[self.check(name)][trait]

    def check(self, name: str) -> str:
        """``name``, if it is an entry.

        Raises:
            ValueError: naming the kind, the value and the choices.
        """
        if name not in self.declared:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        return name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.declared

    def __getitem__(self, name: str) -> Entry:
        """The registered entry ``name`` (the home is imported by then)."""
        try:
            return self.entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {tuple(self.entries)}"
            ) from None
