"""GGUF files that lie: a header declaring more than the file holds, a file without the
weights its metadata describes (or describing a far larger model than it holds), a file
without an architecture, and names carrying terminal escapes. Each is refused in one line,
quickly, before anything is allocated or written."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.base_sources.gguf_header import GGUFHeaderError, check_gguf_header
from ppo_core.base_sources.gguf_import import GGUFImportError, read_gguf
from tests.helpers import smollm2_gguf


def gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_a_header_declaring_an_endless_array_is_refused_at_once(tmp_path):
    # 2^40 strings declared in a file of under 100 bytes: gguf's reader walked them for ever
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    pair = gguf_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40)
    path = tmp_path / "bomb.gguf"
    path.write_bytes(header + pair + b"\0" * 16)
    assert path.stat().st_size < 100
    started = time.monotonic()
    with pytest.raises(GGUFHeaderError, match=r"the length of 'tokenizer.ggml.tokens' is 1099"):
        check_gguf_header(path)
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        read_gguf(path)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (struct.pack("<IQQ", 3, 2**50, 0), "the tensor count is 1125899906842624"),
        (struct.pack("<IQQ", 3, 0, 2**40), "the key-value count is 1099511627776"),
        (struct.pack("<IQQ", 1, 0, 0), "GGUF version 1 is not read"),
    ],
)
def test_a_header_whose_counts_the_file_cannot_hold_is_refused(tmp_path, declared, message):
    path = tmp_path / "lying.gguf"
    path.write_bytes(b"GGUF" + declared + b"\0" * 40)
    with pytest.raises(GGUFHeaderError, match=message):
        check_gguf_header(path)


def copy_of_smollm2(path, tensors: int | None, **overrides):
    """A GGUF file with SmolLM2's metadata (``overrides`` replacing integer fields) and only
    its first ``tensors`` tensors (all with None)."""
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf())
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        value = overrides.get(key, field.contents())
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for tensor in reader.tensors[:tensors] if tensors is not None else reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def base_command(tmp_path, path):
    return CliRunner().invoke(app, ["base", f"base.source={path}", "model.policy=models/base"])


@pytest.mark.parametrize(
    ("tensors", "overrides", "message"),
    [
        (0, {}, "its tensors hold 0 weights, but the llama model its metadata describes needs"),
        (30, {}, "weights are missing"),
        (
            1,
            {
                "llama.embedding_length": 1024,
                "llama.block_count": 8,
                "llama.feed_forward_length": 8192,
                "llama.attention.head_count": 16,
                "llama.attention.head_count_kv": 4,
            },
            "or the metadata declares a larger model than the file holds",
        ),
    ],
)
def test_a_file_without_the_weights_its_metadata_describes_is_refused(
    tmp_path, monkeypatch, tensors, overrides, message
):
    monkeypatch.chdir(tmp_path)
    path = copy_of_smollm2(tmp_path / "partial.gguf", tensors, **overrides)
    result = base_command(tmp_path, path)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "models").exists()
    assert not list(tmp_path.glob("models*")) and not list(tmp_path.glob(".base*"))


def test_a_file_without_an_architecture_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    pair = gguf_string(b"general.name") + struct.pack("<I", 8) + gguf_string(b"nameless")
    path = tmp_path / "nameless.gguf"
    path.write_bytes(header + pair)
    result = base_command(tmp_path, path)
    assert result.exit_code == 2, result.output
    assert "its header has no general.architecture" in result.output
    assert "Traceback" not in result.output


def test_terminal_escapes_in_a_tensor_name_do_not_reach_the_terminal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = b"blk.0\x1b[2J\x1b]0;owned\x07\nFAKE LINE"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    tensor = gguf_string(name) + struct.pack("<IQ", 9, 4)  # 9 dimensions: refused, named
    path = tmp_path / "escapes.gguf"
    path.write_bytes(header + tensor + b"\0" * 64)
    result = base_command(tmp_path, path)
    assert result.exit_code == 2, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "\\x1b[2J" in result.output


def small_gguf(path, architecture: str, qtype: str = "F32"):
    """A GGUF file of ``architecture`` with one 256-weight tensor of type ``qtype`` (zeros)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    writer = gguf.GGUFWriter(str(path), architecture)
    raw = np.zeros((1, 256 // block * size), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("magic", "is not a GGUF file (it does not start with 'GGUF')"),
        ("architecture", "architecture 'made-up' cannot be read by transformers"),
        ("tensor type", "tensor type Q8_K cannot be dequantized by gguf"),
    ],
)
def test_each_refusal_of_the_gguf_import_is_its_own(tmp_path, case, message):
    """The magic bytes, the architecture and the tensor types are each checked in their own
    right, before a later check could refuse the same file with another reason."""
    if case == "magic":
        path = small_gguf(tmp_path / "model.gguf", "llama")
        path.write_bytes(b"GGML" + path.read_bytes()[4:])
    elif case == "architecture":
        path = small_gguf(tmp_path / "model.gguf", "made-up")
    else:
        path = small_gguf(tmp_path / "model.gguf", "llama", "Q8_K")
    with pytest.raises(GGUFImportError) as refused:
        read_gguf(path)
    assert message in str(refused.value), refused.value
