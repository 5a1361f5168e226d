"""A GGUF file's metadata and tensors, read without gguf.GGUFReader's per-element parsing.

gguf.GGUFReader (gguf-py) turns every part of every metadata value into a numpy view of the
file: Gemma 3 270M's vocabulary (262,144 token strings, their scores and types) becomes ~800,000
small arrays, ~25-50 s on 2 cores before a tensor is read, most of it numpy's memmap bookkeeping.
This reader walks the same header with `struct` (a string or an array becomes its Python value
at once) and maps the tensors as gguf-py does: `fields[key].contents()` equals gguf-py's
`ReaderField.contents()` for every scalar, string and flat array, and each tensor's `name`,
`tensor_type`, `shape` and `data` equal its `ReaderTensor`'s (tests/models/test_models_gguf.py
compares the two on a written file).  An array of arrays, which gguf-py flattens, comes back
nested here.
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np

GGUF_MAGIC = 0x46554747  # b"GGUF", little-endian
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
UINT32, STRING, ARRAY = 4, 8, 9
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {"B": np.uint8, "b": np.int8, "H": np.uint16, "h": np.int16, "I": np.uint32, "i": np.int32,
          "f": np.float32, "?": np.bool_, "Q": np.uint64, "q": np.int64, "d": np.float64}


class Field(NamedTuple):
    name: str
    types: tuple[int, ...]  # GGUFValueType values: (ARRAY, item type) for an array
    value: Any

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # uint64 dims as the file lists them (ne0, the fastest, first)
    data: np.ndarray  # a view of the file: elements (F16/F32/...) or bytes per row (quantised)


class GGUFFile:
    """`fields`: {key: Field}; `tensors`: [Tensor] in file order (views of a read-only memmap)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        if struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", buf, 4)[0]
        self.endian = ">" if version & 0xFFFF == 0 else "<"  # a file written for the other byte order
        if self.endian == ">":
            version = struct.unpack_from(">I", buf, 4)[0]
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (versions {VERSIONS} are)")
        e = self.endian
        tensor_count, kv_count = struct.unpack_from(e + "QQ", buf, 8)
        offs = 24
        self.fields: dict[str, Field] = {}
        for _ in range(kv_count):
            key, offs = self._str(buf, offs)
            (vtype,), offs = struct.unpack_from(e + "I", buf, offs), offs + 4
            value, types, offs = self._value(buf, offs, vtype)
            if key in self.fields:
                raise KeyError(f"Duplicate {key} in the GGUF metadata")
            self.fields[key] = Field(key, types, value)
        infos = []
        for _ in range(tensor_count):
            name, offs = self._str(buf, offs)
            (n_dims,), offs = struct.unpack_from(e + "I", buf, offs), offs + 4
            dims = struct.unpack_from(f"{e}{n_dims}Q", buf, offs)
            offs += 8 * n_dims
            raw_type, offset = struct.unpack_from(e + "IQ", buf, offs)
            offs += 12
            infos.append((name, dims, raw_type, offset))
        self.alignment = DEFAULT_ALIGNMENT
        align = self.fields.get("general.alignment")
        if align is not None:
            if align.types != (UINT32,):
                raise ValueError("Bad type for general.alignment field")
            self.alignment = align.value
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        self.data_offset = offs + (-offs % self.alignment)
        plain = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
                 gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                 gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                 gguf.GGMLQuantizationType.I64: np.int64}
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"Found duplicated tensor with name {name}")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims))
            np_dims = tuple(reversed(dims))
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if qtype in plain:
                dtype, count = np.dtype(plain[qtype]), n_elems
            else:
                dtype, count = np.dtype(np.uint8), n_elems * type_size // block_size
                if np_dims[-1] % block_size:
                    raise ValueError(f"Quantized tensor row size ({np_dims[-1]}) is not a multiple of "
                                     f"{qtype.name} block size ({block_size})")
                np_dims = (*np_dims[:-1], np_dims[-1] // block_size * type_size)
            start = self.data_offset + offset
            order = e if dtype.itemsize > 1 else "|"
            arr = self.data[start:start + count * dtype.itemsize].view(dtype.newbyteorder(order)).reshape(np_dims)
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.uint64), arr))

    def _str(self, buf, offs: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self.endian + "Q", buf, offs)
        return str(buf[offs + 8:offs + 8 + n], encoding="utf-8"), offs + 8 + n

    def _value(self, buf, offs: int, vtype: int) -> tuple[Any, tuple[int, ...], int]:
        """The value of type `vtype` at `offs` -> (value, its types, the offset after it)."""
        e = self.endian
        if vtype == STRING:
            s, offs = self._str(buf, offs)
            return s, (STRING,), offs
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            return struct.unpack_from(e + fmt, buf, offs)[0], (vtype,), offs + struct.calcsize(fmt)
        if vtype != ARRAY:
            raise ValueError(f"Unknown/unhandled field type {vtype}")
        itype, count = struct.unpack_from(e + "IQ", buf, offs)
        offs += 12
        if itype in _SCALAR:  # one read for the whole array
            dtype = np.dtype(_NUMPY[_SCALAR[itype]]).newbyteorder(e if _SCALAR[itype] not in "Bb?" else "|")
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=offs).tolist()
            return values, (ARRAY, itype), offs + count * dtype.itemsize
        if itype == STRING:
            values, unpack = [], struct.Struct(e + "Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, offs)
                values.append(str(buf[offs + 8:offs + 8 + n], encoding="utf-8"))
                offs += 8 + n
            return values, (ARRAY, STRING), offs
        values, types = [], (ARRAY, itype)
        for _ in range(count):  # an array of arrays
            v, sub, offs = self._value(buf, offs, itype)
            values.append(v)
            types = (ARRAY, *sub)
        return values, types, offs


__all__ = ["Field", "GGUFFile", "Tensor"]
