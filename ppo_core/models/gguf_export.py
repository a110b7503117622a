"""Writing a model folder as one GGUF file, the format llama.cpp, Ollama and LM Studio serve
(layer 2).

The converse of :mod:`ppo_core.base_sources.gguf_import`. :func:`export_gguf` takes a loaded causal
LM and its tokenizer and writes, through the ``gguf`` package's own writer, name maps and
quantiser:

- the weights under llama.cpp's tensor names (``gguf.get_tensor_name_map``), in ``f32``,
  ``f16`` or ``q8_0``; one-dimensional tensors (norms, biases) stay F32 and a matrix whose rows
  do not split into Q8_0 blocks of 32 is written F16, as llama.cpp's own converter does;
- for the Llama layout (Llama, Mistral, SmolLM2), the query and key rows interleaved the way
  llama.cpp applies rotary embeddings (it rotates adjacent pairs; transformers rotates the two
  halves of each head). transformers' GGUF loader undoes exactly this permutation;
- the architecture's hyper-parameters under llama.cpp's keys;
- the tokenizer: every token as the byte-level BPE spells it, its type (normal, control for a
  special token, user-defined for an added one, unused for embedding rows past the
  tokenizer), the merges, the special ids, whether BOS is prepended, the name of the
  pre-tokenizer llama.cpp must split text with, and the chat template.

Supported: the ``llama``, ``mistral`` and ``qwen2`` model types and ``gpt2`` (the embedded
default), with a byte-level BPE tokenizer. Anything else is refused by
:class:`GGUFExportError` naming what is not supported, before a byte is written. ``gguf`` and
numpy are imported where a file is written.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ppo_core.files import create_sibling, fsync_folder, printable
from ppo_core.models.generation import stop_token_ids

__all__ = [
    "EXPORT_TYPES",
    "GGUFExportError",
    "GGUFExportSummary",
    "check_exportable",
    "export_gguf",
]

EXPORT_TYPES = ("f32", "f16", "q8_0")
"""The tensor types a model can be exported in (``export.type``)."""

# transformers model_type -> the GGUF architecture llama.cpp runs it as. Mistral has no
# architecture of its own in llama.cpp: it is Llama with a sliding window (see _context_length).
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}

# The byte-level pre-tokenizers llama.cpp knows by name, as the Split regex a tokenizer.json
# writes before its ByteLevel step; transformers' GGUF loader rebuilds the same split from the
# name (its table is read in _split_regexes).
PRE_TOKENIZER_NAMES = ("llama-bpe", "qwen2")

# GPT-2 stores these as Conv1D weights, [in, out]; GGUF (like nn.Linear) wants [out, in].
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GGUFExportError(ValueError):
    """A model cannot be exported to GGUF: an architecture, a setting or a tokenizer the exporter
    does not write. The message names it and what is supported."""


@dataclass(frozen=True)
class GGUFExportSummary:
    """What :func:`export_gguf` wrote."""

    architecture: str
    """The GGUF ``general.architecture`` (``llama``, ``qwen2``, ``gpt2``)."""
    model_type: str
    """transformers' ``model_type`` of the exported model."""
    file_type: str
    """``f32``, ``f16`` or ``q8_0``."""
    tensor_types: dict[str, int]
    """Number of tensors of each GGML type, e.g. ``{"F32": 61, "Q8_0": 211}``."""
    parameters: int
    """Number of weights in the file."""
    tokenizer: dict[str, Any] = field(default_factory=dict)
    """``model``, ``pre``, ``tokens``, ``merges``, ``add_bos``, ``chat_template`` (bool) and the
    special ids written."""
    notes: list[str] = field(default_factory=list)
    """Adjustments a reader should know of (e.g. a sliding window written as the context)."""


def _config_value(config: Any, key: str) -> Any:
    return getattr(config, key, None)


