"""Where a run may write (under the model I/O and composition layers; standard library only).

An output path counts where it really is: :func:`os.path.realpath` resolves every symbolic link
on the way, so a path through a linked folder counts where the link points, and a relative path
is taken from the working folder, which is the project (``ppo`` and ``dvc repro`` run there).
An output must lie strictly inside one of the allowed roots:

- the project;
- the system's temporary folder (:func:`tempfile.gettempdir`, ``$TMPDIR``), for scratch runs and
  tests, where no project file lives unless the project itself does;
- each folder named in the environment variable ``PPO_ALLOWED_OUTPUT_ROOTS`` (several separated
  by ``os.pathsep``, ``:`` on Linux; a relative one is taken from the project), for outputs kept
  elsewhere, such as checkpoints on a larger disk:
  ``PPO_ALLOWED_OUTPUT_ROOTS=/mnt/scratch ppo train train.checkpoint_dir=/mnt/scratch/ck``.

and it may not be, lie inside or contain a protected part of the project (:data:`PROTECTED`):
the repository, DVC's folder, the virtual environment, the sources, the default raw data and the
files that define the pipeline. An output that is a root itself is refused too: replacing it
would replace everything in it. :mod:`ppo_core.config` checks every output key with
:func:`check_output` when the config is loaded; which outputs and inputs may overlap is its
business.
"""

from __future__ import annotations

import os
import tempfile

__all__ = [
    "ALLOWED_ROOTS_ENV",
    "PROTECTED",
    "OutputPathError",
    "allowed_roots",
    "check_output",
    "inside",
    "overlap",
    "real_path",
]

ALLOWED_ROOTS_ENV = "PPO_ALLOWED_OUTPUT_ROOTS"

# Parts of the project no output may be, sit in or contain (paths relative to the project).
# Losing .git loses history that no command can rebuild; the rest is the code, the environment,
# the raw data DVC versions, and the files that define, build, deploy and describe the pipeline.
PROTECTED = (
    ".git",
    ".dvc",
    ".venv",
    ".ci",
    "ppo_core",
    "flows",
    "tests",
    "bench",
    "docs",
    "data/raw",
    "params.yaml",
    "dvc.yaml",
    "dvc.lock",
    "pyproject.toml",
    "requirements.lock",
    "Makefile",
    "prefect.yaml",
    "automations.yaml",
    ".gitignore",
    ".dvcignore",
    "README.md",
    "CHANGELOG.md",
    "LICENSE",
)


class OutputPathError(ValueError):
    """An output path points where a run must not write; the message names the key and value."""


def real_path(path: str | os.PathLike[str], project: str | None = None) -> str:
    """The real absolute path of ``path`` (links resolved; relative to ``project``, by default
    the working folder). Parts that do not exist yet are kept as written, normalised."""
    base = os.path.realpath(project if project is not None else os.getcwd())
    return os.path.realpath(os.path.join(base, os.fspath(path)))


def allowed_roots(project: str | None = None) -> list[str]:
    """The real paths of the folders outputs may lie in: the project, the temporary folder and
    the folders of ``PPO_ALLOWED_OUTPUT_ROOTS``, in that order."""
    home = real_path(".", project)
    roots = [home, os.path.realpath(tempfile.gettempdir())]
    for entry in os.environ.get(ALLOWED_ROOTS_ENV, "").split(os.pathsep):
        if entry:
            roots.append(real_path(os.path.expanduser(entry), home))
    return roots


def inside(path: str, folder: str) -> bool:
    """Whether real path ``path`` is ``folder`` or lies in it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def overlap(first: str, second: str) -> bool:
    """Whether two real paths are the same or one lies inside the other."""
    return inside(first, second) or inside(second, first)


def _shown(text: str) -> str:
    """``text`` with control characters escaped, so that a message stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_output(key: str, value: str | os.PathLike[str], project: str | None = None) -> str:
    """Raise :class:`OutputPathError` unless the output ``key=value`` lies strictly inside an
    allowed root (:func:`allowed_roots`) and clear of every :data:`PROTECTED` part of the project;
    return its real path."""
    named = f"{key}={str(value)!r}"
    try:
        home = real_path(".", project)
        real = real_path(value, home)
    except ValueError as exc:  # an embedded NUL byte
        raise OutputPathError(f"{named} is not a usable path ({exc})") from None
    roots = allowed_roots(home)
    if real in roots:
        which = "the project folder" if real == home else f"the allowed output root {_shown(real)}"
        raise OutputPathError(
            f"{named} is {which} itself; an output needs a folder of its own inside it"
        )
    if not any(inside(real, root) for root in roots):
        others = ", ".join(_shown(root) for root in roots[1:])
        raise OutputPathError(
            f"{named} resolves to {_shown(real)}, outside the project ({_shown(home)}) and the "
            f"other allowed output roots ({others}); keep outputs inside the project, or allow "
            f"that folder with {ALLOWED_ROOTS_ENV}=FOLDER (several separated by '{os.pathsep}')"
        )
    for part in PROTECTED:
        guarded = real_path(part, home)
        if real == guarded:
            relation = "is"
        elif inside(real, guarded):
            relation = "lies inside"
        elif inside(guarded, real):
            relation = "contains"
        else:
            continue
        raise OutputPathError(
            f"{named} {relation} {part}, a protected part of the project (the pipeline never "
            "writes there); choose another path"
        )
    return real
