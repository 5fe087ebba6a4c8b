"""The safetensors file format, read through any file object and written as a stream.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
``data_offsets`` relative to the end of the header), then the tensor bytes. Parsing it ourselves (not
``safe_open``) lets the base be read through fsspec with plain ranged reads (a ``gs://`` object like a
local file, and no memory map that would count every byte read into the process's RSS), and lets a
writer emit the header first (all shapes are known up front) and then stream tensor bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import struct

import ml_dtypes
import numpy as np

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
ITEM_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}
# The dtypes a LoRA delta can be added to (in float32, then cast back).
FLOAT_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in a safetensors file."""

    name: str
    dtype: str  # safetensors dtype: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: str  # the file's name in its directory
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(f, path: str, size: int) -> list[TensorInfo]:
    """The tensors of the safetensors file ``path``, open as ``f`` (``size`` bytes), in file order."""
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ValueError(f"{path}: not a safetensors file (header length {length} for a {size}-byte file)")
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise ValueError(f"{path}: not a safetensors file (bad JSON header: {exc})") from None
    start = 8 + length
    out = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name} has a malformed header entry {spec!r}") from None
        if not 0 <= begin <= end <= size - start:
            raise ValueError(f"{path}: tensor {name} lies outside the file (offsets {begin}..{end}, {size} bytes)")
        if dtype in ITEM_SIZES and math.prod(shape) * ITEM_SIZES[dtype] != end - begin:
            raise ValueError(f"{path}: tensor {name} ({dtype} {list(shape)}) has {end - begin} bytes of data")
        out.append(TensorInfo(name, dtype, shape, posixpath.basename(path), start + begin, end - begin))
    out.sort(key=lambda t: t.offset)
    return out


def encode_header(tensors: list[TensorInfo], metadata: dict[str, str] | None = None) -> bytes:
    """The header (length + JSON) of a file holding ``tensors`` back to back, in this order; padded
    with spaces so the data starts 8-byte aligned, as the safetensors library writes it."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw
