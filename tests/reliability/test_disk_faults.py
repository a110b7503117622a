"""A full disk or a read-only output folder: one clear error, nothing half-written, the previous
checkpoint intact. Where the test may mount file systems (root on Linux) it uses a real, small
tmpfs; the injected-fault test runs everywhere."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.checkpoints import store as checkpoint_module
from ppo_core.checkpoints.store import list_checkpoints, load_checkpoint_state
from ppo_core.config import load_config
from ppo_core.training.loop import train


def overrides(tmp: Path, model: Path, prompts, checkpoints: Path, output: Path, iterations: int):
    return [
        f"model.policy={model}",
        f"data.train_file={prompts[0]}",
        f"train.output_dir={output}",
        f"train.checkpoint_dir={checkpoints}",
        f"train.metrics_dir={tmp / 'metrics'}",
        "ppo.rollout_batch_size=8",
        "ppo.mini_batch_size=8",
        "ppo.micro_batch_size=8",
        "ppo.epochs=1",
        "generation.max_new_tokens=4",
        f"train.iterations={iterations}",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=2",
    ]


@contextlib.contextmanager
def tmpfs(folder: Path, size_bytes: int, read_only: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={max(size_bytes // 1024, 64)}k" + (",ro" if read_only else "")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); "
            "test_an_injected_disk_full_error covers the same path"
        )
    try:
        yield folder
    finally:  # lazily if a failed assertion's traceback still holds a file open there
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def assert_only_good_checkpoints(folder: Path, expected_steps: list[int]) -> None:
    found = list_checkpoints(folder)
    assert [int(p.name.split("-")[1]) for p in found] == expected_steps
    for path in found:
        load_checkpoint_state(path)
    assert not [p.name for p in folder.glob(".*")], "a half-written folder was left behind"


def test_an_injected_disk_full_error(tmp_path, tiny_model_dir, prompt_files, monkeypatch):
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "candidate"
    real_save = checkpoint_module.save_tensors
    calls = {"n": 0}

    def save_until_full(obj, path):
        calls["n"] += 1
        if calls["n"] > 2:  # (optimizer, scheduler) per checkpoint: the second one's optimizer
            Path(path).write_bytes(b"partial")  # state hits a full disk mid-file
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path)

    monkeypatch.setattr(checkpoint_module, "save_tensors", save_until_full)
    config = load_config(
        overrides=overrides(
            tmp_path, tiny_model_dir, prompt_files, checkpoints, output, iterations=3
        )
    )
    with pytest.raises(OSError) as info:
        train(config)
    assert info.value.errno == errno.ENOSPC
    assert_only_good_checkpoints(checkpoints, [1])
    assert not output.exists()
    # through the CLI: one line, exit code 2
    calls["n"] = 2
    args = overrides(tmp_path, tiny_model_dir, prompt_files, checkpoints, output, iterations=3)
    result = CliRunner().invoke(app, ["train", "--quiet", *args])
    assert result.exit_code == 2, result.output
    assert "No space left on device" in result.output and "Traceback" not in result.output
    assert_only_good_checkpoints(checkpoints, [1])


@pytest.mark.parametrize(
    ("room", "kept"),
    [(0.3, []), (1.5, [1])],
    ids=["full-while-writing-weights", "full-while-writing-optimizer"],
)
def test_a_really_full_disk(tmp_path, tiny_model_dir, prompt_files, room, kept):
    probe = tmp_path / "probe"
    train(
        load_config(
            overrides=overrides(
                probe, tiny_model_dir, prompt_files, probe / "ck", probe / "out", iterations=1
            )
        )
    )
    one_checkpoint = sum(p.stat().st_size for p in (probe / "ck").rglob("*") if p.is_file())
    with tmpfs(tmp_path / "small", int(one_checkpoint * room)) as small:
        checkpoints, output = small / "checkpoints", tmp_path / "candidate"
        config = load_config(
            overrides=overrides(
                tmp_path, tiny_model_dir, prompt_files, checkpoints, output, iterations=3
            )
        )
        with pytest.raises(OSError) as info:
            train(config)
        assert info.value.errno == errno.ENOSPC
        assert_only_good_checkpoints(checkpoints, kept)
        assert not output.exists()


def test_a_read_only_output_folder(tmp_path, tiny_model_dir, prompt_files):
    with tmpfs(tmp_path / "readonly", 1 << 20, read_only=True) as readonly:
        checkpoints = tmp_path / "checkpoints"
        args = overrides(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            checkpoints,
            readonly / "candidate",
            iterations=2,
        )
        result = CliRunner().invoke(app, ["train", "--quiet", *args])
        assert result.exit_code == 2, result.output
        assert "Read-only file system" in result.output and "Traceback" not in result.output
        assert not list(readonly.iterdir())
        assert_only_good_checkpoints(checkpoints, [1, 2])
