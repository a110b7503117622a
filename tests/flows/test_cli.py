"""The `ppo` command: help, config listing, and one clear line for errors users can fix."""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.config import Config, flatten, to_yaml
from tests.flows.conftest import environment

runner = CliRunner()


COMMANDS = [
    "config",
    "prepare",
    "validate",
    "reward",
    "base",
    "train",
    "evaluate",
    "promote",
    "export",
    "rollback",
    "notify",
    "ingest",
    "compare",
    "tasks",
]
NOTICE = "config: params.yaml (--config FILE for another, --config none for the defaults)\n"


@pytest.fixture(autouse=True)
def _in_an_empty_folder(tmp_path, monkeypatch):
    """Every test runs where there is no params.yaml, unless it writes one: the command reads
    ./params.yaml by default, and the project's own must not leak into these tests."""
    monkeypatch.chdir(tmp_path)


def test_help_lists_the_stages():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    # the Commands panel, not the description above it (which names every stage too)
    panel = result.output.split("Commands")[1]
    assert re.findall(r"^\W+([a-z]+)  ", panel, flags=re.MULTILINE) == COMMANDS
    for command in COMMANDS:  # and each is a command of its own
        usage = runner.invoke(app, [command, "--help"])
        assert usage.exit_code == 0 and f"Usage: ppo {command} [OPTIONS]" in usage.output


def _paragraphs(doc: str) -> list[str]:
    """A help text's paragraphs and list items as the terminal shows them, each on one line when
    the terminal is wide enough (Markdown: code spans lose their backticks)."""
    out = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        items = re.split(r"^- ", paragraph, flags=re.MULTILINE)
        if paragraph.startswith("- "):
            out += ["• " + " ".join(item.split()) for item in items[1:]]
        else:
            out.append(" ".join(paragraph.split()))
    return [text.replace("`", "") for text in out]


