"""The ``ppo`` commands that operate production between runs: ``rollback`` (an earlier
version made current again), ``notify`` (a person told when a scheduled run needs one),
``ingest`` (new prompt files for the next run) and ``compare`` (runs side by side).

``flows/cli.py`` registers them after the stage commands, so ``ppo --help`` lists the stages
first. Like every subcommand, each imports what it runs when it runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from flows.command import ConfigOption, Overrides, console, load_settings, run_or_exit

if TYPE_CHECKING:
    from ppo_core.config import Config


def rollback(
    version: Annotated[
        str,
        typer.Argument(
            help="The earlier production version, e.g. v0002 (with --reward: the earlier reward "
            "version, e.g. r0001).",
            show_default=False,
        ),
    ],
    reason: Annotated[
        str,
        typer.Option("--reason", "-m", help="Why: the registry records it.", show_default=False),
    ],
    by: Annotated[
        str | None,
        typer.Option(help="Who rolls back (default: the user running the command)."),
    ] = None,
    backup: Annotated[
        bool,
        typer.Option(
            help="Back production and the registry up in the DVC remote afterwards, as a "
            "deployment run does (only where they are backed up already: a .dvc pointer exists; "
            "not with --reward)."
        ),
    ] = True,
    reward: Annotated[
        bool,
        typer.Option(
            "--reward",
            help="VERSION is a reward model version (rNNNN in reward_model.versions_dir): make "
            "it reward:current again; production is left as it is.",
        ),
    ] = False,
    config: ConfigOption = None,
    overrides: Overrides = None,
) -> None:
    """Make an earlier production version current again.

    The version is checked against the content hash the registry recorded when it was promoted
    (and an adapter version's stored base against its own) before anything changes;
    nothing is copied or deleted. The registry records who rolled back, when, why, and from
    which version; the next `from_production` run (scheduled retraining) starts from it.

    While a run of the flow holds the project's retraining lock (`.retrain.lock`), a rollback
    is refused, naming the run: wait for it to end.

    With `--reward`, VERSION is an earlier reward model version (`ppo rollback --reward r0001
    --reason "..."`): checked against its content hash the same way, it becomes
    `reward:current` again for the next `ppo train` and `ppo evaluate`. The reward registry (in
    `reward_model.versions_dir`) records who, when, why and from which version; production is
    left as it is.
    """
    import getpass

    from ppo_core.registry.rewards import VERSION_PATTERN as REWARD_VERSION

    if reward:
        _roll_back_reward(version, reason, by or getpass.getuser(), config, overrides)
        return
    if REWARD_VERSION.fullmatch(version):
        console.print(
            f"[bold red]error:[/] {version} is a reward model version; `ppo rollback --reward "
            f"{version}` makes it the current reward version again",
            soft_wrap=True,
        )
        raise typer.Exit(code=2)

    _roll_back_production(
        load_settings(config, overrides), version, reason, by or getpass.getuser(), backup
    )


def _roll_back_production(cfg: Config, version: str, reason: str, by: str, backup: bool) -> None:
    """``ppo rollback``: the production registry's rollback under the retraining lock, then
    the backup where production is backed up already."""
    from flows.orchestration.project import RETRAIN_LOCK, RETRAIN_LOCK_HOLDER
    from flows.orchestration.records import back_up_production
    from ppo_core.files import exclusive_run
    from ppo_core.registry.versions import roll_back

    with contextlib.ExitStack() as held:
        # The lock a run of the flow holds from its start to its promotion: a rollback while
        # one runs is refused at once, naming it, instead of being undone by its promotion.
        run_or_exit(lambda: held.enter_context(exclusive_run(RETRAIN_LOCK, RETRAIN_LOCK_HOLDER)))
        entry = run_or_exit(
            lambda: roll_back(
                registry_path=cfg.promote.registry,
                production_dir=cfg.promote.production_dir,
                version=version,
                reason=reason,
                by=by,
            )
        )
        console.print(
            f"production is [bold]{version}[/] again (was {entry['previous']}); recorded in "
            f"{cfg.promote.registry}",
            soft_wrap=True,
        )
        production_pointers = [f"{cfg.promote.production_dir}.dvc", f"{cfg.promote.registry}.dvc"]
        if backup and all(Path(p).is_file() for p in production_pointers):
            console.print(back_up_production(".", cfg).message, soft_wrap=True)
        elif backup:
            console.print(
                "not backed up: production has no DVC pointer yet (a deployment run with "
                "backup makes one)",
                soft_wrap=True,
            )


def _roll_back_reward(
    version: str, reason: str, by: str, config: Path | None, overrides: list[str] | None
) -> None:
    """``ppo rollback --reward``: the reward registry's rollback, checked first."""
    from flows.orchestration.project import RETRAIN_LOCK, RETRAIN_LOCK_HOLDER
    from flows.reward_stage import write_current
    from ppo_core.files import exclusive_run
    from ppo_core.registry.rewards import registry_path, roll_back_reward

    cfg = load_settings(config, overrides)
    versions_dir = cfg.reward_model.versions_dir
    with contextlib.ExitStack() as held:
        # as for production: a run of the flow may be about to train on the current version
        run_or_exit(lambda: held.enter_context(exclusive_run(RETRAIN_LOCK, RETRAIN_LOCK_HOLDER)))
        entry = run_or_exit(lambda: roll_back_reward(versions_dir, version, reason, by))
        # the file `train` depends on in dvc.yaml: the next `dvc repro` trains on this version
        write_current(Path(cfg.reward_model.report_dir), versions_dir)
    console.print(
        f"the reward model is [bold]{version}[/] again (was {entry['previous']}); recorded in "
        f"{registry_path(versions_dir)}",
        soft_wrap=True,
    )


WebhookOption = Annotated[
    str | None,
    typer.Option(
        "--webhook",
        help="The URL that receives a JSON POST {subject, body} for each notification "
        "(visible in ps and shell history: see --webhook-env, --webhook-file).",
        show_default=False,
    ),
]
WebhookEnvOption = Annotated[
    str | None,
    typer.Option("--webhook-env", metavar="VAR", help="Read the URL from this variable."),
]
WebhookFileOption = Annotated[
    Path | None,
    typer.Option("--webhook-file", metavar="PATH", help="Read the URL from this file."),
]
HeaderOption = Annotated[
    list[str] | None,
    typer.Option(
        "--header",
        metavar="NAME=VALUE",
        help="A header to send with each notification (e.g. Authorization=Bearer ...).",
    ),
]
HeaderEnvOption = Annotated[
    list[str] | None,
    typer.Option(
        "--header-env",
        metavar="NAME=VAR",
        help="A header whose value is read from the environment variable VAR.",
    ),
]
HeaderFileOption = Annotated[
    list[str] | None,
    typer.Option(
        "--header-file",
        metavar="NAME=PATH",
        help="A header whose value is read from the file PATH (one line).",
    ),
]
TestOption = Annotated[
    bool,
    typer.Option(
        "--test",
        help="Send one test notification through the saved block and say whether the "
        "receiver answered (after saving, when a webhook is given too).",
    ),
]


def notify(
    webhook: WebhookOption = None,
    webhook_env: WebhookEnvOption = None,
    webhook_file: WebhookFileOption = None,
    header: HeaderOption = None,
    header_env: HeaderEnvOption = None,
    header_file: HeaderFileOption = None,
    test: TestOption = False,
) -> None:
    """Tell someone when a retraining run needs a person: a rejected candidate, a failed run, a
    crashed run.

    Saves a Prefect Custom Webhook notification block and creates the server automations
    `retrain-notify-rejected` and `retrain-notify-failed` (replacing earlier ones) on the server
    of PREFECT_API_URL; the server sends the notifications itself. Run it once per server.

    The webhook must be an http:// or https:// URL with a host; any other is refused before
    anything is saved. The URL and the header values are kept as the block's secrets (stored
    encrypted, shown obfuscated by the Prefect API and UI); give them with --webhook-env /
    --header-env or --webhook-file / --header-file to keep a token off the command line.
    """
    from flows.orchestration.notifications import check_webhook_url

    def refuse(why: str) -> NoReturn:
        console.print(f"[bold red]error:[/] {why}; nothing was saved", soft_wrap=True)
        raise typer.Exit(code=2)

    if not os.environ.get("PREFECT_API_URL"):
        console.print(
            "[bold red]error:[/] PREFECT_API_URL is not set: notifications are kept by a Prefect "
            "server (`prefect server start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api)",
            soft_wrap=True,
        )
        raise typer.Exit(code=2)
    given = {
        "--webhook": webhook,
        "--webhook-env": webhook_env,
        "--webhook-file": webhook_file,
    }
    sources = [name for name, value in given.items() if value is not None]
    if len(sources) > 1:
        refuse(f"give the webhook once, not with {' and '.join(sources)}")
    if not sources and not test:
        refuse("give the webhook: --webhook URL, --webhook-env VAR or --webhook-file PATH")
    if sources:
        try:
            url = _secret_value(sources[0], given[sources[0]])
            check_webhook_url(url)
            headers = _headers(header or [], header_env or [], header_file or [])
        except ValueError as error:
            refuse(str(error))
        from flows.orchestration.notifications import BLOCK_NAME, set_up_notifications

        created = set_up_notifications(url, headers)
        console.print(
            f"notification block {BLOCK_NAME} and automations {', '.join(created)} created: "
            "a rejected candidate, a failed and a crashed run of retrain are sent to the webhook "
            f"(its URL and {len(headers)} header value(s) kept as secrets)",
            soft_wrap=True,
        )
    if test:
        from flows.orchestration.notifications import send_test

        try:
            send_test()
        except RuntimeError as error:
            console.print(f"[bold red]error:[/] the test notification failed: {error}")
            raise typer.Exit(code=1) from None
        console.print("test notification sent: the receiver answered with success")


def _secret_value(option: str, given: object) -> str:
    """The value of ``--webhook`` / ``--header`` (``given`` itself), ``--...-env`` (the
    variable ``given`` names) or ``--...-file`` (the file's first line), or a ValueError naming
    the option and what is wrong."""
    if option.endswith("-env"):
        value = os.environ.get(str(given), "")
        if not value:
            raise ValueError(
                f"{option} {given}: the environment variable {given} is unset or empty"
            )
        return value
    if option.endswith("-file"):
        path = Path(str(given))
        if not path.is_file():
            raise ValueError(f"{option} {path}: no such file")
        if path.stat().st_size > 65_536:
            raise ValueError(f"{option} {path}: over 64 KiB, not a secret")
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"{option} {path}: unreadable ({type(error).__name__})") from None
        value = lines[0].strip() if lines else ""
        if not value:
            raise ValueError(f"{option} {path}: the file's first line is empty")
        return value
    return str(given)


