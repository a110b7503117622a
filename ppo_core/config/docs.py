"""The configuration as YAML (layer 3), with each key's documentation as a comment when
asked: what ``ppo config --docs`` prints and every run saves beside its outputs."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ppo_core.config.schema import Config
from ppo_core.files import atomic_write_text


def to_yaml(config: Config, docs: bool = False) -> str:
    """The resolved config as YAML (saved beside every run's outputs).

    With ``docs``, each key's documentation (:func:`field_docs`) is a comment above it; the YAML
    loads to the same values.
    """
    if not docs:
        return OmegaConf.to_yaml(OmegaConf.structured(config))
    documented = field_docs()
    lines: list[str] = []

    def emit(node: dict[Any, Any], prefix: str, indent: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict) and not indent and lines:
                lines.append("")  # a blank line before each section
            lines.extend(_comment(documented.get(key, ""), indent))
            if isinstance(value, dict):
                lines.append(f"{indent}{name}:")
                emit(value, f"{key}.", indent + "  ")
            else:
                # one key at a time through the same dumper, so values keep their quoting
                text = OmegaConf.to_yaml(OmegaConf.create({name: value}))
                lines.extend(f"{indent}{line}" for line in text.splitlines())

    resolved = OmegaConf.to_container(OmegaConf.structured(config))
    assert isinstance(resolved, dict)
    emit(resolved, "", "")
    return "\n".join(lines) + "\n"


def _comment(doc: str, indent: str, width: int = 99) -> list[str]:
    """``doc`` as ``# `` lines that fit ``width`` columns, in Markdown's single backticks and
    with YAML's ``null`` for Python's ``None``."""
    text = " ".join(doc.replace("``", "`").replace("`None`", "`null`").split())
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width - len(indent) - 2)]


@functools.cache
def _classes_in(path: str) -> dict[str, ast.ClassDef]:
    source = ast.parse(Path(path).read_text(encoding="utf-8"))
    return {node.name: node for node in source.body if isinstance(node, ast.ClassDef)}


@functools.cache
def _docs_by_key() -> dict[str, str]:
    def documented(cls: type) -> dict[str, str]:
        """Field name to the string literal under it, in ``cls``'s body (in the file that
        defines it: the schema's sections are spread over two)."""
        body = _classes_in(inspect.getfile(cls))[cls.__name__].body
        return {
            node.target.id: inspect.cleandoc(after.value.value)
            for node, after in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        }

    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        docs = documented(cls)
        for item in fields(cls):
            key, section = f"{prefix}{item.name}", item.default_factory
            if section is not MISSING and isinstance(section, type) and is_dataclass(section):
                out[key] = docs.get(item.name) or inspect.cleandoc(section.__doc__ or "")
                walk(section, f"{key}.")
            else:
                out[key] = docs.get(item.name, "")

    walk(Config, "")
    return out


def field_docs() -> dict[str, str]:
    """The documentation of every key, by dotted key (``ppo.epochs``), and of every section
    (``ppo``, its class docstring).

    The text is the string literal written under each field in ``schema.py`` or
    ``stage_sections.py``, so that the definition stays the one place a key is documented; an
    undocumented key maps to ``""``.
    """
    return dict(_docs_by_key())


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config to ``path`` atomically."""
    atomic_write_text(path, to_yaml(config))
