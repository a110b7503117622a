"""The ``ppo`` command: one subcommand per pipeline stage, then the commands that operate
production (``flows/operations.py``). ``flows/command.py`` holds the app, the shared options and
the error handling.

Every subcommand reads ``./params.yaml`` when there is one (``--config FILE`` for another YAML
file, ``--config none`` for the built-in defaults alone) and takes ``key=value`` overrides of any
config key, e.g. ``ppo train ppo.mini_batch_size=32 optim.lr=1e-4``. Run ``ppo config`` to see
every key with its current value, ``ppo config --docs`` to see what each one does.

Each subcommand imports what it runs when it runs, so that ``ppo --help`` and the light stages
start without importing torch, transformers, Great Expectations or Prefect.
"""

from __future__ import annotations

import ast
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from flows import operations
from flows.command import ConfigOption, Overrides, app, console, load_settings, run_or_exit
from flows.tasks import tasks
from ppo_core.catalog import declared_in
from ppo_core.files.artifacts import DATA_MANIFEST


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

    cfg = load_settings(config, overrides)
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

    cfg = load_settings(config, overrides)
    path = run_or_exit(lambda: stages.prepare(cfg))
    manifest = (path / DATA_MANIFEST).read_text()
    info = json.loads(manifest)
    c = info["counts"]
    console.print(
        f"prepared {c['train']} train / {c['eval']} eval prompts from {c['raw']} raw rows "
        f"({c['duplicates']} duplicates, {c['empty']} empty dropped) in [bold]{path}[/]; "
        f"data version {info['content_hash'][:12]}"
    )
    feedback = json.loads((path / "feedback" / DATA_MANIFEST).read_text())
    if feedback["pairs"] or feedback["sources"]:
        f = feedback["counts"]
        console.print(
            f"feedback: {f['train']} train / {f['eval']} eval pairs from {f['pair_rows']} pair "
            f"rows and {f['rating_rows']} ratings ({f['ratings_pairs']} pairs made from "
            f"ratings, {f['ratings_unpaired']} ratings without a counterpart, "
            f"{f['duplicates']} duplicates dropped)"
        )
        capped = f.get("ratings_capped_per_prompt", 0) + f.get("ratings_capped_total", 0)
        if capped:
            console.print(
                f"feedback: {capped} pairs of ratings not made (data.max_pairs_per_prompt="
                f"{cfg.data.max_pairs_per_prompt}, data.max_rating_pairs="
                f"{cfg.data.max_rating_pairs})"
            )