def _headers(plain: list[str], from_env: list[str], from_file: list[str]) -> dict[str, str]:
    """The headers of ``--header NAME=VALUE``, ``--header-env NAME=VAR`` and ``--header-file
    NAME=PATH``; a ValueError names one that is not NAME=..., or given twice."""
    headers: dict[str, str] = {}
    for option, items in (
        ("--header", plain),
        ("--header-env", from_env),
        ("--header-file", from_file),
    ):
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or not value:
                form = {"--header": "VALUE", "--header-env": "VAR", "--header-file": "PATH"}
                raise ValueError(f"{option} {item!r} is not NAME={form[option]}")
            if name in headers:
                raise ValueError(f"the header {name!r} is given twice")
            headers[name] = _secret_value(option, value)
    return headers


def ingest(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Prompt files (.jsonl, .parquet) to add; with --feedback, feedback files.",
            metavar="FILE",
            show_default=False,
        ),
    ],
    feedback: Annotated[
        bool,
        typer.Option(
            "--feedback",
            help="The files are preference feedback (pairs: prompt or messages, chosen, "
            "rejected; ratings: prompt or messages, response, rating) for data.feedback_dir, "
            "not prompts: they wait in ingest.feedback_inbox_dir and the event "
            "ppo.feedback.ingested starts retrain/on-new-feedback.",
        ),
    ] = False,
    config: ConfigOption = None,
    no_event: Annotated[
        bool,
        typer.Option("--no-event", help="Add the files without telling the Prefect server."),
    ] = False,
) -> None:
    """Add new raw prompt files (or, with --feedback, preference feedback files) for the next
    retraining run, and tell Prefect.

    Each file is read as `ppo prepare` reads raw files (a malformed one is refused, naming the
    file and line, before anything is written), then copied into `ingest.inbox_dir`, all files
    or none. The next run of the Prefect flow `retrain` moves them into `data.raw_dir` before it
    prepares; files that arrive during a run wait for the next one.

    With --feedback, each file is read as `ppo prepare` reads feedback files (every row a pair,
    chosen and rejected, or a rating, response and rating; a prompt file is refused), copied into
    `ingest.feedback_inbox_dir`, and moved into `data.feedback_dir` by the next run.

    With `PREFECT_API_URL` set, the event `ppo.data.ingested` (with --feedback,
    `ppo.feedback.ingested`) goes to that server, where it starts the deployment
    `retrain/on-new-data` (`retrain/on-new-feedback`; `prefect deploy --all`, see prefect.yaml).
    Without it, nothing is triggered: `python -m flows.pipeline run` (or `make run`) takes them.
    """
    from prefect.settings import PREFECT_API_URL

    from flows.ingest import FEEDBACK, PROMPTS, emit_ingested, ingest_files

    cfg = load_settings(config, None)
    inbox = FEEDBACK if feedback else PROMPTS
    result = run_or_exit(lambda: ingest_files(cfg, files, inbox))
    for path in result.already_there:
        console.print(f"{path} already holds these bytes: nothing to add", soft_wrap=True)
    for path in result.added:
        console.print(f"added {path} ({result.holds(path.name)})", soft_wrap=True)
    if not result.added:
        return
    if no_event:
        return
    if not PREFECT_API_URL.value():
        console.print(
            "PREFECT_API_URL is not set, so no run was triggered: the next run of the flow takes "
            "these files (`python -m flows.pipeline run`, or a served or deployed `retrain`)",
            soft_wrap=True,
        )
        return
    try:
        emit_ingested(result, Path.cwd())
    except Exception as exc:  # the files are in; only the trigger failed
        console.print(
            f"[bold red]error:[/] the files are in {inbox.folder(cfg)}, but the event could "
            f"not reach the Prefect server at {PREFECT_API_URL.value()} ({exc}); the next run "
            "takes them",
            soft_wrap=True,
        )
        raise typer.Exit(code=1) from None
    console.print(
        f"sent {inbox.event} to {PREFECT_API_URL.value()}: it starts {inbox.deployment}",
        soft_wrap=True,
    )