def check_exportable(config: Any) -> str:
    """The GGUF architecture ``config`` (a transformers ``PretrainedConfig``) is exported as;
    :class:`GGUFExportError` naming the setting that cannot be written otherwise."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in ARCHITECTURES:
        raise GGUFExportError(
            f"model type {printable(model_type)!r} cannot be exported to GGUF (the exporter "
            f"writes {', '.join(sorted(ARCHITECTURES))})"
        )
    rope = _config_value(config, "rope_parameters") or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if model_type != "gpt2" and rope_type != "default":
        raise GGUFExportError(
            f"rope_parameters.rope_type={printable(str(rope_type))!r} (scaled rotary embeddings) "
            "cannot be exported to GGUF yet; only 'default' is written"
        )
    if model_type == "qwen2" and _config_value(config, "use_sliding_window"):
        raise GGUFExportError(
            "use_sliding_window=true: llama.cpp's qwen2 has no sliding window, so the exported "
            "model would attend differently"
        )
    if model_type == "gpt2" and _config_value(config, "activation_function") not in (
        "gelu_new",
        "gelu_pytorch_tanh",
    ):
        raise GGUFExportError(
            f"activation_function={_config_value(config, 'activation_function')!r}: llama.cpp's "
            "gpt2 computes the tanh GELU (gelu_new) only"
        )
    if model_type == "llama" and _config_value(config, "mlp_bias"):
        raise GGUFExportError("mlp_bias=true cannot be exported: llama.cpp's llama has no MLP bias")
    return ARCHITECTURES[model_type]


def export_gguf(
    model: Any,
    tokenizer: Any,
    path: str | Path,
    file_type: str = "f16",
    name: str = "",
    description: str = "",
) -> GGUFExportSummary:
    """Write ``model`` (a transformers causal LM, any dtype; an adapter merged in already) and
    ``tokenizer`` (its fast tokenizer as ``AutoTokenizer`` loads it, not the pipeline's padded
    one) to the GGUF file ``path`` in ``file_type`` (:data:`EXPORT_TYPES`).

    The file is written beside ``path`` under a temporary name and renamed onto it when
    complete, so ``path`` never holds a partial file; a file already at ``path`` is refused
    (``FileExistsError``). ``name`` becomes ``general.name``, ``description``
    ``general.description``."""
    import gguf

    if file_type not in EXPORT_TYPES:
        raise GGUFExportError(
            f"export.type={file_type!r} is not a type the exporter writes "
            f"({', '.join(EXPORT_TYPES)})"
        )
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise FileExistsError(f"{path} exists; an export never replaces a file")
    config = model.config
    architecture = check_exportable(config)
    vocabulary = _tokenizer_fields(tokenizer, model)
    notes = list(vocabulary.pop("notes"))
    state = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    tensors = _gguf_tensors(state, config, architecture)

    fd, partial = create_sibling(path, ".gguf")
    os.close(fd)
    counts: Counter[str] = Counter()
    try:
        writer = gguf.GGUFWriter(partial, architecture)
        writer.add_type("model")
        writer.add_name(name or str(getattr(config, "_name_or_path", "") or config.model_type))
        if description:
            writer.add_description(description)
        notes += _add_hyper_parameters(writer, config, architecture)
        writer.add_file_type(_file_type_code(file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(writer, vocabulary)
        for tensor_name, values in tensors:
            data, qtype = _encode(values, file_type, tensor_name)
            counts[qtype.name] += 1
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(partial, "rb+") as handle:
            os.fsync(handle.fileno())
        # a hard link, not a rename: it fails rather than replace a file that appeared meanwhile
        os.link(partial, path)
    except FileExistsError:
        raise FileExistsError(f"{path} exists; an export never replaces a file") from None
    finally:
        Path(partial).unlink(missing_ok=True)
    fsync_folder(path.parent)
    return GGUFExportSummary(
        architecture=architecture,
        model_type=config.model_type,
        file_type=file_type,
        tensor_types=dict(sorted(counts.items())),
        parameters=sum(values.numel() for _, values in tensors),
        tokenizer={k: v for k, v in vocabulary.items() if k not in ("tokens", "types", "merges")}
        | {"tokens": len(vocabulary["tokens"]), "merges": len(vocabulary["merges"])},
        notes=notes,
    )


def _file_type_code(file_type: str) -> int:
    from gguf import LlamaFileType

    return {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
    }[file_type]


def _encode(values: torch.Tensor, file_type: str, tensor_name: str):
    """The tensor as the bytes GGUF stores and its GGML type: F32 for one-dimensional tensors
    and for ``f32``, else F16 or Q8_0 (F16 where a row does not split into Q8_0 blocks)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    array = values.numpy().astype(np.float32)
    if file_type == "f32" or array.ndim < 2:
        return array, GGMLQuantizationType.F32
    if file_type == "q8_0":
        block, _ = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
        if array.shape[-1] % block == 0:
            return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return array.astype(np.float16), GGMLQuantizationType.F16


