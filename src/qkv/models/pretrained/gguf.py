"""GGUF files (llama.cpp's format): metadata, and tensors dequantized to float32.

The ``gguf`` package parses the file (memory-mapped); the common block formats are unpacked
here with torch, each from its llama.cpp block layout:

- Q8_0: blocks of 32 weights: an fp16 scale d, then 32 int8 q; w = d * q.
- Q4_0: an fp16 d, then 16 bytes; byte j holds weight j (low nibble) and j + 16 (high);
  w = d * (q - 8).
- Q4_1: an fp16 d and an fp16 minimum m, then 16 bytes as in Q4_0; w = d * q + m.

Other block formats the ``gguf`` package knows (the K-quants, ...) go through its numpy
dequantizer; a format neither knows is refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...bars import bar
from .files import CheckpointError


def _scale(blocks: Tensor, start: int) -> Tensor:
    """The fp16 number at byte ``start`` of each block (n, bytes) -> (n, 1) float32."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: Tensor) -> Tensor:
    """(n, 16) bytes -> (n, 32) float32 values 0..15: the low nibbles, then the high ones
    (written straight into one buffer: the temporaries of a cat cost more than the math)."""
    packed = packed.contiguous()
    out = torch.empty(packed.shape[0], 32)
    out[:, :16] = packed & 0x0F
    out[:, 16:] = packed >> 4
    return out


def _q8_0(blocks: Tensor) -> Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_scale(blocks, 0))


def _q4_0(blocks: Tensor) -> Tensor:
    return _nibbles(blocks[:, 2:]).sub_(8.0).mul_(_scale(blocks, 0))


def _q4_1(blocks: Tensor) -> Tensor:
    return _nibbles(blocks[:, 4:]).mul_(_scale(blocks, 0)).add_(_scale(blocks, 2))


# type name -> (bytes per block of 32 weights, unpack (n, bytes) uint8 -> (n, 32) float32)
BLOCK_FORMATS = {"Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1)}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Tensor:
    """A tensor's stored bytes or values -> float32 of ``shape`` (torch order, outer first)."""
    if type_name == "F32":
        return torch.from_numpy(np.array(raw, dtype=np.float32)).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(np.array(raw).view(np.float16)).float().reshape(shape)
    if type_name == "BF16":
        bits = torch.from_numpy(np.array(raw).view(np.int16)).int() << 16
        return bits.view(torch.float32).reshape(shape)
    if type_name in BLOCK_FORMATS:
        size, unpack = BLOCK_FORMATS[type_name]
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(-1, size)
        return unpack(blocks).reshape(shape)
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType[type_name]
        values = gguf.quants.dequantize(np.array(raw), qtype)
    except (KeyError, NotImplementedError):
        raise CheckpointError(
            f"GGUF tensor type {type_name} is not supported; qkv reads F32, F16, BF16, "
            f"{', '.join(BLOCK_FORMATS)} and the types the gguf package can dequantize"
        ) from None
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def _reader(path: str):
    """The ``gguf`` package's reader over a plain ndarray view of its memory map: the reader
    slices the map once per field part (about a million times for a 49k-token vocabulary),
    and each numpy.memmap slice runs Python code; plain slices parse SmolLM2 in 1.0 s, not
    3.5 s. The view keeps the map open."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._plain = mapped.view(np.ndarray)

    return PlainViewReader(path)


class GGUFFile:
    """One GGUF file: metadata values (``get``, ``require``; read on first use, since the
    vocabulary arrays are large) and ``tensor(name)`` in float32."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = _reader(str(self.path))
        except (ValueError, OSError, IndexError) as e:
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {e}") from None
        self._values: dict = {}
        self._tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default=None):
        if key not in self.reader.fields:
            return default
        if key not in self._values:
            self._values[key] = self.reader.fields[key].contents()
        return self._values[key]

    def require(self, key: str):
        if key not in self.reader.fields:
            raise CheckpointError(f"{self.path} lacks the metadata key {key!r}")
        return self.get(key)

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> Tensor:
        """Dequantized float32, shaped as torch stores it (GGUF lists dimensions inner first)."""
        t = self._tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        return dequantize(t.data, t.tensor_type.name, shape)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, dequantized (seconds for SmolLM2: a progress bar on a terminal)."""
        return {name: self.tensor(name)
                for name in bar(self._tensors, desc=f"loading {self.path.name}", unit="tensor")}

    def readers(self) -> dict[str, Callable[[], Tensor]]:
        """Each tensor's name -> a function that dequantizes that tensor alone, for a
        ``TensorSource`` that holds one at a time."""
        return {name: functools.partial(self.tensor, name) for name in self._tensors}
