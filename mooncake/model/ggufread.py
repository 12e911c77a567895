"""A GGUF file (llama.cpp's checkpoint format) read through a memory map: its metadata, its
tensor table and each tensor's raw bytes. Torch-free (the master reads the metadata too).

Layout (little-endian; versions 2 and 3):

| region        | contents                                                             |
|---------------|----------------------------------------------------------------------|
| header        | b"GGUF", version u32, tensor count u64, metadata count u64           |
| metadata      | per entry: key (u64 length + UTF-8), value type u32, value            |
| tensor table  | per tensor: name, n_dims u32, dims u64 x n_dims, ggml type u32, offset u64 |
| data          | from the table's end rounded up to `general.alignment` (32 default)  |

Dims are ggml's `ne`, innermost first: a (rows, cols) matrix is stored as [cols, rows].
`GGUFTensor.shape` is numpy's order (rows first). We parse the header ourselves rather
than with `gguf.GGUFReader`, which builds a numpy view per vocabulary string (~3 s for a
49k-token vocabulary); `numpy` is enough here, and the `gguf` package is not needed to
serve.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mooncake.errors import ConfigError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # bytes

# ggml type id -> (name, elements per block, bytes per block), as in ggml.h
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# metadata value type id -> struct format of a scalar (8 = string, 9 = array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9
_NUMPY = {k: np.dtype("<" + f) if f != "?" else np.dtype(np.bool_) for k, f in _SCALARS.items()}


def type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type id {ggml_type}"


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table."""

    name: str  # llama.cpp's name, e.g. "blk.0.attn_q.weight"
    ggml_type: int  # GGML_TYPES key
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    offset: int  # bytes from the start of the file
    num_bytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


class GGUFFile:
    """The metadata and tensor table of a GGUF file; tensor bytes stay in the memory map.

    The map is private copy-on-write (never written), so `raw` hands out writable numpy
    views that torch takes without a copy or a read-only warning.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: cannot read {self.path}: {e}") from e
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ConfigError(f"model.path: {self.path} is not a valid GGUF file ({e})") from e

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != MAGIC:
            raise ConfigError(f"model.path: {self.path} is not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise ConfigError(
                f"model.path: {self.path} is GGUF version {version} (or big-endian); "
                "supported: versions 2 and 3, little-endian"
            )
        num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        entries = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_start = -(-self._pos // align) * align  # bytes: where tensor data begins
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, ggml_type, offset in entries:
            num_bytes = _num_bytes(shape, ggml_type)
            start = self.data_start + offset
            if num_bytes is not None and start + num_bytes > len(buf):
                raise ConfigError(f"model.path: {self.path} is truncated (tensor {name!r})")
            self.tensors[name] = GGUFTensor(name, ggml_type, shape, start, num_bytes or 0)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = self._map[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return text

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack("<" + _SCALARS[vtype])[0]
        if vtype != _ARRAY:
            raise ConfigError(f"model.path: {self.path}: unknown metadata value type {vtype}")
        item_type, count = self._unpack("<IQ")
        if item_type in _NUMPY:  # token types, scores: one numpy array
            dtype = _NUMPY[item_type]
            values = np.frombuffer(self._map, dtype, count, self._pos).copy()
            self._pos += count * dtype.itemsize
            return values
        return [self._value(item_type) for _ in range(count)]

    def header_bytes(self) -> bytes:
        """Everything before the tensor data: metadata and the tensor table."""
        return self._map[: self.data_start]

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a (num_bytes,) uint8 view of the map (no copy)."""
        return np.frombuffer(self._map, np.uint8, tensor.num_bytes, tensor.offset)

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _num_bytes(shape: tuple[int, ...], ggml_type: int) -> int | None:
    if ggml_type not in GGML_TYPES:
        return None
    _, block, block_bytes = GGML_TYPES[ggml_type]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return count // block * block_bytes


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only `*.gguf` in a directory without
    config.json; None when it names none; ConfigError when a directory holds several."""
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ConfigError(f"model.path: {path} does not exist")
        return p
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ConfigError(
            f"model.path: {path} holds several GGUF files ({names}); name one of them"
        )
    return found[0] if found else None
