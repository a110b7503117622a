"""What a stopped stage leaves of the vLLM engine (no vLLM needed): the folders of engines whose
owner is gone are removed by the next engine, and SIGTERM unwinds the trainer so that an open
engine is closed and its folder (the policy's weights while a load is in flight) removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ppo_core.experience.engine_process import (
    ENGINE_FOLDER_PREFIX,
    new_engine_folder,
    remove_stale_engine_folders,
)


def test_folders_of_engines_whose_owner_is_gone_are_removed_and_no_others(tmp_path):
    """Seen failing before: nothing removed old folders (a killed run's fp32 weights stayed)."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead = tmp_path / f"{ENGINE_FOLDER_PREFIX}dead"
    dead.mkdir()
    (dead / "owner").write_text(f"{int(gone.stdout)} 12345.0\n")
    (dead / "weights.safetensors").write_bytes(b"0" * 1000)
    reused = tmp_path / f"{ENGINE_FOLDER_PREFIX}reused"  # this pid, another start time
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1.0\n")
    old = tmp_path / f"{ENGINE_FOLDER_PREFIX}old"  # an older engine's, without owner
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    recent = tmp_path / f"{ENGINE_FOLDER_PREFIX}recent"
    recent.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / f"{ENGINE_FOLDER_PREFIX}link").symlink_to(target)
    mine = new_engine_folder(tmp_path)  # removes the stale ones first
    assert mine.name.startswith(ENGINE_FOLDER_PREFIX) and (mine / "owner").is_file()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [mine.name, f"{ENGINE_FOLDER_PREFIX}recent", f"{ENGINE_FOLDER_PREFIX}link", "elsewhere"]
    )
    assert (target / "keep").is_file()
    assert remove_stale_engine_folders(tmp_path) == []  # its own folder is alive


TRAINER = """
import sys, time
from pathlib import Path
from ppo_core.experience.engine_process import new_engine_folder, terminate_as_exit
folder = new_engine_folder(sys.argv[1])
with terminate_as_exit():
    try:
        (folder / "weights.safetensors").write_bytes(b"0" * 1000)
        print(folder, flush=True)
        time.sleep(60)
    finally:
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()
"""


def test_sigterm_unwinds_the_trainer_so_the_engine_folder_goes(tmp_path):
    """What a stage timeout sends: the trainer exits 143 through its ``finally`` blocks, as
    ``with VLLMEngine(...)`` closes the engine. Seen failing without the handler (the folder
    and its weights stayed)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert trainer.stdout is not None
    folder = trainer.stdout.readline().strip()
    assert folder and os.path.isdir(folder)
    trainer.terminate()
    assert trainer.wait(timeout=30) == 143
    assert not os.path.exists(folder)