def _permute_for_llama_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection ``[heads * head_dim, in]`` reordered from
    transformers' rotate-half layout (pairs ``(i, i + head_dim/2)``) to llama.cpp's adjacent
    pairs ``(2i, 2i + 1)``, head by head."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_tensors(
    state: dict[str, torch.Tensor], config: Any, architecture: str
) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under llama.cpp's names, laid out as llama.cpp reads them."""
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: list[tuple[str, torch.Tensor]] = []
    for key, values in state.items():
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias") or "rotary_emb" in key:
            continue  # GPT-2's causal-mask buffers and rotary caches: not weights
        if key == "lm_head.weight" and tied and architecture != "gpt2":
            continue  # llama.cpp reads the token embedding as the output when there is none
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFExportError(
                f"weight {printable(key)!r} of the {config.model_type} model has no llama.cpp "
                "tensor name; the model has parts the exporter does not write"
            )
        if architecture == "llama" and key.endswith("self_attn.q_proj.weight"):
            values = _permute_for_llama_rope(values, config.num_attention_heads)
        elif architecture == "llama" and key.endswith("self_attn.k_proj.weight"):
            values = _permute_for_llama_rope(values, config.num_key_value_heads)
        elif architecture == "gpt2" and key.endswith(GPT2_CONV1D):
            values = values.T.contiguous()
        out.append((gguf_name, values))
    if architecture == "gpt2" and not any(name == "output.weight" for name, _ in out):
        embedding = next(values for name, values in out if name == "token_embd.weight")
        out.append(("output.weight", embedding))  # llama.cpp's gpt2 reads an output matrix
    return out


def _context_length(config: Any, notes: list[str]) -> int:
    context = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral" and window and int(window) < context:
        # llama.cpp's llama has no sliding window: within the window both attend alike, so the
        # file declares the window as its context and no consumer goes past it
        notes.append(
            f"sliding_window={window} written as the context length (was {context}): llama.cpp "
            "runs Mistral as Llama, without a window"
        )
        return int(window)
    return context


def _add_hyper_parameters(writer: Any, config: Any, architecture: str) -> list[str]:
    notes: list[str] = []
    if architecture == "gpt2":
        writer.add_context_length(int(config.n_positions))
        writer.add_embedding_length(int(config.n_embd))
        writer.add_block_count(int(config.n_layer))
        writer.add_feed_forward_length(int(config.n_inner or 4 * config.n_embd))
        writer.add_head_count(int(config.n_head))
        writer.add_layer_norm_eps(float(config.layer_norm_epsilon))
        return notes
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    writer.add_context_length(_context_length(config, notes))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(float(theta or getattr(config, "rope_theta", None) or 10000.0))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != int(config.hidden_size) // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config.vocab_size))
    return notes


def _split_regexes() -> dict[str, str]:
    """The Split regex of each pre-tokenizer name in :data:`PRE_TOKENIZER_NAMES`, as
    transformers' GGUF loader rebuilds it (empty if this transformers has no such table)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:  # pragma: no cover - another transformers layout
        return {}
    return {name: GGUF_PRE_TOKENIZER_SPLITS[name] for name in PRE_TOKENIZER_NAMES}


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) of the byte-level pre-tokenizer ``pre`` (its
    ``tokenizer.json`` object); :class:`GGUFExportError` when it has none."""
    shown = json.dumps(pre)[:160]
    pre = pre or {}
    listed = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    steps: list[dict] = [step for step in listed or [] if isinstance(step, dict) and step]
    kinds = [step.get("type") for step in steps]
    last: dict = steps[-1] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and last.get("add_prefix_space"):
        raise GGUFExportError(
            "the tokenizer's ByteLevel pre-tokenizer adds a prefix space, which llama.cpp's "
            "byte-level BPE does not; the exported model would read text differently"
        )
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and last.get("use_regex", True)
    ):
        return "smollm"  # GPT-2's split with each digit on its own (SmolLM, SmolLM2)
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        for name, regex in _split_regexes().items():
            if pattern == regex:
                return name
    raise GGUFExportError(
        f"the tokenizer's pre-tokenizer has no llama.cpp name the exporter knows ({shown}); "
        "it writes GPT-2's, SmolLM's, Llama 3's and Qwen2's"
    )


