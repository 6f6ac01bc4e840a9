"""Params that are read from their file only where they are indexed: what a process loads under tensor
parallelism, so that it materializes its own devices' slices of every weight and never the whole model.

A `LazyTensor` has a shape and a dtype (those of the param in `models/params.py`'s layout, after any
conversion) and reads on `tensor[index]`, for an index of slices; `np.asarray(tensor)` reads it all.
Each source supplies its reader: safetensors slices (`hf.py`, and the converted-GGUF cache), orbax
checkpoints through tensorstore (`orbax.py`), and GGUF tensors, which are dequantized whole and then
sliced (`gguf.py`). `stacked` puts the per-layer tensors of one param under a leading layer axis.
Every tensor counts the bytes it returned (`bytes_read`), which tests and the start-up log use.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Index = tuple[slice, ...]


class LazyTensor:
    def __init__(self, shape: Sequence[int], dtype, read: Callable[[Index], np.ndarray]):
        """read(index): the part of the param at `index`, a tuple of one step-1 slice per axis with
        bounds inside the shape, as an array of this dtype."""
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(jnp.dtype(dtype)), read
        self.bytes_read = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if any(not isinstance(s, slice) for s in index) or len(index) > self.ndim:
            raise TypeError(f"a LazyTensor takes at most {self.ndim} slices, not {index!r}")
        index = index + (slice(None),) * (self.ndim - len(index))
        bounds = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape))
        if any(s.step != 1 for s in bounds):
            raise TypeError(f"a LazyTensor takes step-1 slices, not {index!r}")
        bounds = tuple(slice(s.start, max(s.start, s.stop)) for s in bounds)
        expected = tuple(s.stop - s.start for s in bounds)
        if 0 in expected:  # nothing to read (files' readers may not take empty ranges)
            return np.zeros(expected, self.dtype)
        part = np.asarray(self._read(bounds), self.dtype)
        if part.shape != expected:
            raise ValueError(f"reading {bounds} gave the shape {part.shape}, not {expected}")
        self.bytes_read += part.nbytes
        return part

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def stacked(layers: Sequence[LazyTensor]) -> LazyTensor:
    """The per-layer tensors of one param as one [num_layers, ...] tensor; a read reads only the
    layers it covers, each at the rest of the index."""
    first = layers[0]

    def read(index: Index) -> np.ndarray:
        rows, rest = index[0], index[1:]
        parts = [layers[i][rest] for i in range(rows.start, rows.stop)]
        return np.stack(parts) if parts else np.zeros((0, *(s.stop - s.start for s in rest)), first.dtype)

    return LazyTensor((len(layers), *first.shape), first.dtype, read)


def converted(source_shape: Sequence[int], dtype, read_source: Callable[[Index], np.ndarray], *,
              transpose: bool = False, offset: float = 0.0) -> LazyTensor:
    """A 1-D or 2-D tensor stored in another layout: `transpose` (torch's [out, in] for our [in, out])
    and an `offset` added to every value (Gemma's norms), read from the source at the matching index."""
    shape = tuple(reversed(source_shape)) if transpose else tuple(source_shape)

    def read(index: Index) -> np.ndarray:
        part = np.asarray(read_source(tuple(reversed(index)) if transpose else index), np.float32)
        part = part.T if transpose else part
        return (part + offset) if offset else part

    return LazyTensor(shape, dtype, read)


def broadcast_scale(scale: LazyTensor, n: int) -> LazyTensor:
    """A quantized weight's scale, one per tensor or per output channel, as [n] float32 (read whole: n floats)."""
    return LazyTensor((n,), np.float32, lambda index: np.broadcast_to(
        np.asarray(scale[()], np.float32).reshape(-1), (n,))[index])


def bytes_read(tree) -> int:
    """The bytes every LazyTensor in the pytree `tree` has returned so far."""
    return sum(x.bytes_read for x in jax.tree.leaves(tree) if isinstance(x, LazyTensor))


def total_bytes(tree) -> int:
    """The bytes of the whole params pytree `tree` (lazy or not, quantized or not), read or not."""
    return sum(int(np.prod(x.shape)) * np.dtype(jnp.dtype(x.dtype)).itemsize for x in jax.tree.leaves(tree))
