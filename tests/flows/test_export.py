"""`ppo export` and `dvc repro serving/dvc.yaml` on a tiny project: the current production
version becomes a GGUF file with a record beside it and the registry names it; an export that
is there already is reported, never rewritten; what cannot be exported is refused in one line
and nothing is replaced (docs/customizing.md, "Serving with llama.cpp and Ollama")."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.peers.export import GATE_OFF
from ppo_core.files import file_sha256
from tests.flows.conftest import BIN, dvc, environment, ran, read_json, run_doc_block


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

    # through DVC, as the docs run it: the export alone, no training stage (it follows the
    # registry, which no stage of dvc.yaml writes as an output)
    done = dvc(project, "repro", "serving/dvc.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ran(done.stdout) == {"serving/dvc.yaml:export"}, done.stdout
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


SOAK = os.environ.get("PPO_SOAK") == "1"
SERVING = "## Serving with llama.cpp and Ollama"


SMOLLM2_SKIP = pytest.mark.skipif(  # before the tiny project is copied for it
    not SOAK, reason="SmolLM2's LoRA export runs under `make soak` (PPO_SOAK=1): 5 minutes"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model", ["tiny-llama", pytest.param("smollm2", marks=[pytest.mark.soak, SMOLLM2_SKIP])]
)
def test_a_lora_version_exports_to_the_greedy_tokens_of_the_promoted_version(
    tiny_project, tmp_path, model
):
    """A chat model with LoRA PPO, promoted (an adapter on its stored base), then
    docs/customizing.md's serving block verbatim. transformers' GGUF loader reads each file
    back to the chat template, the prompt ids and the greedy tokens of the promoted version
    (the adapter merged). The tiny Llama (q/k rows permuted) in f32: identical. SmolLM2 after
    one LoRA iteration (`make soak` only, 5 minutes): f16 identical, q8_0 reported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids, stop_token_ids
    from ppo_core.models.policy import load_causal_lm
    from tests.helpers import CHAT_TEMPLATE, build_tiny_causal_lm, smollm2_gguf

    if model == "smollm2":
        source, types = smollm2_gguf(), ("f16", "q8_0")
    else:
        source = build_tiny_causal_lm(tmp_path / "chat-llama", "llama", chat_template=CHAT_TEMPLATE)
        types = ("f32",)
    project = tiny_project
    for command in (
        ["base", f"base.source={source}"],
        ["train", "--quiet", *LORA],
        ["evaluate", *LORA],
        ["promote", *LORA, *GATE_OFF],
    ):
        done = ppo(project, *command)
        assert done.returncode == 0, done.stdout + done.stderr
    version = project / "models" / "production" / "v0001"
    assert (version / "adapter_model.safetensors").is_file()
    run_doc_block(project, "docs/customizing.md", SERVING, {})
    assert read_json(project / "exports" / "v0001-f16.json")["adapter_merged"] is True
    if "f32" in types:
        done = ppo(project, "export", "export.type=f32")
        assert done.returncode == 0, done.stderr

    model_, tokenizer = load_causal_lm(version), load_tokenizer(version)
    stops = stop_token_ids(model_, tokenizer)
    chats = [
        [{"role": "user", "content": "Write a one-line review of a film you liked."}],
        [{"role": "user", "content": "Was 'The Long Road' (1971) worth watching?"}],
        [
            {"role": "system", "content": "You are a film critic."},
            {"role": "user", "content": "Describe a comedy in one sentence."},
        ],
    ]

    def greedy(lm, ids):
        with torch.no_grad():
            out = lm.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=24,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
            )
        return out[0, len(ids) :].tolist()

    ours = [greedy(model_, ids) for ids in prompt_token_ids(tokenizer, chats)]
    for file_type in types:
        name = f"v0001-{file_type}.gguf"
        loaded = AutoModelForCausalLM.from_pretrained(
            project / "exports", gguf_file=name, dtype=torch.float32
        ).eval()
        loaded_tokenizer = AutoTokenizer.from_pretrained(project / "exports", gguf_file=name)
        assert loaded_tokenizer.chat_template == tokenizer.chat_template
        ids = prompt_token_ids(loaded_tokenizer, chats)
        assert ids == prompt_token_ids(tokenizer, chats)
        theirs = [greedy(loaded, row) for row in ids]
        if file_type != "q8_0":
            assert theirs == ours  # measured: identical (tiny f32; SmolLM2 f16, 3 chats x 24)
        else:
            # q8_0 rounds every matrix to 8 bits: reported, not required (measured: 17, 24
            # and 22 of 24, 24 and 22 tokens agree before the first difference)
            agree = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x))
                for x, y in zip(ours, theirs, strict=True)
            ]
            print(f"q8_0 agrees for {agree} of {[len(x) for x in ours]} tokens")


