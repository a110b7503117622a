"""``ppo tasks``: checkable problems from reasoning-gym written as a raw prompt file, each row
carrying its answer (``ppo_core/rewards/gym.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from flows.command import console, run_or_exit
from ppo_core.rewards.gym import DEFAULT_GYM_TASKS, GYM_FIELDS, GYM_TASKS


def tasks(
    file: Annotated[
        Path,
        typer.Argument(
            help="The prompt file to write (.jsonl), e.g. data/raw/tasks.jsonl; never replaced.",
            metavar="FILE",
            show_default=False,
        ),
    ],
    task: Annotated[
        list[str] | None,
        typer.Option(
            "--task",
            help=f"A reasoning-gym task, repeatable (default: {', '.join(DEFAULT_GYM_TASKS)}); "
            f"one of {', '.join(GYM_TASKS)}.",
            show_default=False,
        ),
    ] = None,
    size: Annotated[int, typer.Option(help="Problems of each task.")] = 200,
    seed: Annotated[int, typer.Option(help="The first task's seed; the i-th takes seed + i.")] = 0,
    chat: Annotated[
        bool, typer.Option("--chat", help="Rows as one-turn chats (`messages`), not `prompt`.")
    ] = False,
) -> None:
    """Write reasoning-gym problems, each with its answer, as a prompt file to train on.

    Offline and seeded: the same tasks, size and seed give the same file. Each row holds the
    question (asking for the answer between answer tags) and the reference fields
    `answer`, `task` and `metadata`, which the reward `builtin:reasoning_gym` scores the reply
    against with the task's own scorer. Only tasks whose scorers compare text or numbers, and
    never run the model's reply, are offered.

    Then, with the file in data/raw/ (or added by `ppo ingest`):

        ppo prepare data.reference_fields=[answer,task,metadata]

    and the same `data.reference_fields` with `model.reward=builtin:reasoning_gym` for
    validate, train and evaluate (or in params.yaml).
    """
    from ppo_core.files.atomic import atomic_write_text
    from ppo_core.rewards.gym import gym_rows

    if file.exists():
        console.print(f"[bold red]error:[/] {file} exists; it is never replaced", soft_wrap=True)
        raise typer.Exit(code=2)
    chosen = list(task or DEFAULT_GYM_TASKS)
    rows = run_or_exit(lambda: gym_rows(chosen, size, seed, chat=chat))
    file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(file, "".join(json.dumps(row) + "\n" for row in rows))
    console.print(
        f"wrote {len(rows)} problems ({', '.join(chosen)}; {size} each, seed {seed}) to {file}; "
        f"train on them with data.reference_fields=[{','.join(GYM_FIELDS)}] "
        "model.reward=builtin:reasoning_gym",
        soft_wrap=True,
        markup=False,
    )