@app.command()
def validate(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Check data.interim_dir with Great Expectations; publish it to data.prepared_dir if it
    passes. Data Docs and summary.json go to validation.report_dir, on failure too."""
    from flows import stages
    from flows.validation import DataValidationError

    cfg = load_settings(config, overrides)
    try:
        path = run_or_exit(lambda: stages.validate(cfg))
    except DataValidationError as exc:
        console.print(f"[bold red]validation failed:[/] {exc}", soft_wrap=True)
        raise typer.Exit(code=1) from None
    console.print(
        f"data valid; published to [bold]{path}[/] (report in {cfg.validation.report_dir})"
    )


@app.command()
def reward(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Train a reward model on the feedback pairs in data.prepared_dir/feedback and promote it
    as the next reward version when it passes its gate.

    The model starts from reward_model.base (default: model.policy) with a new scalar head and
    learns the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - reward_model.margin).

    It is judged on the held-out pairs (accuracy, margin, calibration, accuracy by length bias)
    against the current version on the same pairs: it must reach
    reward_model.gate.min_accuracy and fall at most reward_model.gate.max_accuracy_drop below.

    A pass writes reward_model.versions_dir/rNNNN and makes it current; PPO uses it with
    model.reward=reward:current. Reports go to reward_model.report_dir. Without feedback pairs
    it trains nothing.
    """
    from flows.loggers import ConsoleProgress
    from flows.orchestration.project import stage_retrain_lock
    from flows.reward_stage import reward as run_reward

    cfg = load_settings(config, overrides)
    bar = ConsoleProgress(0, label="reward model", unit="step")
    held = contextlib.ExitStack()
    # a rollback of the reward while it trains must not be undone by its decision
    run_or_exit(lambda: held.enter_context(stage_retrain_lock()))
    try:
        run_or_exit(
            lambda: run_reward(
                cfg,
                progress=lambda line: console.print(line, soft_wrap=True),
                on_step=bar.step,
            )
        )
    finally:
        bar.close()
        held.close()


@app.command()
def base(config: ConfigOption = None, overrides: Overrides = None) -> None:
    """Put the starting policy in model.policy: import base.source, or build the tiny default."""
    from flows import stages

    cfg = load_settings(config, overrides)
    started = time.perf_counter()
    path = run_or_exit(lambda: stages.base(cfg))
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
    - ppo.micro_batch_tokens: padded tokens per forward/backward pass instead (as many rows as
      fit: more when responses are short); memory and speed, not the result
    - optim.lr: learning rate
    - kl.coef: weight of the KL penalty against the reference model
    - ppo.advantage_estimator: {estimators}
    - model.policy: folder of the model to start from
    - model.reward: builtin:sentiment, module:function or a reward-model folder
    - device: auto, cpu or cuda
    - precision: auto (bf16 where it pays: a GPU, or a CPU with bf16 instructions), fp32 or bf16

    Data parallel: `torchrun --nproc_per_node N -m flows.cli train ...` (gloo on CPU, NCCL on
    GPU); ppo.rollout_batch_size and ppo.mini_batch_size are then per rank.
    """
    from flows import stages
    from ppo_core.parallel.process_group import is_main_process

    cfg = load_settings(config, overrides)
    summary = run_or_exit(lambda: stages.train(cfg, show_progress=not quiet))
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
    registry (:data:`ppo_core.math.declarations.ESTIMATOR_NEEDS`), so a new estimator appears in it."""
    from ppo_core.math.declarations import ESTIMATOR_NEEDS, critic_free_estimators

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

    cfg = load_settings(config, overrides)
    reports = run_or_exit(
        lambda: stages.evaluate(cfg, candidate, baseline if baseline != "" else None)
    )
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

    A candidate trained from, or evaluated against, a production version that is no longer the
    current one (a rollback since) is refused before anything is written: evaluate again (and
    retrain, when its base came from that version).
    """
    from flows import stages

    cfg = load_settings(config, overrides)
    entry = run_or_exit(lambda: stages.promote(cfg))
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
    version is merged into its base first. Llama, Mistral, Qwen2 (SmolLM2 is Llama) and GPT-2
    models with a byte-level BPE tokenizer are exported; anything else is refused with the
    reason.

    An existing file is never replaced, and is reported as this export only when its SHA-256 is
    the one the registry recorded for it.

    On demand through DVC: `dvc repro serving/dvc.yaml`.
    """
    from flows import stages

    cfg = load_settings(config, overrides)
    started = time.perf_counter()
    record = run_or_exit(lambda: stages.export(cfg))
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


def _stage_command(name: str):
    """The ``ppo <name>`` command of a registered stage that has no command above: it runs the
    stage on the loaded config and prints what the stage returns."""

    def command(config: ConfigOption = None, overrides: Overrides = None) -> None:
        from flows.stages import STAGES

        cfg = load_settings(config, overrides)
        result = run_or_exit(lambda: STAGES[name](cfg))
        console.print(f"{name}: {result}", soft_wrap=True)

    return command


def _add_stage_commands() -> None:
    """A command for each stage ``flows/stages.py`` registers without a command of its own, with
    its docstring as the help; read from the file's text, so ``ppo --help`` imports no stage."""
    source = Path(__file__).with_name("stages.py").read_text(encoding="utf-8")
    documented = {
        node.name: ast.get_docstring(node) or ""
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
    }
    commands = {info.name for info in app.registered_commands if info.name}
    commands |= {info.callback.__name__ for info in app.registered_commands if info.callback}
    for name in declared_in(source, "stage"):
        if name not in commands:
            app.command(name, help=documented.get(name, ""))(_stage_command(name))


_add_stage_commands()
# After the stages, so that `ppo --help` lists the pipeline first.
for command in (
    operations.rollback,
    operations.notify,
    operations.ingest,
    operations.compare,
    tasks,
):
    app.command()(command)


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