LORA = [
    "model.lora.enabled=true",
    "model.critic=none",
    "ppo.advantage_estimator=rloo",
    "ppo.samples_per_prompt=4",
    "ppo.rollout_batch_size=8",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=4",
    "generation.max_new_tokens=8",
    "train.iterations=1",
    "optim.lr=2e-4",
    "eval.num_prompts=4",
]
"""One LoRA iteration at the smallest sizes that train (a minute for SmolLM2 on two cores)."""


def test_an_export_is_judged_by_the_registry_hash_not_by_the_record_beside_it(
    tmp_path, monkeypatch
):
    """A GGUF file swapped with its record rewritten to match is refused in one line naming
    the file, and left as it is: "already the export of v0001" is decided by the SHA-256 the
    registry recorded for the file, never by the JSON beside it, which whoever swaps the file
    can rewrite too. Planted: no model is loaded before the existing file is judged."""
    import json

    from typer.testing import CliRunner

    from flows.cli import app
    from ppo_core.registry.gate import GateDecision
    from ppo_core.registry.versions import record_decision, record_export

    monkeypatch.chdir(tmp_path)
    candidate = tmp_path / "candidate"
    candidate.mkdir()
    (candidate / "config.json").write_text("{}")
    registry = Path("models/registry.json")
    record_decision(
        registry_path=registry,
        production_dir=Path("models/production"),
        candidate_dir=candidate,
        decision=GateDecision(True, ["PASS"]),
        lineage={},
    )
    content = read_json(registry)["entries"][-1]["content_sha256"]
    gguf = Path("exports/v0001-f16.gguf")
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF the export")
    record = {"version": "v0001", "content_sha256": content, "file": gguf.name, "bytes": 15}
    gguf.with_suffix(".json").write_text(json.dumps(record | {"sha256": file_sha256(gguf)}))
    record_export(
        registry, "v0001", {"file": str(gguf), "type": "f16", "sha256": file_sha256(gguf)}
    )
    runner = CliRunner()
    done = runner.invoke(app, ["export", "--config", "none"])
    assert done.exit_code == 0, done.output
    assert f"{gguf} is already the export of v0001: nothing to do" in done.output

    gguf.write_bytes(b"GGUF a swapped file")  # and its record rewritten to match
    gguf.with_suffix(".json").write_text(json.dumps(record | {"sha256": file_sha256(gguf)}))
    done = runner.invoke(app, ["export", "--config", "none"])
    assert done.exit_code == 2, done.output
    [line] = done.output.splitlines()
    assert line.startswith(f"error: {gguf} exists and is not this export of v0001: its SHA-256 ")
    assert "the registry models/registry.json recorded for it" in line, line
    assert gguf.read_bytes() == b"GGUF a swapped file"

    # the registry's file with a record beside it that does not agree: refused by its name
    gguf.write_bytes(b"GGUF the export")
    done = runner.invoke(app, ["export", "--config", "none"])
    assert done.exit_code == 2 and f"the record beside it, {gguf.with_suffix('.json')}, is " in (
        done.output
    ), done.output
    # a file the registry records nothing for (a record beside it naming it is not enough)
    other = Path("exports/v0001-f32.gguf")
    other.write_bytes(b"GGUF never exported")
    other.with_suffix(".json").write_text(json.dumps(record | {"sha256": file_sha256(other)}))
    done = runner.invoke(app, ["export", "--config", "none", "export.type=f32"])
    assert done.exit_code == 2 and "records no export of v0001 at that path" in done.output
    assert other.read_bytes() == b"GGUF never exported"
