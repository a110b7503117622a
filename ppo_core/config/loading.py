"""Loading the configuration (layer 3): defaults, then a YAML file, then ``key=value``
overrides, each checked before it is merged; every failure is one :class:`ConfigError` that
names the key, the value and what is allowed, in the project's words."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, grammar_parser
from omegaconf.errors import OmegaConfBaseException
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar

from ppo_core.config.checks import validate_config
from ppo_core.config.keys import MAX_VALUE_CHARS, SHOWN_CHARS, ConfigError, flatten, shown_value
from ppo_core.config.schema import Config
from ppo_core.files import first_line


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Build the config: defaults, then the YAML file, then ``key=value`` overrides.

    Raises:
        ConfigError: unknown key, wrong type, malformed override, or a value out of range.
    """
    merged: DictConfig | ListConfig = OmegaConf.structured(Config)
    loaded: DictConfig | ListConfig | None = None
    try:
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist")
            try:
                loaded = OmegaConf.load(path)
            except (yaml.YAMLError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"config file {str(path)!r} is not valid YAML: {first_line(exc)}"
                ) from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(
                    f"config file {str(path)!r} must hold a mapping of keys, "
                    f"not a {type(loaded).__name__}"
                )
            merged = OmegaConf.merge(merged, loaded)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, f" (in {path})", loaded)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {_shown_override(item)} is not of the form key=value")
        given: DictConfig | None = None
        _check_yaml_value(item)
        try:
            given = OmegaConf.from_dotlist([item])
            merged = OmegaConf.merge(merged, given)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override {_shown_override(item)}: the value is not valid YAML ({first_line(exc)})"
            ) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(
                _explain(exc, f" (override {_shown_override(item)})", given)
            ) from None
    # Before OmegaConf resolves anything: a resolver's value or a huge string must never exist.
    _check_references(merged)
    try:
        config: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc, "")) from None
    _check_shapes(config)
    validate_config(config)
    return config


def _check_yaml_value(item: str) -> None:
    """Refuse an override whose value YAML reads as a mapping with a key that is not a name, or
    as a list with an empty item.

    YAML reads a lone ``?`` as a mapping ``{None: None}``, ``{1: 2}`` as one keyed by a number
    and a lone ``-`` as the list ``[None]``; OmegaConf then reports an "incompatible key type" or
    an "invalid type assigned" against a key of its own choosing (``optim.betas[0]``). This
    names the override and the key the user wrote instead. A value that is not valid YAML is
    left to the merge, which says so.
    """
    key, _, value = item.partition("=")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return
    pending, why = [parsed], ""
    while pending and not why:
        node = pending.pop()
        if isinstance(node, dict):
            bad = [k for k in node if not isinstance(k, str)]
            if bad:
                why = (
                    "YAML reads a '?' there as a mapping with an empty key; put text in quotes"
                    if bad[0] is None
                    else f"a mapping's keys must be names, got {shown_value(bad[0])}"
                )
            pending.extend(node.values())
        elif isinstance(node, list):
            if any(value is None for value in node):
                why = (
                    "YAML reads it as a list with an empty item (a lone '-' is one); put text "
                    "in quotes"
                )
            pending.extend(node)
    if why:
        raise ConfigError(
            f"override {_shown_override(item)}: the value given to {shown_value(key)} is not a "
            f"config value: {why}"
        )


def _check_shapes(node: Any, prefix: str = "") -> None:
    """Every section is a section and every list a list; raise :class:`ConfigError` otherwise.

    OmegaConf types a ``${...}`` reference when it resolves it into a number or a string, not
    when it stands for a whole list or section (``optim.betas=${seed}``); this names the key.
    """
    for item in fields(node):
        key, value = f"{prefix}{item.name}", getattr(node, item.name)
        default = item.default if item.default_factory is MISSING else item.default_factory()
        shown = type(value).__name__ if is_dataclass(value) else shown_value(value)
        if is_dataclass(default):
            if type(value) is not type(default):
                raise ConfigError(f"{key} must be a section of keys, got {shown}")
            _check_shapes(value, f"{key}.")
        elif isinstance(default, list) and not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {shown}")


