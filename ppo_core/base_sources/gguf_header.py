"""A bounded walk over a GGUF file's header (layer 2), before ``gguf``'s reader sees the file.

``gguf.GGUFReader`` trusts the counts a header declares: an array of 2^40 elements in a 94-byte
file kept it building Python objects for ever. :func:`check_gguf_header` walks the same header
(llama.cpp's GGUF specification: magic, version, tensor count, key-value count, then each
key-value pair and each tensor's name, dimensions, type and offset) and checks every declared
count and length against the bytes left in the file before it skips them, so a header that
lies is refused in time proportional to the file's size. It also returns the key names, and
the tensors' element counts, which :mod:`ppo_core.base_sources.gguf_import` checks against what
the architecture needs before it allocates anything.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GGUFHeader", "GGUFHeaderError", "check_gguf_header"]

# Value types of the specification, by their number: the size of one element in bytes, or None
# for a string (a uint64 length and its bytes) and an array (an element type, a uint64 count).
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_DIMENSIONS = 8  # ggml's GGML_MAX_DIMS is 4; a file declaring more is not a model


class GGUFHeaderError(ValueError):
    """The header declares more than the file holds, or a type that does not exist."""


@dataclass(frozen=True)
class GGUFHeader:
    keys: frozenset[str]
    tensor_elements: dict[str, int]
    """Each tensor's name and number of elements, as the header declares them."""


class _Cursor:
    def __init__(self, data: bytes | mmap.mmap):
        self.data, self.at = data, 0

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise GGUFHeaderError(
                f"{what} needs {size} bytes at offset {self.at}, past the end of the file "
                f"({len(self.data)} bytes)"
            )
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        return self.take(self.number("Q", f"the length of {what}"), what)

    def count(self, what: str, least_each: int) -> int:
        """A declared count, refused when even ``least_each`` bytes each would not fit."""
        declared = self.number("Q", what)
        left = len(self.data) - self.at
        if declared * least_each > left:
            raise GGUFHeaderError(
                f"{what} is {declared}, but {left} bytes are left in the file "
                f"(at least {least_each} each)"
            )
        return declared

    def value(self, kind: int, what: str) -> None:
        if kind in FIXED_SIZES:
            self.take(FIXED_SIZES[kind], what)
        elif kind == STRING:
            self.string(what)
        elif kind == ARRAY:
            element = self.number("I", f"the element type of {what}")
            if element in FIXED_SIZES:
                length = self.count(f"the length of {what}", FIXED_SIZES[element])
                self.take(length * FIXED_SIZES[element], what)
                return
            if element not in (STRING, ARRAY):
                raise GGUFHeaderError(f"{what} has elements of unknown type {element}")
            # a string takes at least its 8-byte length; an array its type and count
            length = self.count(f"the length of {what}", 8 if element == STRING else 12)
            for _ in range(length):
                self.value(element, f"an element of {what}")
        else:
            raise GGUFHeaderError(f"{what} has unknown type {kind}")


def check_gguf_header(path: str | Path) -> GGUFHeader:
    """Walk the header of the GGUF file ``path`` (version 2 or 3) within the file's size;
    raise :class:`GGUFHeaderError` saying what it declares that the file cannot hold."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size < 24:
            raise GGUFHeaderError("it is shorter than a GGUF header (24 bytes)")
        # mapped, not read: the tensors' bytes (gigabytes) are never touched here
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(_Cursor(data))


def _walk(cursor: _Cursor) -> GGUFHeader:
    if cursor.take(4, "the magic bytes") != b"GGUF":
        raise GGUFHeaderError("it does not start with 'GGUF'")
    version = cursor.number("I", "the version")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} is not read (versions 2 and 3 are)")
    # the least a tensor's entry takes: name length, 1 dimension, dims, type, offset
    tensors = cursor.count("the tensor count", 8 + 4 + 8 + 4 + 8)
    pairs = cursor.count("the key-value count", 8 + 4 + 1)
    keys = set()
    for number in range(pairs):
        key = cursor.string(f"key {number}").decode("utf-8", errors="replace")
        keys.add(key)
        cursor.value(cursor.number("I", f"the type of {key!r}"), repr(key))
    elements = {}
    for number in range(tensors):
        name = cursor.string(f"the name of tensor {number}").decode("utf-8", errors="replace")
        dims = cursor.number("I", f"the dimension count of {name!r}")
        if not 1 <= dims <= MAX_DIMENSIONS:
            raise GGUFHeaderError(f"tensor {name!r} declares {dims} dimensions")
        size = 1
        for _ in range(dims):
            size *= cursor.number("Q", f"a dimension of {name!r}")
        cursor.take(4 + 8, f"the type and offset of {name!r}")
        elements[name] = size
    return GGUFHeader(frozenset(keys), elements)
