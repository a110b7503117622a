"""Keys and values as messages show them (layer 3): :class:`ConfigError`, a config flattened
to dotted keys, and a rejected value cut short."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and what is allowed."""


# The longest string a config value may be, once its ${...} references are resolved. Paths and
# names are far shorter (a Linux path is at most 4096 bytes); the limit stops references that
# repeat a key from building strings of gigabytes (each doubling adds a key, not a gigabyte).
MAX_VALUE_CHARS = 4096
# A rejected value is shown at most this long in a message: it may hold a secret or megabytes,
# and messages reach logs.
SHOWN_CHARS = 40


def shown_value(value: Any) -> str:
    """``repr(value)`` for a message, cut to about SHOWN_CHARS characters when longer."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS + 2 else f"{text[:SHOWN_CHARS]}..."


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config (dataclass, DictConfig or YAML-loaded dict) as ``{"ppo.epochs": 4, ...}``."""
    if not isinstance(node, dict):
        node = OmegaConf.to_container(
            OmegaConf.structured(node) if not isinstance(node, DictConfig) else node
        )
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out