def _check_references(merged: DictConfig | ListConfig) -> None:
    """Refuse what a ``${...}`` may not do, before OmegaConf resolves anything.

    A config may refer to its own keys (``${model.policy}``, ``${.sibling}``, ``${..seed}``)
    and to nothing else: a resolver's value (``${oc.env:VAR}`` above all, or ``oc.decode``,
    ``oc.create``, ``oc.select``, ...) would be saved into ``ppo_config.yaml``, checkpoints,
    production versions and the registry, and echoed in messages. The length of each value
    holding a reference is added up from the lengths of what it refers to, without building it,
    so that references repeating a key (a string that doubles at every key) fail at once.
    Raises :class:`ConfigError` naming the key, with OmegaConf's words where it has them.
    """
    check = _References(OmegaConf.to_container(merged, resolve=False))
    for path, value in _leaves(check.tree, ()):
        if isinstance(value, str) and "${" in value:
            check.measure(path)


def _leaves(node: Any, path: tuple[Any, ...]) -> Iterable[tuple[tuple[Any, ...], Any]]:
    """Each value of a plain tree of dicts and lists with its path."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))
    else:
        yield path, node


class _References:
    """The references of one unresolved config tree, followed and measured (characters once
    resolved) without resolving anything; :meth:`fail` names the key that holds one."""

    def __init__(self, tree: Any):
        self.tree = tree
        self.lengths: dict[tuple[Any, ...], int] = {}
        self.measuring: list[tuple[Any, ...]] = []  # the values being measured, outermost first

    @staticmethod
    def fail(path: tuple[Any, ...], reason: str) -> NoReturn:
        key = ".".join(map(str, path))
        raise ConfigError(
            f"config key {shown_value(key)}: cannot resolve an ${{...}} reference: {reason}"
        )

    def value_at(self, path: tuple[Any, ...]) -> Any:
        node = self.tree
        for part in path:
            node = node[part]
        return node

    def target(self, path: tuple[Any, ...], reference: Any) -> tuple[Any, ...]:
        """Where an interpolation node (``${a.b}``, ``${..c}``, ``${a[0]}``) held at ``path``
        points: leading dots count up from the folder holding it."""
        dots, parts = 0, []
        for child in reference.getChildren():
            if isinstance(child, Grammar.ConfigKeyContext):
                parts.append(child.getText())
            elif child.getText() == "." and not parts:
                dots += 1
        where: tuple[Any, ...] = path[: len(path) - dots] if dots else ()
        node = self.value_at(where) if dots <= len(path) else None
        for part in parts:
            if isinstance(node, dict) and part in node:
                step: Any = part
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                step = int(part)
            elif isinstance(node, str) and "${" in node:
                self.fail(
                    path, f"{reference.getText()} goes through another reference; name the key"
                )
            else:
                self.fail(path, f"Interpolation key {shown_value('.'.join(parts))} not found")
            where, node = (*where, step), node[step]
        return where

    def measure(self, path: tuple[Any, ...]) -> int:
        """Characters of the value at ``path`` once resolved (a section or list as it prints)."""
        if path in self.lengths:
            return self.lengths[path]
        if path in self.measuring:
            self.fail(self.measuring[0], "Recursive interpolation detected")
        self.measuring.append(path)
        value = self.value_at(path)
        if isinstance(value, dict):
            total = 2 + sum(len(repr(key)) + 4 + self.measure((*path, key)) for key in value)
        elif isinstance(value, list):
            total = 2 + sum(2 + self.measure((*path, index)) for index in range(len(value)))
        elif isinstance(value, str) and "${" in value:
            total = self._measure_references(path, value)
        else:
            total = len(str(value))
        self.measuring.pop()
        self.lengths[path] = total
        return total

    def _measure_references(self, path: tuple[Any, ...], value: str) -> int:
        """:meth:`measure` of a string holding references: each one checked (a key of this
        config, no resolver, no nested reference) and its target measured."""
        try:
            parsed = grammar_parser.parse(value)
        except OmegaConfBaseException as exc:
            self.fail(path, _shorten_quoted(first_line(exc)))
        nodes = list(_parse_nodes(parsed))
        for node in nodes:
            if isinstance(node, Grammar.InterpolationResolverContext):
                self.fail(
                    path,
                    f"the resolver {shown_value(node.resolverName().getText())} is not allowed: a "
                    "config may only refer to its own keys (${key}), as resolved values are "
                    "saved with the run and shown in messages",
                )
        for node in nodes:
            if isinstance(node, Grammar.ConfigKeyContext) and node.interpolation():
                self.fail(path, "a key built from another reference (${a.${b}}) is not allowed")
        total = 0
        for piece in parsed.text().getChildren():
            if isinstance(piece, Grammar.InterpolationContext):
                total += self.measure(self.target(path, piece.interpolationNode()))
            else:  # text; an escape (\${) counts its backslash, an upper bound
                total += len(piece.getText())
        if total > MAX_VALUE_CHARS:
            self.fail(
                path,
                f"it would give a string of {total} characters, over the limit of "
                f"{MAX_VALUE_CHARS}",
            )
        return total


def _parse_nodes(node: Any) -> Iterable[Any]:
    """``node`` and every node below it in an OmegaConf grammar parse tree, parents first."""
    yield node
    for child in node.getChildren() if hasattr(node, "getChildren") else ():
        yield from _parse_nodes(child)


def _explain(
    exc: OmegaConfBaseException, where: str, given: DictConfig | ListConfig | None = None
) -> str:
    """One line naming the key and, in ``where``, the file or override it came from.

    ``given`` is what that file or override holds: OmegaConf names no key when a whole section
    is given a plain value (``ppo=5``), so the key is found by comparing it with the schema.
    """
    key = getattr(exc, "full_key", None) or "?"
    first = _shorten_quoted(str(exc).splitlines()[0])
    if "Interpolation" in type(exc).__name__:
        return (
            f"config key {shown_value(key)}{where}: cannot resolve an ${{...}} reference: {first}"
        )
    if key == "?":
        found = _section_given_a_value(
            OmegaConf.to_container(given) if isinstance(given, DictConfig) else None
        )
        if found is None:
            return f"bad config{where}: {first}"
        key, value = found
        example = next(k for k in _all_keys() if k.startswith(f"{key}."))
        return (
            f"bad value for config key {key!r}{where}: a section of keys, not a value (got "
            f"{shown_value(value)}); set the keys inside it, e.g. "
            f"{example}={_as_override(_defaults()[example])}"
        )
    if "not in" in first or "Key" in type(exc).__name__:
        close = difflib.get_close_matches(key, _all_keys(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return (
            f"unknown config key {shown_value(key)}{where}: {first}.{hint} Run `ppo config` to list "
            "the keys."
        )
    return f"bad value for config key {shown_value(key)}{where}: {first}"


def _shown_override(item: str) -> str:
    """An override as a message quotes it: key and value each cut to SHOWN_CHARS characters."""
    key, sep, value = item.partition("=")
    shown = f"{key[:SHOWN_CHARS]}{sep}{value[:SHOWN_CHARS]}"
    return repr(item) if shown == item else f"{shown!r}... ({len(item)} characters)"


def _shorten_quoted(text: str, limit: int = 300) -> str:
    """``text`` (an OmegaConf message, which quotes values in full) with every quoted part over
    SHOWN_CHARS characters cut, and at most ``limit`` characters in all."""
    text = re.sub(
        rf"'([^']{{{SHOWN_CHARS + 1},}})'",
        lambda match: f"{match.group(1)[:SHOWN_CHARS]!r}... ({len(match.group(1))} characters)",
        text,
    )
    return text if len(text) <= limit else f"{text[:limit]}..."


def _defaults() -> dict[str, Any]:
    return flatten(Config())


def _all_keys() -> list[str]:
    return list(_defaults())


def _as_override(value: Any) -> str:
    """``value`` as it is written after ``key=`` on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _section_given_a_value(
    given: Any, schema: Any = Config, prefix: str = ""
) -> tuple[str, Any] | None:
    """The first section of ``schema`` that ``given`` (a file's or an override's keys, as plain
    dicts) sets to a plain value or a list, with that value; ``None`` when there is none."""
    if not isinstance(given, dict):
        return None
    for item in fields(schema):
        section = item.default_factory
        if item.name not in given or section is MISSING or not is_dataclass(section):
            continue
        key, value = f"{prefix}{item.name}", given[item.name]
        if isinstance(value, dict):
            found = _section_given_a_value(value, section, f"{key}.")
            if found is not None:
                return found
        elif value is not None:
            return key, value
    return None
