"""The ``ppo`` command: one subcommand per pipeline stage.

Every subcommand reads ``./params.yaml`` when there is one (``--config FILE`` for another YAML
file, ``--config none`` for the built-in defaults alone) and takes ``key=value`` overrides of any
config key, e.g. ``ppo train ppo.mini_batch_size=32 optim.lr=1e-4``. Run ``ppo config`` to see
every key with its current value, ``ppo config --docs`` to see what each one does.

Help texts are Markdown (``rich_markup_mode="markdown"``): the terminal rewraps paragraphs to
its width, so a docstring's own line breaks do not show, and a list keeps one item a line.

Each subcommand imports what it runs when it runs, so that ``ppo --help`` and the light stages
start without importing torch, transformers, Great Expectations or Prefect.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    name="ppo",
    help=(
        "PPO retraining pipeline for causal language models.\n\n"
        "Stages, in order: prepare (clean and split the raw prompts), base (import or build the "
        "starting model), validate (Great Expectations; publishes the data version), train "
        "(PPO), evaluate (candidate vs baseline), promote (gate to production). `dvc repro` "
        "runs them all; so does the Prefect flow (`python -m flows.pipeline`).\n\n"
        "Every command reads ./params.yaml when there is one (`--config FILE` for another file, "
        "`--config none` for the built-in defaults alone) and takes key=value overrides; "
        "`ppo config --docs` lists every key with what it does."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
# soft_wrap: in a log (DVC, Prefect) a line is not cut at 80 columns mid-path.
console = Console(stderr=True, soft_wrap=True)

# Read when no --config is given, as `dvc repro` reads it for every stage.
DEFAULT_CONFIG = Path("params.yaml")
# The --config value that asks for the built-in defaults alone.
NO_CONFIG = "none"

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help=(
            "YAML config file; keys it leaves out keep their defaults. Without this option "
            f"./{DEFAULT_CONFIG} is read when it exists; `--config {NO_CONFIG}` uses the built-in "
            "defaults alone."
        ),
        show_default=False,
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Config overrides as key=value, e.g. ppo.epochs=2 optim.lr=1e-4.", show_default=False
    ),
]


def _config_file(given: Path | None) -> Path | None:
    """The file to read: ``given``, ./params.yaml when none is given, or none at all."""
    if given is not None:
        return None if str(given) == NO_CONFIG else given
    if not DEFAULT_CONFIG.is_file():
        return None
    from ppo_core.parallel.process_group import is_main_process

    if is_main_process():  # once, not once per torchrun rank
        console.print(
            f"config: {DEFAULT_CONFIG} (--config FILE for another, --config {NO_CONFIG} for the "
            "defaults)",
            soft_wrap=True,
            highlight=False,
        )
    return DEFAULT_CONFIG


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as users read it: what happened, not the project's source line that warned."""
    return f"warning: {message}\n"


def _load(config_file: Path | None, overrides: list[str] | None):
    from ppo_core.config import load_config

    warnings.formatwarning = _warning_line

    if not sys.stderr.isatty():
        # transformers draws a bar per model load and save ("Loading weights"); in a log (DVC,
        # Prefect, CI) those are noise. Read before transformers is first imported.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    return load_config(_config_file(config_file), overrides or [])


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


# The errors users can fix, by the module that defines each. Several of those modules import
# torch and transformers (seconds), which `prepare`, `validate`, `promote`, `config` and
# `ingest` never need: an error can only be raised once its module is loaded, so each class is
# looked up among the loaded modules when an error arrives.
USER_ERRORS = (
    ("ppo_core.config", "ConfigError"),
    ("ppo_core.files", "RunLockedError"),
    ("ppo_core.registry.lineage", "LineageError"),
    ("ppo_core.checkpoints.store", "CheckpointError"),
    ("ppo_core.prompts", "PromptFileError"),
    ("ppo_core.models.gguf_export", "GGUFExportError"),
    ("ppo_core.models.policy", "ModelFolderError"),
    ("ppo_core.rewards.loading", "RewardError"),
    ("ppo_core.registry.versions", "RegistryError"),
    ("flows.stages", "StaleEvaluationError"),
)