def _byte_level_spec(tokenizer: Any) -> tuple[dict[str, Any], list[str]]:
    """The fast tokenizer's ``tokenizer.json`` as a dict, and the notes for the record; refused
    unless it is a byte-level BPE that llama.cpp reads the same way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(
            "the tokenizer is not a fast (tokenizers) tokenizer; the exporter reads its "
            "tokenizer.json"
        )
    spec = json.loads(backend.to_str())
    model_spec = spec.get("model") or {}
    if model_spec.get("type") != "BPE" or model_spec.get("byte_fallback"):
        kind = model_spec.get("type")
        if model_spec.get("byte_fallback"):
            kind = "sentencepiece-style BPE with byte fallback"
        raise GGUFExportError(
            f"the tokenizer is {printable(str(kind))}; the exporter writes byte-level BPE "
            "tokenizers (GPT-2, SmolLM2, Qwen2, Llama 3) only"
        )
    notes = []
    normalizer = spec.get("normalizer")
    if normalizer == {"type": "NFC"}:
        # Qwen2's: llama.cpp and transformers' GGUF loader read text as given, which is the
        # same for text in NFC already (what editors, browsers and most corpora produce)
        notes.append("the tokenizer's NFC normalizer is not in the file (GGUF has no field for it)")
    elif normalizer:
        raise GGUFExportError(
            f"the tokenizer has a normalizer ({json.dumps(normalizer)[:120]}), which llama.cpp's "
            "byte-level BPE does not apply"
        )
    return spec, notes


def _token_table(tokenizer: Any, spec: dict[str, Any], vocab_size: int) -> tuple[list, list]:
    """The token of each embedding row and its GGUF type: ``[PAD<i>]`` for rows no token uses."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) + 1 > vocab_size:
        raise GGUFExportError(
            f"the tokenizer has ids up to {max(vocab.values())} but the model's embedding has "
            f"{vocab_size} rows"
        )
    by_id: dict[int, str] = {index: token for token, index in vocab.items()}
    added = {int(t["id"]): bool(t.get("special")) for t in spec.get("added_tokens") or []}
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            # embedding rows no token uses (Qwen2 pads 151,646 tokens to 151,936 rows)
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(TokenType.CONTROL if added[index] else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    return tokens, types


def _tokenizer_fields(tokenizer: Any, model: Any) -> dict[str, Any]:
    """Everything the file says of the tokenizer, read from the loaded fast tokenizer."""
    spec, notes = _byte_level_spec(tokenizer)
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    tokens, types = _token_table(tokenizer, spec, int(model.config.vocab_size))
    pairs = spec["model"].get("merges") or []
    if any(" " in part for pair in pairs if isinstance(pair, list) for part in pair):
        raise GGUFExportError("the tokenizer has merges with spaces, which GGUF cannot spell")
    merges = [" ".join(pair) if isinstance(pair, list) else str(pair) for pair in pairs]
    # whether the tokenizer adds BOS / EOS itself: what it does to one letter
    probe = tokenizer("a").input_ids
    grew = len(probe) > len(tokenizer("a", add_special_tokens=False).input_ids)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    # a chat model's end of turn, listed by its generation config beside the tokenizer's EOS:
    # llama.cpp stops at the end-of-turn token too
    stops = [i for i in stop_token_ids(model, tokenizer) if i != eos]
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "add_bos": bos is not None and grew and probe[0] == bos,
        "add_eos": eos is not None and grew and probe[-1] == eos,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "unk_token_id": tokenizer.unk_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eot_token_id": stops[0] if stops else None,
        "chat_template": template,
        "notes": notes,
    }


def _add_tokenizer(writer: Any, fields: dict[str, Any]) -> None:
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    for kind in ("bos", "eos", "unk", "pad", "eot"):
        token_id = fields[f"{kind}_token_id"]
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(int(token_id))
    writer.add_add_bos_token(bool(fields["add_bos"]))
    writer.add_add_eos_token(bool(fields["add_eos"]))
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])
