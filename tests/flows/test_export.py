"""`ppo export` and `dvc repro serving/dvc.yaml` on a tiny project: the current production
version becomes a GGUF file with a record beside it and the registry names it; an export that
is there already is reported, never rewritten; what cannot be exported is refused in one line
and nothing is replaced (docs/customizing.md, "Serving with llama.cpp and Ollama")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ppo_core.files import file_sha256
from tests.flows.conftest import BIN, dvc, environment, read_json


def ppo(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ppo"), *args],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def refused(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.slow
def test_the_production_version_is_exported_recorded_and_never_replaced(tiny_project):
    from transformers import AutoModelForCausalLM

    project = tiny_project
    assert "nothing to export" in refused(ppo(project, "export"))
    for stage in ("train", "evaluate", "promote"):
        done = ppo(project, stage, *(["--quiet"] if stage == "train" else []))
        assert done.returncode == 0, done.stdout + done.stderr

    # through DVC, as the docs run it: the stage's own command, params and output
    done = dvc(project, "repro", "--single-item", "serving/dvc.yaml:export")
    assert done.returncode == 0, done.stdout + done.stderr
    gguf = project / "exports" / "v0001-f16.gguf"
    record = read_json(gguf.with_suffix(".json"))
    registry = read_json(project / "models" / "registry.json")
    assert record["version"] == "v0001" and record["sha256"] == file_sha256(gguf)
    assert record["content_sha256"] == registry["entries"][-1]["content_sha256"]
    assert record["architecture"] == "gpt2" and record["tokenizer"]["add_bos"] is True
    assert registry["entries"][-1]["exports"] == [
        {"file": "exports/v0001-f16.gguf", "type": "f16", "sha256": record["sha256"]}
    ]
    # the tiny default's context is 64: transformers' GGUF loader needs it as n_positions
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, n_positions=64)
    assert loaded.config.n_layer == 2

    again = ppo(project, "export")
    assert again.returncode == 0 and "already the export of v0001" in again.stderr, again.stderr
    assert read_json(gguf.with_suffix(".json")) == record
    q8 = ppo(project, "export", "export.type=q8_0")
    assert q8.returncode == 0, q8.stderr
    assert read_json(project / "exports" / "v0001-q8_0.json")["tensor_types"]["Q8_0"] > 0

    # refusals, each one line, nothing replaced
    foreign = project / "exports" / "v0001-f32.gguf"
    foreign.write_bytes(b"not ours")
    assert "is not this export of v0001" in refused(ppo(project, "export", "export.type=f32"))
    assert foreign.read_bytes() == b"not ours"
    assert "export.dir='/etc/exports'" in refused(ppo(project, "export", "export.dir=/etc/exports"))
    assert "export.type" in refused(ppo(project, "export", "export.type=q4_k"))
    assert "v0009" in refused(ppo(project, "export", "export.version=v0009"))
    version_file = project / "models" / "production" / "v0001" / "config.json"
    version_file.write_text(version_file.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    gguf.unlink()
    line = refused(ppo(project, "export"))
    assert "no longer matches the content hash" in line, line
    assert not gguf.exists()
    exports = read_json(project / "models" / "registry.json")["entries"][-1]["exports"]
    assert [e["file"] for e in exports] == ["exports/v0001-f16.gguf", "exports/v0001-q8_0.gguf"]