def _user_error(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError | FileNotFoundError):
        return True
    loaded = (sys.modules.get(module) for module, _ in USER_ERRORS)
    classes = tuple(
        getattr(module, name)
        for module, (_, name) in zip(loaded, USER_ERRORS, strict=True)
        if module is not None
    )
    return isinstance(exc, classes)


def _run(action):
    """Run a stage; turn the errors users can fix into one clear line and exit code 2."""
    try:
        return action()
    except Exception as exc:
        if _user_error(exc):
            console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
            raise typer.Exit(code=2) from None
        if not isinstance(exc, OSError) or exc.errno not in WRITE_ERRNOS:
            raise
        # disk full, read-only or forbidden folder: outputs are written atomically, so nothing
        # half-written is left behind and the previous versions stay in place
        where = f": {exc.filename}" if exc.filename else ""
        console.print(
            f"[bold red]error:[/] {exc.strerror or exc}{where}; nothing was replaced",
            soft_wrap=True,
        )
        raise typer.Exit(code=2) from None


@app.command("config")
def show_config(
    config: ConfigOption = None,
    overrides: Overrides = None,
    docs: Annotated[
        bool, typer.Option("--docs", help="Write each key's documentation above it, as comments.")
    ] = False,
    get: Annotated[
        str | None,
        typer.Option(
            "--get",
            metavar="KEY",
            help="Print only this key's value, e.g. `--get schedule.cron` (for scripts).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print the resolved config (defaults, then the file, then overrides) as YAML."""
    from ppo_core.config import flatten, to_yaml

    cfg = _run(lambda: _load(config, overrides))
    if get is None:
        sys.stdout.write(to_yaml(cfg, docs=docs))
        return
    flat = flatten(cfg)
    if get not in flat:
        console.print(f"[bold red]error:[/] no config key {get!r}; `ppo config` lists them")
        raise typer.Exit(code=2)
    value = flat[get]
    sys.stdout.write(("" if value is None else str(value)) + "\n")


@app.command()
def prepare(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Clean, deduplicate and split data.raw_dir into data.prepared_dir (train/eval parquet and a
    manifest with the content hash). Malformed lines fail the stage with file and line."""
    from flows import stages

    cfg = _run(lambda: _load(config, overrides))
    path = _run(lambda: stages.prepare(cfg))
    manifest = (path / "manifest.json").read_text()
    info = json.loads(manifest)
    c = info["counts"]
    console.print(
        f"prepared {c['train']} train / {c['eval']} eval prompts from {c['raw']} raw rows "
        f"({c['duplicates']} duplicates, {c['empty']} empty dropped) in [bold]{path}[/]; "
        f"data version {info['content_hash'][:12]}"
    )


@app.command()
def validate(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Check data.interim_dir with Great Expectations; publish it to data.prepared_dir if it
    passes. Data Docs and summary.json go to validation.report_dir, on failure too."""
    from flows import stages
    from flows.validation import DataValidationError

    cfg = _run(lambda: _load(config, overrides))
    try:
        path = _run(lambda: stages.validate(cfg))
    except DataValidationError as exc:
        console.print(f"[bold red]validation failed:[/] {exc}", soft_wrap=True)
        raise typer.Exit(code=1) from None
    console.print(
        f"data valid; published to [bold]{path}[/] (report in {cfg.validation.report_dir})"
    )


@app.command()
def base(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Put the starting policy in model.policy: import base.source, or build the tiny default."""
    from flows import stages

    cfg = _run(lambda: _load(config, overrides))
    started = time.perf_counter()
    path = _run(lambda: stages.base(cfg))
    console.print(f"base model ready in [bold]{path}[/] ({time.perf_counter() - started:.0f} s)")


@app.command()
def train(
    config: ConfigOption = None,
    overrides: Overrides = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run PPO on model.policy with the prompts of data.train_file.

    Resumes from the newest checkpoint in train.checkpoint_dir (train.resume=false starts over).
    Writes the policy to train.output_dir and per-iteration metrics to train.metrics_dir.

    The settings changed most often, as key=value (`ppo config --docs` explains every key):

    - train.iterations: PPO iterations (rollout + update)
    - ppo.rollout_batch_size: responses sampled per iteration
    - ppo.mini_batch_size: rows per optimizer step; divides ppo.rollout_batch_size
    - ppo.micro_batch_size: rows per forward/backward pass; divides ppo.mini_batch_size; sets
      memory use, not the result
    - optim.lr: learning rate
    - kl.coef: weight of the KL penalty against the reference model
    - ppo.advantage_estimator: {estimators}
    - model.policy: folder of the model to start from
    - model.reward: builtin:sentiment, module:function or a reward-model folder
    - device: auto, cpu or cuda
    - precision: fp32 or bf16

    Data parallel: `torchrun --nproc_per_node N -m flows.cli train ...` (gloo on CPU, NCCL on
    GPU); ppo.rollout_batch_size and ppo.mini_batch_size are then per rank.
    """
    from flows import stages
    from ppo_core.parallel.process_group import is_main_process

    cfg = _run(lambda: _load(config, overrides))
    summary = _run(lambda: stages.train(cfg, show_progress=not quiet))
    if not is_main_process():  # under torchrun, rank 0 reports
        return
    m = summary.final_metrics
    console.print(
        f"trained {summary.iterations} iterations (resumed at {summary.resumed_from}); "
        f"score {m.get('rollout/score', float('nan')):.3f}, KL {m.get('rollout/kl', float('nan')):.2f}; "
        f"policy in [bold]{summary.output_dir}[/]"
    )


def _estimator_help() -> str:
    """What ``ppo train --help`` says of ``ppo.advantage_estimator``, from the estimators'
    registry (:data:`ppo_core.math.choices.ESTIMATOR_NEEDS`), so a new estimator appears in it."""
    from ppo_core.math.choices import ESTIMATOR_NEEDS, critic_free_estimators

    with_critic = [name for name, needs in ESTIMATOR_NEEDS.items() if needs.critic]
    grouped = [name for name, needs in ESTIMATOR_NEEDS.items() if needs.groups]
    return (
        f"{' or '.join(with_critic)} (with a critic) or, with model.critic=none, "
        f"{', '.join(critic_free_estimators())}; {', '.join(grouped)} need "
        "ppo.samples_per_prompt >= 2"
    )


train.__doc__ = (train.__doc__ or "").replace("{estimators}", _estimator_help())


@app.command()
def evaluate(
    config: ConfigOption = None,
    overrides: Overrides = None,
    candidate: Annotated[
        str | None, typer.Option(help="Model folder (default train.output_dir).")
    ] = None,
    baseline: Annotated[
        str | None, typer.Option(help="Model folder (default model.policy); '' for none.")
    ] = None,
) -> None:
    """Score a candidate and a baseline on held-out prompts (data.eval_file).

    Same prompts, seed and sampling for both. Reports mean score, positive rate, KL to the
    reference (nats per sequence), response length, EOS rate and distinct-1/2, with samples, in
    eval.output_dir (metrics.json, samples.json, report.md).
    """
    from flows import stages

    cfg = _run(lambda: _load(config, overrides))
    reports = _run(lambda: stages.evaluate(cfg, candidate, baseline if baseline != "" else None))
    from rich.table import Table

    from ppo_core.evaluation.evaluate import metric_table

    table = Table(title=f"evaluation ({cfg.eval.output_dir})")
    table.add_column("metric")
    for name in reports:
        table.add_column(name, justify="right")
    for key, cells in metric_table(reports):
        table.add_row(key, *cells)
    Console().print(table)


@app.command()
def promote(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Promote the evaluated candidate to production if it passes the gate (`promote.*`).

    The candidate must beat the baseline's held-out score by promote.min_improvement, stay
    within promote.max_kl of its reference and promote.max_kl_from_origin of the first model of
    its chain of generations, and end responses with EOS often enough (promote.min_eos_rate).

    Guards against a gamed reward compare it with the baseline: distinct-2 may fall by at most
    promote.max_distinct_2_drop, the reference's NLL of its responses may rise by at most
    promote.max_nll_increase, and with promote.check_reward its check score may fall by at most
    promote.max_check_drop.

    A metric any rule reads that is missing, NaN or infinite fails that rule ("cannot judge"),
    naming it.

    A pass copies it to a new version under promote.production_dir; either way the decision,
    each rule's verdict and the lineage go to promote.registry and promote.report. A rejection
    exits with code 0.
    """
    from flows import stages

    cfg = _run(lambda: _load(config, overrides))
    entry = _run(lambda: stages.promote(cfg))
    verdict = (
        f"[bold green]promoted[/] as {entry['version']}"
        if entry["decision"] == "promoted"
        else "[bold yellow]rejected[/]"
    )
    console.print(f"candidate {verdict}", soft_wrap=True)
    for reason in entry["reasons"]:
        console.print(f"  {reason}", soft_wrap=True)


@app.command("export")
def export_command(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Write a production version as one GGUF file, for llama.cpp, Ollama and LM Studio.

    Exports export.version (default: the current production version) in export.type (`f32`,
    `f16` or `q8_0`) to `export.dir/<version>-<type>.gguf`, with the tokenizer and the chat
    template in the file, and a record beside it (`<version>-<type>.json`: the version, its
    content hash, the file's SHA-256). The registry entry of the version names the export.

    The version is checked against the content hash the registry recorded; an adapter (LoRA)
    version is merged into its base first. An existing file is never replaced. Llama, Mistral,
    Qwen2 (SmolLM2 is Llama) and GPT-2 models with a byte-level BPE tokenizer are exported;
    anything else is refused with the reason.

    On demand through DVC: `dvc repro serving/dvc.yaml`.
    """
    from flows import stages

    cfg = _run(lambda: _load(config, overrides))
    started = time.perf_counter()
    record = _run(lambda: stages.export(cfg))
    path = Path(cfg.export.dir) / record["file"]
    if record.get("already_exported"):
        console.print(f"{path} is already the export of {record['version']}: nothing to do")
        return
    console.print(
        f"exported {record['version']} as [bold]{path}[/] ({record['bytes'] / 1e6:.1f} MB, "
        f"{record['type']}, sha256 {record['sha256'][:12]}...) in "
        f"{time.perf_counter() - started:.0f} s; record in {path.with_suffix('.json')}",
        soft_wrap=True,
    )
    for note in record["notes"]:
        console.print(f"  note: {note}", soft_wrap=True)


@app.command()
def rollback(
    version: Annotated[
        str, typer.Argument(help="The earlier production version, e.g. v0002.", show_default=False)
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
            "deployment run does (only where they are backed up already: a .dvc pointer exists)."
        ),
    ] = True,
    config: ConfigOption = None,
    overrides: Overrides = None,
) -> None:
    """Make an earlier production version current again.

    The version is checked against the content hash the registry recorded when it was promoted
    (and an adapter version's stored base against its fingerprint) before anything changes;
    nothing is copied or deleted. The registry records who rolled back, when, why, and from
    which version; the next `from_production` run (scheduled retraining) starts from it.
    """
    import getpass

    from flows.orchestration.records import back_up_production, pointer_files
    from ppo_core.registry.versions import roll_back

    cfg = _run(lambda: _load(config, overrides))
    entry = _run(
        lambda: roll_back(
            registry_path=cfg.promote.registry,
            production_dir=cfg.promote.production_dir,
            version=version,
            reason=reason,
            by=by or getpass.getuser(),
        )
    )
    console.print(
        f"production is [bold]{version}[/] again (was {entry['previous']}); recorded in "
        f"{cfg.promote.registry}",
        soft_wrap=True,
    )
    if backup and all(Path(p).is_file() for p in pointer_files(cfg)):
        console.print(back_up_production(".", cfg).message, soft_wrap=True)
    elif backup:
        console.print(
            "not backed up: production has no DVC pointer yet (a deployment run with backup "
            "makes one)",
            soft_wrap=True,
        )


@app.command()
def notify(
    webhook: Annotated[
        str,
        typer.Option(
            "--webhook",
            help="The URL that receives a JSON POST {subject, body} for each notification.",
            show_default=False,
        ),
    ],
    header: Annotated[
        list[str] | None,
        typer.Option(
            "--header",
            metavar="NAME=VALUE",
            help="A header to send with each notification (e.g. Authorization=Bearer ...).",
        ),
    ] = None,
) -> None:
    """Tell someone when a retraining run needs a person: a rejected candidate, a failed run, a
    crashed run.

    Saves a Prefect Custom Webhook notification block and creates the server automations
    `retrain-notify-rejected` and `retrain-notify-failed` (replacing earlier ones) on the server
    of PREFECT_API_URL; the server sends the notifications itself. Run it once per server.
    """
    if not os.environ.get("PREFECT_API_URL"):
        console.print(
            "[bold red]error:[/] PREFECT_API_URL is not set: notifications are kept by a Prefect "
            "server (`prefect server start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api)",
            soft_wrap=True,
        )
        raise typer.Exit(code=2)
    headers = {}
    for item in header or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            console.print(f"[bold red]error:[/] --header {item!r} is not NAME=VALUE")
            raise typer.Exit(code=2)
        headers[name] = value
    from flows.orchestration.notifications import BLOCK_NAME, set_up_notifications

    created = set_up_notifications(webhook, headers)
    console.print(
        f"notification block {BLOCK_NAME} and automations {', '.join(created)} created: "
        "a rejected candidate, a failed and a crashed run of retrain are sent to the webhook",
        soft_wrap=True,
    )


@app.command()
def ingest(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="Prompt files (.jsonl, .parquet) to add.", metavar="FILE", show_default=False
        ),
    ],
    config: ConfigOption = None,
    no_event: Annotated[
        bool,
        typer.Option("--no-event", help="Add the files without telling the Prefect server."),
    ] = False,
) -> None:
    """Add new raw prompt files for the next retraining run, and tell Prefect.

    Each file is read as `ppo prepare` reads raw files (a malformed one is refused, naming the
    file and line, before anything is written), then copied into `ingest.inbox_dir`, all files
    or none. The next run of the Prefect flow `retrain` moves them into `data.raw_dir` before it
    prepares; files that arrive during a run wait for the next one.

    With `PREFECT_API_URL` set, the event `ppo.data.ingested` goes to that server, where it
    starts the deployment `retrain/on-new-data` (`prefect deploy --all`, see prefect.yaml).
    Without it, nothing is triggered: `python -m flows.pipeline run` (or `make run`) takes them.
    """
    from prefect.settings import PREFECT_API_URL

    from flows.ingest import emit_ingested, ingest_files

    cfg = _run(lambda: _load(config, None))
    result = _run(lambda: ingest_files(cfg, files))
    for path in result.already_there:
        console.print(f"{path} already holds these bytes: nothing to add", soft_wrap=True)
    for path in result.added:
        console.print(f"added {path} ({result.prompts[path.name]} prompts)", soft_wrap=True)
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
            f"[bold red]error:[/] the files are in {cfg.ingest.inbox_dir}, but the event could "
            f"not reach the Prefect server at {PREFECT_API_URL.value()} ({exc}); the next run "
            "takes them",
            soft_wrap=True,
        )
        raise typer.Exit(code=1) from None
    console.print(
        f"sent ppo.data.ingested to {PREFECT_API_URL.value()}: it starts retrain/on-new-data",
        soft_wrap=True,
    )


@app.command()
def compare(
    all_commits: Annotated[
        bool, typer.Option("--all-commits", help="Every commit's runs, not only HEAD's.")
    ] = False,
) -> None:
    """Compare runs: experiments (`dvc exp run`) and commits side by side.

    One row a run, with the params that differ between the runs and the headline numbers:
    held-out score, positive rate, KL to the reference, EOS rate and distinct-2 of the candidate
    (`reports/eval/metrics.json`), and training tokens/s. Reads `dvc exp show --json`; `dvc exp
    show` has every param and metric, `dvc exp diff A B` two runs change by change.
    """
    from rich import box
    from rich.table import Table

    from flows.experiments import HEADLINE, compare_runs, format_number

    try:
        comparison = compare_runs(".", all_commits=all_commits)
    except RuntimeError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    # a rule under the header and no cell borders: eight numbers and the changed params fit in
    # 100 columns, where a boxed table cut the param names to "ppo.clip…"
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("run", no_wrap=True)
    for key in comparison.changed:  # the param's name is the point of its column: never cut
        table.add_column(key, justify="right", min_width=len(key), no_wrap=True)
    for _, title in HEADLINE:
        table.add_column(title, justify="right")
    for run in comparison.runs:
        params = [str(run.params.get(key, "-")) for key in comparison.changed]
        numbers = [format_number(run.metrics.get(key)) for key, _ in HEADLINE]
        table.add_row(run.name, *params, *numbers)
    out = Console()
    out.print(table)
    if not comparison.changed:
        out.print("no param differs between these runs")


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