def compare(
    all_commits: Annotated[
        bool, typer.Option("--all-commits", help="Every commit's runs, not only HEAD's.")
    ] = False,
) -> None:
    """Compare runs: experiments (`dvc exp run`) and commits side by side.

    One row a run, with the params that differ between the runs and the headline numbers:
    held-out score, positive rate, KL to the reference, EOS rate and distinct-2 of the candidate
    (`reports/eval/metrics.json`), training tokens/s, and the held-out accuracy and its gain
    where rows carry answers.

    Reads `dvc exp show --json`; `dvc exp
    show` has every param and metric, `dvc exp diff A B` two runs change by change.
    """
    from rich import box
    from rich.table import Table

    from flows.experiments import compare_runs, format_number

    try:
        comparison = compare_runs(".", all_commits=all_commits)
    except RuntimeError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    # a rule under the header, no cell borders and the cells' padding collapsed (two spaces
    # between columns): a flow run's experiment name (retrain-<flow run>), one changed param
    # and the seven numbers fit in 100 columns, where a boxed table cut the headers to
    # "ppo.clip…" and "positi…"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("run", no_wrap=True)
    # a column's name is the point of it: never cut
    for title in [*comparison.changed, *(title for _, title in comparison.columns)]:
        table.add_column(title, justify="right", min_width=len(title), no_wrap=True)
    for run in comparison.runs:
        params = [str(run.params.get(key, "-")) for key in comparison.changed]
        numbers = [format_number(run.metrics.get(key)) for key, _ in comparison.columns]
        table.add_row(run.name, *params, *numbers)
    out = Console()
    out.print(table)
    if not comparison.changed:
        out.print("no param differs between these runs")
