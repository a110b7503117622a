"""The pipeline's stages as plain functions of the config (one implementation each).

``dvc.yaml`` runs them as ``ppo <stage>``; the Prefect flow calls the same commands. Each reads
and writes files only, and writes its outputs atomically.

Torch, transformers, pandas and Great Expectations (seconds each to import), and the loggers
(rich's progress bars), are imported inside the stages that use them, so that ``ppo --help`` and
the light stages start at once; everything else is imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from flows.provenance import code_version
from flows.raw_data import (
    check_raw_data_is_prepared,
    in_eval_split,
    normalise_prompt,
    raw_sources,
    read_raw_prompts,
)
from ppo_core.config import WRITE_KEYS, Config, ConfigError, check_write_paths, flatten
from ppo_core.files import (
    MAX_COPY_BYTES,
    UnsafeCopyError,
    atomic_folder,
    atomic_write_text,
    check_replaceable_file,
    copy_regular_file,
    copy_regular_tree,
    file_sha256,
    folder_fingerprint,
    printable,
    regular_files,
)
from ppo_core.files.output_paths import inside, real_path
from ppo_core.models.adapter_folders import (
    ADAPTER_BASE_FILE,
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_base_folder,
    is_adapter_folder,
    recorded_fingerprint,
)
from ppo_core.prompts import (
    CHAT_FIELD,
    Prompt,
    PromptFileError,
    is_chat,
    parquet_size,
    parse_messages,
    project_path,
)
from ppo_core.registry.lineage import Lineage, read_lineage, store_base
from ppo_core.registry.versions import (
    check_version,
    current_production,
    gate,
    promoted_entry,
    record_decision,
    record_export,
)
from ppo_core.sources.hub_cache import resolve_model_source, snapshot_blobs


def prepare(config: Config) -> Path:
    """Clean, deduplicate and split the raw prompts into a versioned train/eval set.

    Reads every ``*.jsonl`` / ``*.parquet`` in ``data.raw_dir`` (sorted by name), strips and
    normalises whitespace, drops empty prompts and duplicates (first occurrence wins), splits by a
    hash of each prompt, and writes ``train.parquet``, ``eval.parquet`` and ``manifest.json``
    (content hash, counts, source files with their hashes) into ``data.interim_dir``, atomically;
    ``validate`` publishes it to ``data.prepared_dir``.
    A malformed line fails the stage naming its file and line; nothing is written then. So does a
    raw file over ``data.max_rows_per_file`` or ``data.max_bytes_per_file``, and a split over them
    (training and evaluation read the splits under the same caps). The manifest names each source
    as ``project_path`` does: relative to the working folder, or by its name alone outside it.
    """
    import pandas as pd

    data = config.data
    prompts, counts, source_info, chat = _distinct_prompts(config)
    column = CHAT_FIELD if chat else data.prompt_field
    evals = [p for p in prompts if in_eval_split(p, data.split_seed, data.eval_fraction)]
    trains = [p for p in prompts if not in_eval_split(p, data.split_seed, data.eval_fraction)]
    if not trains or not evals:
        raise PromptFileError(
            f"{len(prompts)} distinct prompts give {len(trains)} train and {len(evals)} eval "
            f"prompts with data.eval_fraction={data.eval_fraction}; both splits need prompts"
        )
    # Each split is a prompt file that `ppo train` or `ppo evaluate` reads under the same caps.
    readers = {"train": "`ppo train`", "eval": "`ppo evaluate`"}
    for split, items in (("train", trains), ("eval", evals)):
        if len(items) > data.max_rows_per_file:
            raise PromptFileError(
                f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {len(items)} prompts, "
                f"more than data.max_rows_per_file={data.max_rows_per_file}, so {readers[split]} "
                "could not read it; raise the limit"
            )
    content = hashlib.sha256()
    for split, items in (("train", trains), ("eval", evals)):
        for prompt in items:
            content.update(f"{split}\x00{prompt}\n".encode())
    manifest = {
        "content_hash": content.hexdigest(),
        "counts": {**counts, "train": len(trains), "eval": len(evals)},
        "eval_fraction": data.eval_fraction,
        "split_seed": data.split_seed,
        "sources": source_info,
    }

    def write(tmp: Path) -> None:
        for split, items in (("train", trains), ("eval", evals)):
            pd.DataFrame({column: items}).to_parquet(tmp / f"{split}.parquet", index=False)
            # the size a reader measures first, known only once written
            _, size = parquet_size(tmp / f"{split}.parquet", column)
            if size > data.max_bytes_per_file:
                raise PromptFileError(
                    f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {size} bytes "
                    f"uncompressed, more than data.max_bytes_per_file={data.max_bytes_per_file}, "
                    f"so {readers[split]} could not read it; raise the limit"
                )
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))

    return atomic_folder(data.interim_dir, write)


def _distinct_prompts(config: Config) -> tuple[list[str], dict[str, int], list[dict], bool]:
    """The normalised, distinct prompts of every raw file in order (first occurrence wins),
    with the counts of raw, empty and duplicate rows, each source file's record, and whether
    they are chats; a mix of plain and chat files is refused naming one of each."""
    data = config.data
    sources = raw_sources(Path(data.raw_dir))
    if not sources:
        raise PromptFileError(f"no .jsonl or .parquet prompt files in {str(Path(data.raw_dir))!r}")
    seen: set[str] = set()
    prompts: list[str] = []
    counts = {"raw": 0, "empty": 0, "duplicates": 0}
    source_info = []
    first_of_kind: dict[bool, str] = {}  # is_chat -> the first source file of that kind
    for source in sources:
        rows = read_raw_prompts(config, source)
        source_info.append(
            {"file": project_path(source), "sha256": file_sha256(source), "rows": len(rows)}
        )
        for raw in rows:
            first_of_kind.setdefault(is_chat(raw), project_path(source))
            counts["raw"] += 1
            prompt = normalise_prompt(raw)
            if not prompt:
                counts["empty"] += 1
            elif prompt in seen:
                counts["duplicates"] += 1
            else:
                seen.add(prompt)
                prompts.append(prompt)
    if len(first_of_kind) > 1:
        raise PromptFileError(
            f"{first_of_kind[False]} holds plain {data.prompt_field!r} rows and "
            f"{first_of_kind[True]} chat {CHAT_FIELD!r} rows; a data version holds one kind "
            "(write a plain prompt as a chat with one user turn to mix them)"
        )
    return prompts, counts, source_info, bool(first_of_kind.get(True))


def base(config: Config) -> Path:
    """Import ``base.source`` into ``model.policy``, or build the tiny default there.

    ``model.policy`` is checked as an output first (``check_write_paths``: inside the project or
    an allowed root, clear of the repository, the sources, the inputs and the other outputs).
    ``base.source`` is a model folder, a GGUF file, or a hub id (``org/name``) found in the local
    Hugging Face cache (``ppo_core.sources.hub_cache``; never downloaded). A folder import
    copies regular files only, within ``ppo_core.files.MAX_COPY_BYTES``: a link, a device or a
    FIFO in the source is refused by name before anything is loaded or written, except the
    links of a hub cache snapshot into its own ``blobs/``. A GGUF file is checked (header,
    architecture, tensor types) and converted into a ``save_pretrained`` folder in
    ``base.dtype`` (``ppo_core.sources.gguf_import``). ``imported_from.json`` records where the
    model came from without naming the user's folders: the source's path relative to the
    project when it lies inside it, else only its name (or the hub id), and always
    ``content_sha256`` (``ppo_core.files.folder_fingerprint``: its ``config.json`` and every
    file's name and size); a GGUF import adds the file's SHA-256 and its tensor types.
    """
    check_write_paths(flatten(config), (*WRITE_KEYS, "model.policy"))
    target = Path(config.model.policy)
    if config.base.source is None:
        from ppo_core.sources.tiny_default import build_tiny_default

        return build_tiny_default(
            target,
            seed=config.base.tiny_seed,
            steps=config.base.tiny_steps,
            num_threads=config.threads or None,
        )
    source = resolve_model_source(config.base.source, "base.source")
    blobs = snapshot_blobs(source)
    record = _shown_source(config.base.source, source)
    lineage = _production_lineage(config, source)
    if lineage is not None:
        record.update(lineage.as_record())
        if is_adapter_folder(source):
            # a version promoted before versions kept their base names models/base, which
            # this import replaces: keep its base where the version finds it afterwards
            store_base(config.promote.production_dir, adapter_base_folder(source))
    if source.is_file() or (source.is_symlink() and not source.is_dir()):
        write = _gguf_import(config, source, blobs, record)
    else:
        if config.base.dtype != "fp32":
            raise ConfigError(
                f"base.dtype={config.base.dtype!r} applies to GGUF imports; base.source="
                f"{config.base.source!r} is a model folder, copied as it is (leave base.dtype=fp32)"
            )
        write = _folder_import(config, source, blobs, record)

    def write_and_record(tmp: Path) -> None:
        write(tmp)
        record["content_sha256"] = folder_fingerprint(tmp)
        record["imported_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        (tmp / "imported_from.json").write_text(json.dumps(record, indent=1))

    return atomic_folder(target, write_and_record)


def _shown_source(value: str, source: Path) -> dict[str, object]:
    """How ``imported_from.json`` names the source: a hub id as given, a path inside the project
    relative to it, any other path by its last name only (no user folders in the record)."""
    if str(source) != value:
        return {"source": value, "inside_project": False}  # a hub id, resolved from the cache
    project, where = real_path("."), real_path(source)
    if where != project and inside(where, project):
        return {"source": os.path.relpath(where, project), "inside_project": True}
    return {"source": Path(where).name or where, "inside_project": False}


def _folder_import(config: Config, source: Path, blobs: Path | None, record: dict):
    """Check the model folder ``source`` (loads as a tokenizer and a causal LM, only regular
    files or links into ``blobs``) and return the function that copies it."""
    from ppo_core.models.policy import load_causal_lm, load_tokenizer

    if source.is_dir():
        # links are refused before the loaders below follow any
        regular_files(source, link_root=blobs)
    # Load both first: a folder that cannot serve as a policy is refused before anything is written.
    load_tokenizer(source, config.model.trust_remote_code)
    model = load_causal_lm(source, "base.source", config.model.trust_remote_code)
    if not is_adapter_folder(source):
        record["format"] = "folder"
        code = [] if config.model.trust_remote_code else sorted(p.name for p in source.glob("*.py"))
        if code:
            # the auto_map code of a hub snapshot: never run without trust_remote_code, so
            # not copied into an output that DVC pushes and later stages read
            record["left_out"] = code
            print(f"left out {', '.join(code)}: model code runs only with trust_remote_code")

        def copy_folder(tmp: Path) -> None:
            copy_regular_tree(source, tmp, link_root=blobs)
            for name in code:
                (tmp / name).unlink()

        return copy_folder
    # An adapter (a LoRA production version) becomes the whole model it stands for: its base
    # with the adapter merged in, so that the next generation trains, and is judged, on exactly
    # the model in production (docs/design.md, "Generations").
    record["format"] = "merged adapter"
    record["adapter_base_sha256"] = recorded_fingerprint(source)

    def write_merged(tmp: Path) -> None:
        copy_regular_tree(source, tmp, link_root=blobs)  # tokenizer, value head, records
        for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ADAPTER_BASE_FILE):
            (tmp / name).unlink(missing_ok=True)
        model.save_pretrained(tmp, safe_serialization=True)

    return write_merged


def _production_lineage(config: Config, source: Path) -> Lineage | None:
    """The lineage of a base imported from a version of ``promote.production_dir``: the version
    as the parent and the origin its registry entry names (None for any other source). The
    version is checked against the content hash the registry recorded for it first."""
    production = real_path(config.promote.production_dir)
    where = real_path(source)
    if os.path.dirname(where) != production:
        return None
    version = os.path.basename(where)
    entry = promoted_entry(config.promote.registry, version)
    if entry is None:
        return None
    check_version(config.promote.registry, config.promote.production_dir, version)
    origin = entry.get("origin")
    if origin is None:
        print(
            f"the registry records no origin for {version} (promoted before lineage was kept): "
            f"drift is measured from {version} on"
        )
    return Lineage(parent=version, origin=origin)


def _gguf_import(config: Config, source: Path, blobs: Path | None, record: dict):
    """Check the GGUF file ``source`` (a regular file, or a link into ``blobs``; its header,
    architecture and tensor types) and return the function that converts it."""
    from ppo_core.sources.gguf_import import import_gguf, read_gguf

    real = Path(os.path.realpath(source))
    linked_blob = blobs is not None and real.parent == Path(os.path.realpath(blobs))
    if (source.is_symlink() and not linked_blob) or not stat.S_ISREG(os.lstat(real).st_mode):
        raise UnsafeCopyError(
            f"base.source={printable(str(source))!r} is not a regular file (a link is followed "
            "only from a Hugging Face cache snapshot into its blobs/); give the file itself"
        )
    summary = read_gguf(real, config.base.source)
    record.update(
        format="gguf",
        gguf_sha256=file_sha256(real),
        architecture=summary.architecture,
        tensor_types=summary.tensor_types,
        parameters=summary.parameters,
        dtype=config.base.dtype,
    )
    return lambda tmp: import_gguf(real, tmp, config.base.dtype, config.base.source)


def train(config: Config, show_progress: bool = True):
    """The PPO loop with DVCLive metrics, a progress bar, and ``curves.png`` in the metrics
    folder."""
    from flows.loggers import ConsoleProgress, DVCLiveLogger
    from flows.plots import plot_training_curves
    from ppo_core.parallel.process_group import is_main_process
    from ppo_core.training.loop import train as run_training

    check_raw_data_is_prepared(config)
    loggers: list[DVCLiveLogger | ConsoleProgress] = [DVCLiveLogger(config.train.metrics_dir)]
    if show_progress:
        loggers.append(ConsoleProgress(config.train.iterations))
    try:
        summary = run_training(config, loggers=loggers)
    finally:
        for logger in loggers:
            logger.close()
    if is_main_process():  # under torchrun, rank 0 writes the reports
        plot_training_curves(summary.history, Path(config.train.metrics_dir) / "curves.png")
    return summary


def evaluate(config: Config, candidate: str | None = None, baseline: str | None = None):
    """Evaluate the candidate (default ``train.output_dir``) against a baseline (default
    ``eval.baseline``, else the current production version, else ``model.policy``), both scored
    with ``eval.reward``, else the reward the candidate was trained with, else ``model.reward``.
    A candidate with another tokenizer than the KL reference is refused; a baseline with
    another tokenizer is scored without KL (:mod:`ppo_core.evaluation.evaluate`)."""
    from ppo_core.evaluation.evaluate import evaluate as run_evaluation

    return run_evaluation(
        config,
        candidate or config.train.output_dir,
        baseline if baseline is not None else _evaluation_baseline(config),
    )


def validate(config: Config) -> Path:
    """Check the candidate data version with Great Expectations and publish it when it passes.

    Reads ``data.interim_dir`` (written by ``prepare``), counts prompt tokens with the policy's
    tokenizer, runs the suite of :mod:`flows.validation`, writes Data Docs and ``summary.json`` to
    ``validation.report_dir`` (also on failure), and only then copies the version to
    ``data.prepared_dir``. A violation raises :class:`flows.validation.DataValidationError` and
    leaves the previous prepared version as it was.
    """
    import pandas as pd

    from flows.validation import DataValidationError, validate_prompt_splits
    from ppo_core.models.generation import prompt_token_ids, require_chat_template
    from ppo_core.models.policy import load_tokenizer

    interim = Path(config.data.interim_dir)
    files = {name: interim / f"{name}.parquet" for name in ("train", "eval")}
    for path in (*files.values(), interim / "manifest.json"):
        if path.is_symlink() or (path.exists() and not path.is_file()):
            # a link would make validate read, and publish, a file from anywhere
            raise PromptFileError(
                f"{path} is not a regular file (`ppo prepare` writes one); run `ppo prepare` again"
            )
        if not path.is_file():
            raise PromptFileError(f"{path} is missing; run `ppo prepare` first")
    frames = {name: pd.read_parquet(path) for name, path in files.items()}
    tokenizer = load_tokenizer(config.model.policy, config.model.trust_remote_code)
    # a chat version (written by prepare) stores each chat's turns as JSON text in `messages`
    chat = (
        config.data.prompt_field not in frames["train"].columns
        and CHAT_FIELD in frames["train"].columns
    )
    column = CHAT_FIELD if chat else config.data.prompt_field
    if chat:
        require_chat_template(tokenizer, config.model.policy, "model.policy")

    def count_tokens(texts: list[str]) -> list[int]:
        # what generation sees: a chat rendered by the policy's template (prompt_token_ids)
        prompts: list[Prompt] = [
            parse_messages(text, f"{interim}: {CHAT_FIELD}") if chat else text for text in texts
        ]
        return [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]

    rules = config.validation
    result = validate_prompt_splits(
        frames["train"],
        frames["eval"],
        prompt_field=column,
        count_tokens=count_tokens,
        min_tokens=rules.min_tokens,
        max_tokens=rules.max_tokens,
        min_train_rows=rules.min_train_rows,
        min_eval_rows=rules.min_eval_rows,
        report_dir=rules.report_dir,
    )
    if not result.success:
        raise DataValidationError(result)

    def publish(tmp: Path) -> None:
        for name in ("train.parquet", "eval.parquet", "manifest.json"):
            # regular files only, never through a link put there since the check above
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                copy_regular_file(interim / name, fd, MAX_COPY_BYTES)
            finally:
                os.close(fd)

    return atomic_folder(config.data.prepared_dir, publish)


def _evaluation_baseline(config: Config) -> str:

    if config.eval.baseline is not None:
        return config.eval.baseline
    production = current_production(config.promote.registry, config.promote.production_dir)
    return str(production) if production is not None else config.model.policy


def _is_report(content: bytes) -> bool:
    """Whether ``content`` is a promotion report as :func:`promote` writes it."""
    try:
        report = json.loads(content)
    except ValueError:
        return False
    return isinstance(report, dict) and report.get("decision") in ("promoted", "rejected")


class StaleEvaluationError(ValueError):
    """The evaluation in ``eval.output_dir`` is not one of this candidate with these settings."""


def _evaluation_of_this_candidate(config: Config, metrics_file: Path) -> tuple[dict, dict]:
    """``metrics.json`` and ``models.json`` of the evaluation in ``eval.output_dir``, checked to
    be an evaluation of ``train.output_dir``, scored by ``promote.check_reward`` when that guard
    is on: the gate decides on nothing else (an evaluation of another folder, or one whose check
    score came from another scorer, is :class:`StaleEvaluationError`)."""
    again = "; run `ppo evaluate` again with the same settings"
    read = {}
    for name in ("metrics.json", "models.json"):
        path = metrics_file.with_name(name)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; run `ppo evaluate` first")
        try:
            read[name] = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise StaleEvaluationError(f"{path} is not valid JSON{again}") from None
        if not isinstance(read[name], dict):
            raise StaleEvaluationError(f"{path} is not a JSON object{again}")
    models = read["models.json"]
    evaluated = models.get("candidate")
    if not isinstance(evaluated, str) or real_path(evaluated) != real_path(config.train.output_dir):
        raise StaleEvaluationError(
            f"{metrics_file.with_name('models.json')} is an evaluation of "
            f"{printable(str(evaluated))!r}, not of train.output_dir="
            f"{config.train.output_dir!r}{again}"
        )
    wanted = config.promote.check_reward
    if wanted is not None and models.get("check_reward") != wanted:
        raise StaleEvaluationError(
            f"the evaluation was scored with check_reward "
            f"{printable(str(models.get('check_reward')))!r}, but promote.check_reward is "
            f"{config.promote.check_reward!r}{again}"
        )
    return read["metrics.json"], models


def promote(config: Config) -> dict:
    """Apply the promotion gate to the evaluation in ``eval.output_dir``; on a pass, publish the
    candidate as a new production version. Writes the decision to ``promote.report`` either way."""
    from flows.loggers import metric_group  # rich's progress bars: only train and promote

    rules = config.promote
    # Checked before anything is decided or published: the decision must be writable.
    check_replaceable_file(rules.report, "promote.report", "a promotion report", _is_report)
    metrics_file = Path(config.eval.output_dir) / "metrics.json"
    flat, models = _evaluation_of_this_candidate(config, metrics_file)

    def side(name: str) -> dict[str, float] | None:
        return metric_group(flat, name) or None

    candidate = side("candidate")
    if candidate is None:
        raise ValueError(f"{metrics_file} has no candidate metrics")
    decision = gate(candidate, side("baseline"), rules, config.generation.max_new_tokens)
    summary_file = Path(config.train.output_dir) / "training_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    config_file = Path(config.train.output_dir) / "ppo_config.yaml"
    trained_with = config_file.read_text() if config_file.is_file() else None
    entry = record_decision(
        registry_path=rules.registry,
        production_dir=rules.production_dir,
        candidate_dir=config.train.output_dir,
        decision=decision,
        base_dir=config.model.policy,
        lineage={
            **read_lineage(config.model.policy).as_record(),
            "data_hash": summary.get("data_hash"),
            "base_model": summary.get("base_model"),
            "code_version": code_version(),
            "seed": summary.get("seed"),
            "config": trained_with,
            "metrics": candidate,
            "baseline_metrics": side("baseline"),
            "baseline": models.get("baseline"),
            "reward": models.get("reward"),
        },
    )
    # The report is a DVC output, so it holds only what the stage's inputs determine (a rerun of
    # one commit writes the same bytes); when, and from which commit, stay in the registry.
    report = {key: value for key, value in entry.items() if key not in ("date", "code_version")}
    atomic_write_text(rules.report, json.dumps(report, indent=1))
    return entry


def export(config: Config) -> dict:
    """Write production version ``export.version`` (default: the current one) as one GGUF file
    in ``export.dir`` (``ppo_core.models.gguf_export``), with a record beside it, and name the
    export in the version's registry entry. Returns the record.

    The version is checked against the content hash the registry recorded first; an adapter
    version is merged into its stored base. The file is ``<version>-<type>.gguf``; one that
    exists already is left alone: when it is this very export (its record names the version's
    hash and the file's SHA-256) the stage reports it, otherwise it refuses to replace it."""
    import warnings

    from ppo_core.models.causal_lm import PadTokenWarning, load_tokenizer
    from ppo_core.models.gguf_export import export_gguf
    from ppo_core.models.policy import load_causal_lm
    from ppo_core.registry.versions import RegistryError, load_registry

    check_write_paths(flatten(config), WRITE_KEYS)
    rules, settings = config.promote, config.export
    version = settings.version or load_registry(rules.registry).get("current")
    if version is None:
        raise RegistryError(
            f"nothing to export: the registry {rules.registry} names no production version yet "
            "(promote one first, or set export.version)"
        )
    folder = check_version(rules.registry, rules.production_dir, version)
    entry = promoted_entry(rules.registry, version) or {}
    target = Path(settings.dir) / f"{version}-{settings.type}.gguf"
    record_file = target.with_suffix(".json")
    if target.exists() or target.is_symlink():
        earlier = _earlier_export(target, record_file, entry)
        if earlier is not None:
            earlier["already_exported"] = True
            return earlier
        raise FileExistsError(
            f"{target} exists and is not this export of {version} (its record {record_file} "
            "does not name this version's content and the file's SHA-256); an export never "
            "replaces a file: move it away, or set export.dir to another folder"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PadTokenWarning)
        tokenizer = load_tokenizer(folder, config.model.trust_remote_code)
    model = load_causal_lm(folder, "export.version", config.model.trust_remote_code)
    base_name = Path(str(entry.get("base_model") or "model")).name
    summary = export_gguf(
        model,
        tokenizer,
        target,
        settings.type,
        name=f"{base_name} PPO {version}",
        description=f"production version {version} (content sha256 {entry['content_sha256']})",
    )
    record = {
        "version": version,
        "content_sha256": entry["content_sha256"],
        "file": target.name,
        "sha256": file_sha256(target),
        "bytes": target.stat().st_size,
        "type": summary.file_type,
        "architecture": summary.architecture,
        "model_type": summary.model_type,
        "adapter_merged": is_adapter_folder(folder),
        "parameters": summary.parameters,
        "tensor_types": summary.tensor_types,
        "tokenizer": summary.tokenizer,
        "notes": summary.notes,
        "origin": entry.get("origin"),
        "parent_version": entry.get("parent_version"),
    }
    atomic_write_text(record_file, json.dumps(record, indent=1))
    record_export(
        rules.registry,
        version,
        {"file": str(target), "type": summary.file_type, "sha256": record["sha256"]},
    )
    return record


def _earlier_export(target: Path, record_file: Path, entry: dict) -> dict | None:
    """The record of the export already at ``target`` when it is the export of ``entry``'s
    version (same content hash, file SHA-256 as recorded); None otherwise."""
    try:
        record = json.loads(record_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("content_sha256") != entry.get("content_sha256"):
        return None
    if not target.is_file() or target.is_symlink() or file_sha256(target) != record.get("sha256"):
        return None
    return record