def _lines(args: list[str], columns: int) -> list[str]:
    result = runner.invoke(app, args, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return [line.strip(" │") for line in result.output.splitlines()]


def test_help_paragraphs_wrap_as_sentences_not_at_the_docstring_line_breaks():
    callbacks = {c.name or c.callback.__name__: c.callback for c in app.registered_commands}
    for command in COMMANDS:
        lines = _lines([command, "--help"], 400)
        for paragraph in _paragraphs(callbacks[command].__doc__):
            assert paragraph in lines, (command, paragraph)
    lines = _lines(["--help"], 400)
    for paragraph in _paragraphs(app.info.help):
        assert paragraph in lines, paragraph
    for command in COMMANDS:  # the Commands panel: each command's first paragraph
        first = _paragraphs(callbacks[command].__doc__)[0]
        assert any(re.fullmatch(rf"{command}\s+{re.escape(first)}", line) for line in lines)
    # and in an ordinary terminal no line ends mid-paragraph where the docstring did
    for columns in (80, 120):
        text = "\n".join(_lines(["prepare", "--help"], columns))
        assert "(train/eval parquet and a\n" not in text


TRAIN_SETTINGS = [
    "train.iterations",
    "ppo.rollout_batch_size",
    "ppo.mini_batch_size",
    "ppo.micro_batch_size",
    "optim.lr",
    "kl.coef",
    "model.policy",
    "model.reward",
    "device",
    "precision",
]


@pytest.mark.parametrize("columns", [80, 120])
def test_train_help_names_the_settings_changed_most(columns):
    lines = _lines(["train", "--help"], columns)
    for key in TRAIN_SETTINGS:
        assert key in flatten(Config())  # a real key
        assert len([line for line in lines if line.startswith(f"• {key}: ")]) == 1, key


def test_config_prints_resolved_yaml():
    result = runner.invoke(app, ["config", "ppo.epochs=2", "kl.estimator=k3"])
    assert result.exit_code == 0
    printed = yaml.safe_load(result.stdout)
    assert printed["ppo"]["epochs"] == 2 and printed["kl"]["estimator"] == "k3"  # not the defaults
    assert printed["ppo"]["mini_batch_size"] == 16  # and the rest resolved from the defaults


def test_params_yaml_in_the_working_folder_is_read_by_default(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 7\nppo:\n  epochs: 3\n")
    result = runner.invoke(app, ["config", "ppo.epochs=2"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert (printed["seed"], printed["ppo"]["epochs"]) == (7, 2)  # the file, then the override
    assert result.stderr == NOTICE  # said once, on stderr, so stdout stays YAML


def test_config_none_uses_the_defaults_alone(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 7\n")
    result = runner.invoke(app, ["config", "--config", "none"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["seed"] == 0 and result.stderr == ""


def test_an_explicit_config_file_replaces_params_yaml(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 7\n")
    (tmp_path / "other.yaml").write_text("seed: 9\n")
    result = runner.invoke(app, ["config", "-c", "other.yaml"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["seed"] == 9 and result.stderr == ""


def test_without_params_yaml_nothing_extra_is_said():
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout == to_yaml(Config())


def test_a_bad_params_yaml_is_one_clear_error(tmp_path):
    (tmp_path / "params.yaml").write_text("ppo: 5\n")
    result = runner.invoke(app, ["config"])
    assert result.exit_code == 2
    assert result.stderr.startswith(NOTICE)
    assert " ".join(result.stderr[len(NOTICE) :].split()) == (
        "error: bad value for config key 'ppo' (in params.yaml): a section of keys, not a value "
        "(got 5); set the keys inside it, e.g. ppo.rollout_batch_size=64"
    )


def test_config_docs_comments_every_key_and_loads_to_the_same_values(tmp_path):
    (tmp_path / "params.yaml").write_text("model:\n  policy: 'a # b: c'\n")
    args = ["config", "ppo.epochs=2", "model.reference='0.5'", "schedule.cron='# 1 * *'"]
    plain = runner.invoke(app, args)
    documented = runner.invoke(app, [*args, "--docs"])
    assert plain.exit_code == documented.exit_code == 0, documented.output
    assert yaml.safe_load(documented.stdout) == yaml.safe_load(plain.stdout)
    assert yaml.safe_load(documented.stdout)["model"]["reference"] == "0.5"
    lines = documented.stdout.splitlines()
    for key in flatten(Config()):  # every key has a comment right above it
        name, indent = key.rsplit(".", 1)[-1], "  " * key.count(".")
        at = (
            lines.index(f"{indent}{name}:")
            if f"{indent}{name}:" in lines
            else next(i for i, line in enumerate(lines) if line.startswith(f"{indent}{name}: "))
        )
        assert lines[at - 1].startswith(f"{indent}# "), key
    assert "  # Passes over each rollout batch.\n  epochs: 2\n" in documented.stdout


def test_a_config_typo_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", "ppo.epoch=2", f"train.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 2
    assert "unknown config key 'ppo.epoch' (override 'ppo.epoch=2')" in result.output
    assert "Did you mean 'ppo.epochs'?" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_model_folder_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", f"model.policy={tmp_path / 'missing'}"])
    assert result.exit_code == 2
    message = " ".join(result.output.split())  # the console wraps long lines
    assert message.startswith(
        f"error: model.policy folder '{tmp_path / 'missing'}' does not exist;"
    )
    assert "Traceback" not in result.output


def test_a_warning_is_one_line_without_the_source_line(tmp_path, monkeypatch):
    """`ppo` prints a warning as what happened, not as the project's file:line and code."""
    import warnings

    from flows.command import load_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    load_settings(None, [])
    text = warnings.formatwarning("not resuming from step-000080", UserWarning, __file__, 1)
    assert text == "warning: not resuming from step-000080\n"


def test_prepare_runs_without_importing_torch(tmp_path):
    # The stages that handle data and the registry start in under a second; torch and
    # transformers would add seconds to each (they are loaded by base, train and evaluate).
    raw = tmp_path / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "prompts.jsonl").write_text(
        "".join(f'{{"prompt": "The film number {i} was"}}\n' for i in range(40))
    )
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from flows.cli import app\n"
        "result = CliRunner().invoke(app, ['prepare', '--config', 'none'])\n"
        "assert result.exit_code == 0, result.output\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def _two_of_each(root):
    """Production versions v0001, v0002 and reward versions r0001, r0002 (tiny stand-in folders)
    where the default config puts them, under ``root``."""
    from ppo_core.registry.gate import GateDecision
    from ppo_core.registry.rewards import record_reward_decision
    from ppo_core.registry.versions import record_decision

    for n in (1, 2):
        folder = root / "candidates" / str(n)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "weights.bin").write_text(f"weights-{n}")
        record_decision(
            registry_path=root / "models" / "registry.json",
            production_dir=root / "models" / "production",
            candidate_dir=folder,
            decision=GateDecision(True, ["PASS"]),
            lineage={},
        )
        stats = {"reasons": ["PASS"], "score_mean": 0.0, "score_std": 1.0}
        record_reward_decision(root / "models" / "rewards", folder, True, stats)
    return root / "models" / "registry.json", root / "models" / "rewards" / "registry.json"


def test_rollback_reward_makes_an_earlier_reward_version_current(tmp_path):
    import getpass

    production, rewards = _two_of_each(tmp_path)
    before = production.read_bytes()
    result = runner.invoke(app, ["rollback", "--reward", "r0001", "--reason", "r0002 likes length"])
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()) == (
        f"the reward model is r0001 again (was r0002); recorded in {Path('models/rewards')}"
        "/registry.json"
    )
    entry = json.loads(rewards.read_text())["entries"][-1]
    assert {k: v for k, v in entry.items() if k != "date"} == {
        "decision": "rolled back",
        "rolled_back_to": "r0001",
        "previous": "r0002",
        "reason": "r0002 likes length",
        "by": getpass.getuser(),  # as the production rollback records it
    }
    assert json.loads(rewards.read_text())["current"] == "r0001"
    assert production.read_bytes() == before  # production is left as it is

    # --by, the flag after VERSION, and reward_model.versions_dir as an override
    moved = tmp_path / "elsewhere"
    (tmp_path / "models" / "rewards").rename(moved)
    result = runner.invoke(
        app,
        [
            "rollback",
            "r0002",
            "--reward",
            "-m",
            "drill",
            "--by",
            "ops",
            f"reward_model.versions_dir={moved}",
        ],
    )
    assert result.exit_code == 0, result.output
    entry = json.loads((moved / "registry.json").read_text())["entries"][-1]
    assert (entry["rolled_back_to"], entry["previous"], entry["by"]) == ("r0002", "r0001", "ops")


def test_the_production_rollback_leaves_the_reward_versions_alone(tmp_path):
    production, rewards = _two_of_each(tmp_path)
    before = rewards.read_bytes()
    result = runner.invoke(app, ["rollback", "v0001", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 0, result.output
    assert "production is v0001 again (was v0002)" in result.output
    assert json.loads(production.read_text())["current"] == "v0001"
    assert rewards.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--reward", "r0009"],
            "the reward registry models/rewards/registry.json has no promoted version r0009",
        ),
        (["--reward", "v0001"], "'v0001' is not a reward version name (r0001, r0002, ...)"),
        (["--reward", "r0002"], "r0002 is already the current reward version"),
        (["--reward", "r0001", "--reason", " "], "a rollback needs a reason (--reason)"),
        (["r0001"], "r0001 is a reward model version; `ppo rollback --reward r0001` makes it"),
    ],
)
def test_a_reward_rollback_that_cannot_be_done_is_one_line(tmp_path, args, message):
    production, rewards = _two_of_each(tmp_path)
    before = production.read_bytes(), rewards.read_bytes()
    reason = [] if "--reason" in args else ["--reason", "drill"]
    result = runner.invoke(app, ["rollback", *args, *reason])
    assert result.exit_code == 2
    [line] = result.output.splitlines()
    assert line.startswith(f"error: {message}")
    assert (production.read_bytes(), rewards.read_bytes()) == before


def test_a_reward_version_changed_on_disk_is_not_rolled_back_to(tmp_path):
    _, rewards = _two_of_each(tmp_path)
    folder = rewards.parent / "r0001"
    (folder / "weights.bin").write_text("edited")
    result = runner.invoke(app, ["rollback", "--reward", "r0001", "--reason", "drill"])
    assert result.exit_code == 2
    [line] = result.output.splitlines()
    assert line.startswith(f"error: reward version r0001 in {folder.relative_to(tmp_path)} no ")
    assert json.loads(rewards.read_text())["current"] == "r0002"


def _versions(root, count: int):
    """Production versions v0001 ... (tiny stand-in folders) where the default config puts
    them, under ``root``; returns the registry's path."""
    from ppo_core.registry.gate import GateDecision
    from ppo_core.registry.versions import record_decision

    for n in range(1, count + 1):
        folder = root / "candidates" / str(n)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_text(f"weights-{n}")
        record_decision(
            registry_path=root / "models" / "registry.json",
            production_dir=root / "models" / "production",
            candidate_dir=folder,
            decision=GateDecision(True, ["PASS"]),
            lineage={},
        )
    return root / "models" / "registry.json"


FAIR_SIDE = {
    "score": 0.6,
    "kl_to_reference": 1.0,
    "kl_to_origin": 1.0,
    "eos_rate": 1.0,
    "distinct_2": 0.8,
    "reference_nll": 2.0,
}


def _scheduled_run_evaluated(root, parent: str, baseline: str) -> None:
    """What a scheduled run leaves before its promote stage: ``models/base`` imported from
    production version ``parent``, a candidate trained on it and its evaluation against
    ``baseline`` (a folder), which it passes."""
    base = root / "models" / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_text("base weights")
    (base / "imported_from.json").write_text(json.dumps({"parent_version": parent}))
    candidate = root / "models" / "candidate"
    candidate.mkdir(exist_ok=True)
    (candidate / "config.json").write_text("{}")
    (candidate / "model.safetensors").write_text("trained weights")
    evaluation = root / "reports" / "eval"
    evaluation.mkdir(parents=True, exist_ok=True)
    sides = {"candidate": FAIR_SIDE, "baseline": {**FAIR_SIDE, "score": 0.3}}
    flat = {f"{s}/{k}": v for s, metrics in sides.items() for k, v in metrics.items()}
    (evaluation / "metrics.json").write_text(json.dumps(flat))
    models = {"candidate": "models/candidate", "baseline": baseline}
    (evaluation / "models.json").write_text(json.dumps(models))


def test_a_promotion_cannot_silently_undo_a_rollback(tmp_path):
    """A scheduled run evaluates its candidate (trained from v0002) against v0002; an operator
    rolls back to v0001; the run's promote must not make a child of v0002 production again."""
    registry = _versions(tmp_path, 2)
    _scheduled_run_evaluated(tmp_path, parent="v0002", baseline="models/production/v0002")
    rolled = runner.invoke(app, ["rollback", "v0001", "--reason", "v0002 regressed", "--no-backup"])
    assert rolled.exit_code == 0, rolled.output
    after_rollback = registry.read_bytes()

    def refused(message: str) -> None:
        result = runner.invoke(app, ["promote"])
        assert result.exit_code == 2, result.output
        [line] = result.output.splitlines()
        assert line.startswith(f"error: {message}"), line
        assert registry.read_bytes() == after_rollback
        assert sorted(p.name for p in (tmp_path / "models" / "production").iterdir()) == [
            "v0001",
            "v0002",
        ]
        assert not (tmp_path / "reports" / "promotion.json").exists()

    refused(
        "the candidate was trained from production version v0002 (its base's parent), but the "
        "current version is v0001 (a rollback or another promotion since); nothing was recorded. "
        "Retrain from v0001 (a from_production run, or `ppo base base.source="
        f"{Path('models/production/v0001')}`, `ppo train`, `ppo evaluate`), then promote"
    )
    # retrained from v0001, but the evaluation is still the one against v0002
    _scheduled_run_evaluated(tmp_path, parent="v0001", baseline="models/production/v0002")
    refused(
        "the evaluation compared the candidate with production version v0002, but the current "
        "version is v0001 (a rollback or another promotion since); nothing was recorded. Run "
        "`ppo evaluate` again (it compares with the current version), then promote"
    )
    # evaluated again, against v0001: promoted as v0003, a child of v0001
    _scheduled_run_evaluated(tmp_path, parent="v0001", baseline="models/production/v0001")
    result = runner.invoke(app, ["promote"])
    assert result.exit_code == 0, result.output
    book = json.loads(registry.read_text())
    assert book["current"] == "v0003" and book["entries"][-1]["parent_version"] == "v0001"


def test_a_rollback_while_a_run_holds_the_retraining_lock_is_refused(tmp_path):
    from ppo_core.files import exclusive_run

    registry = _versions(tmp_path, 2)
    before = registry.read_bytes()
    with exclusive_run(tmp_path / ".retrain.lock", "retraining run in this repository"):
        result = runner.invoke(app, ["rollback", "v0001", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert re.fullmatch(
        r"error: another retraining run in this repository is running \(pid \d+ since \S+; "
        r"lock \.retrain\.lock\); wait for it to finish or stop it, then start again",
        line,
    ), line
    assert registry.read_bytes() == before
    # once the run has ended, the rollback goes through
    result = runner.invoke(app, ["rollback", "v0001", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 0, result.output
    assert json.loads(registry.read_text())["current"] == "v0001"


def test_a_rollback_to_a_version_the_registry_never_had_lists_the_versions(tmp_path):
    registry = _versions(tmp_path, 3)
    before = registry.read_bytes()
    result = runner.invoke(app, ["rollback", "v0009", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line == (
        f"error: the registry {Path('models/registry.json')} has no production version v0009; "
        "its versions are v0001, v0002, v0003 (current: v0003)"
    )
    assert registry.read_bytes() == before


def test_a_rollback_to_a_version_named_with_other_digits_is_refused(tmp_path):
    registry = _versions(tmp_path, 2)
    before = registry.read_bytes()
    result = runner.invoke(app, ["rollback", "v٠٠٠١", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line == "error: 'v٠٠٠١' is not a version name (v0001, v0002, ...)"
    assert registry.read_bytes() == before


def test_a_rollback_to_a_version_changed_on_disk_is_refused(tmp_path):
    """`ppo rollback` checks the version it makes current against the content hash the registry
    recorded, as every other use of a version does."""
    registry = _versions(tmp_path, 2)
    before = registry.read_bytes()
    (tmp_path / "models" / "production" / "v0001" / "model.safetensors").write_text("swapped")
    result = runner.invoke(app, ["rollback", "v0001", "--reason", "drill", "--no-backup"])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith(
        "error: production version v0001 in models/production/v0001 no longer matches the "
        "content hash the registry recorded when it was promoted"
    ), line
    assert registry.read_bytes() == before
