"""Importing a GGUF file (llama.cpp's single-file format) as an ordinary model folder (layer 2).

transformers reads GGUF through the ``gguf`` package and dequantizes every tensor, but a model
loaded that way refuses ``save_pretrained``. :func:`import_gguf` checks the file first (a GGUF
header, an architecture transformers maps to a causal LM, tensor types ``gguf`` can dequantize),
so that a file that cannot be imported is refused by name before anything is written; then it
loads the model and the tokenizer, moves the weights into a plain model of the same config and
writes a ``save_pretrained`` folder: safetensors weights (fp32, or bf16), the tokenizer with its
chat template, and the generation config with the tokenizer's EOS and pad tokens. ``gguf``,
numpy and transformers are imported where a file is read: only ``ppo base`` of a GGUF file needs
them.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import torch

from ppo_core.base_sources.gguf_header import check_gguf_header
from ppo_core.files import printable
from ppo_core.models.folders import ModelFolderError

__all__ = [
    "GGUF_MAGIC",
    "GGUFImportError",
    "GGUFSummary",
    "import_gguf",
    "is_gguf_file",
    "read_gguf",
]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (llama.cpp's ``gguf`` specification)."""

ARCHITECTURE_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
"""GGUF architecture names that transformers spells differently (its GGUF loader renames them)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GGUFImportError(ModelFolderError):
    """A GGUF file cannot be imported: not a GGUF file, an architecture transformers does not
    read, or a tensor type ``gguf`` cannot dequantize. The message names the file and the reason."""


@dataclass(frozen=True)
class GGUFSummary:
    """What the header of a GGUF file says, read without loading a tensor."""

    architecture: str
    """``general.architecture``, e.g. ``llama``."""
    model_type: str
    """The name transformers reads it under."""
    tensor_types: dict[str, int]
    """Number of tensors of each GGML type, e.g. ``{"Q4_1": 210, "F32": 61}``."""
    parameters: int
    """Number of weights in all tensors."""


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _dequantizable(qtype: Any) -> bool:
    # Probe one zero block: gguf raises NotImplementedError for the types it cannot dequantize,
    # and its table of the others is private.
    import numpy as np
    from gguf import GGML_QUANT_SIZES, dequantize

    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def read_gguf(path: str | Path, given: str | None = None) -> GGUFSummary:
    """Read the header of the GGUF file ``path`` and check that it can be imported; raise
    :class:`GGUFImportError` naming the file (as the user ``given`` it, if not ``path``) and the
    reason otherwise."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    shown = f"base.source={printable(given or str(path))!r}"
    if not is_gguf_file(path):
        raise GGUFImportError(f"{shown} is not a GGUF file (it does not start with 'GGUF')")
    try:
        # every declared count and length within the file's size, before gguf's reader
        # builds Python objects for them (gguf_header)
        header = check_gguf_header(path)
        reader = GGUFReader(path)
        types = Counter(tensor.tensor_type for tensor in reader.tensors)
        parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    except Exception as exc:  # a damaged file fails in numpy, struct or gguf in many ways
        # the reason may quote the file's bytes (a tensor name): escaped, on one line
        raise GGUFImportError(
            f"{shown}: not a readable GGUF file ({type(exc).__name__}: {printable(str(exc))})"
        ) from None
    if "general.architecture" not in header.keys:
        raise GGUFImportError(
            f"{shown}: its header has no general.architecture, so the model it holds is unknown"
        )
    refused = sorted(qtype.name for qtype in types if not _dequantizable(qtype))
    if refused:
        raise GGUFImportError(
            f"{shown}: tensor type {', '.join(refused)} cannot be dequantized by gguf "
            f"{_version('gguf')}; export the model with another quantisation (e.g. Q8_0, F16)"
        )
    architecture = printable(str(reader.fields["general.architecture"].contents()))
    model_type = ARCHITECTURE_NAMES.get(architecture, architecture.replace("-", "_"))
    if model_type not in GGUF_SUPPORTED_ARCHITECTURES or model_type in ("general", "tokenizer"):
        raise GGUFImportError(
            f"{shown}: architecture {architecture!r} cannot be read by transformers "
            f"{_version('transformers')} (it reads GGUF files of "
            f"{', '.join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {'general', 'tokenizer'}))})"
        )
    summary = GGUFSummary(
        architecture=architecture,
        model_type=model_type,
        tensor_types={qtype.name: count for qtype, count in sorted(types.items())},
        parameters=parameters,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check_weights_present(str(Path(path).parent), Path(path).name, summary, shown)
    return summary


def _check_weights_present(folder: str, name: str, summary: GGUFSummary, shown: str) -> None:
    """Refuse, before any weight is allocated, a file whose tensors hold fewer weights than the
    model its metadata describes: weights left out (they would be initialised at random), or
    metadata declaring a model far larger than the file (a 5 kB file made ``ppo base`` allocate
    1.2 GB). The model is built on the meta device, which allocates nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers validates a config in many ways
        raise GGUFImportError(
            f"{shown}: its metadata does not describe a model transformers can build "
            f"({type(exc).__name__}: {printable(str(exc).splitlines()[-1].strip())})"
        ) from None
    needed = sum(p.numel() for p in model.parameters())
    if summary.parameters < needed:
        raise GGUFImportError(
            f"{shown}: its tensors hold {summary.parameters:,} weights, but the "
            f"{summary.architecture} model its metadata describes needs {needed:,}: weights are "
            "missing, or the metadata declares a larger model than the file holds"
        )


def _version(package: str) -> str:
    return version(package)


def import_gguf(
    path: str | Path, dest: str | Path, dtype: str = "fp32", given: str | None = None
) -> GGUFSummary:
    """Write the model in the GGUF file ``path`` into the folder ``dest`` (which must exist) as
    ``save_pretrained`` does: ``config.json``, ``model.safetensors`` in ``dtype`` (``fp32`` or
    ``bf16``), ``generation_config.json`` and the tokenizer files with the chat template.

    The file is checked by :func:`read_gguf` first. Quantized tensors are dequantized by
    ``gguf`` exactly as transformers' own GGUF loading does, so the folder's model computes what
    ``from_pretrained(folder, gguf_file=name)`` computes (in fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, dest = Path(path), Path(dest)
    summary = read_gguf(path, given)
    shown = f"base.source={printable(given or str(path))!r}"
    folder, name = str(path.parent), path.name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded, loading = cast(
                "tuple[Any, dict[str, Any]]",
                AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
                ),
            )
    except (ValueError, KeyError, OSError) as exc:  # e.g. an encoder-only architecture
        if isinstance(exc, GGUFImportError):
            raise
        raise GGUFImportError(
            f"{shown}: transformers {_version('transformers')} cannot load it as a causal "
            f"language model: {printable(str(exc))}"
        ) from None
    missing = sorted(loading["missing_keys"])
    if missing:  # never a model with weights initialised at random
        raise GGUFImportError(
            f"{shown}: {len(missing)} weights the {summary.architecture} model needs are not in "
            f"the file (e.g. {', '.join(printable(k) for k in missing[:3])}); it is not a "
            "complete model"
        )
    config = loaded.config
    # A model loaded from GGUF carries a quantization config that makes save_pretrained refuse;
    # the weights are plain tensors by now, so a fresh model of the same config takes them over.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = DTYPES[dtype]
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    plain.load_state_dict(
        {key: value.to(DTYPES[dtype]) for key, value in loaded.state_dict().items()},
        assign=True,
        strict=True,
    )
    plain.tie_weights()
    generation = loaded.generation_config
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    plain.generation_config = generation
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return summary
