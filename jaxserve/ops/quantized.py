"""Quantized weights for XLA's dot (`quantization` "int8" or "fp8" off the C++ CPU matmul: on a GPU, or
on a CPU under matmul_backend "xla"): `QuantizedWeight` and its matmul.

A weight w [K, N] is held as integers or float8 with one float32 scale per output column (per channel:
w[:, n] ~= data[:, n] * scale[n]). The activations are quantized per token as the matmul runs (dynamic
scaling: each row's absolute maximum maps to the type's largest value), so both operands of the dot are
8-bit and the product is rescaled once per output: y[m, n] = (xq[m] . data[:, n]) * x_scale[m] * scale[n].
On Hopper XLA turns the float8 dot into an fp8 GEMM (cuBLASLt) and the int8 dot into an integer GEMM;
whole weights are never widened before the dot.

The C++ CPU matmul's int8 and fp8 weights are a `PackedWeight` (`packed_matmul.py`), not this.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# The 8-bit types a weight may be held in, and the largest value each maps its absolute maximum to.
KINDS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """w [..., K, N] ~= data * scale[..., None, :]; data int8 or float8_e4m3fn, scale float32 [..., N]."""

    data: jax.Array  # [..., K, N] int8 | float8_e4m3fn
    scale: jax.Array  # [..., N] float32

    @property
    def kind(self) -> str:
        return "int8" if self.data.dtype == jnp.int8 else "fp8"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @classmethod
    def quantize(cls, w, kind: str) -> QuantizedWeight:
        """w [..., K, N] (float; numpy stays numpy) with a scale per output column: max |w[:, n]| -> the type's
        largest value. A column of zeros gets scale 1."""
        assert kind in KINDS, kind
        xp = np if isinstance(w, np.ndarray) else jnp
        dtype, largest = KINDS[kind]
        w32 = w.astype(xp.float32)
        absmax = xp.max(xp.abs(w32), axis=-2)  # [..., N]
        # times the reciprocal: XLA turns a division by a constant into that, and host and device must agree
        scale = xp.where(absmax > 0, absmax * np.float32(1 / largest), np.float32(1)).astype(xp.float32)
        q = w32 / scale[..., None, :]
        q = xp.clip(xp.round(q), -largest, largest) if kind == "int8" else xp.clip(q, -largest, largest)
        return cls(q.astype(dtype), scale)

    def dequantize(self, dtype=jnp.float32):
        """The float weight [..., K, N] the data stands for."""
        xp = np if isinstance(self.data, np.ndarray) else jnp
        return (self.data.astype(xp.float32) * self.scale[..., None, :]).astype(dtype)

    def __getitem__(self, index) -> QuantizedWeight:
        """One layer of a stacked weight (index into the leading axes)."""
        return QuantizedWeight(self.data[index], self.scale[index])

    @classmethod
    def concatenate(cls, parts: list[QuantizedWeight], num_shards: int = 1) -> QuantizedWeight:
        """[p0 | p1 | ...] by output columns, shard by shard (`transformer._fuse`'s layout): the columns'
        own scales go with them."""
        xp = np if isinstance(parts[0].data, np.ndarray) else jnp

        def fuse(arrays):
            split = [a.reshape(*a.shape[:-1], num_shards, a.shape[-1] // num_shards) for a in arrays]
            fused = xp.concatenate(split, axis=-1)
            return fused.reshape(*fused.shape[:-2], -1)

        return cls(fuse([p.data for p in parts]), fuse([p.scale for p in parts]))


def quantize_activations(x, kind: str):
    """x [M, K] -> (xq [M, K] in kind's type, x_scale [M, 1] float32): each row's max |x| -> the type's largest."""
    dtype, largest = KINDS[kind]
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(absmax > 0, absmax / largest, 1.0)
    q = x32 / x_scale
    q = jnp.clip(jnp.round(q), -largest, largest) if kind == "int8" else jnp.clip(q, -largest, largest)
    return q.astype(dtype), x_scale


def matmul(x, w: QuantizedWeight):
    """x [M, K] @ w -> [M, N] in x's dtype, both operands of the dot 8-bit (W8A8), summed in int32 or
    float32 and scaled in float32. In x's dtype as `x @ w` would be: a float32 result would turn a bfloat16
    model's residual stream float32 from the first layer on."""
    xq, x_scale = quantize_activations(x, w.kind)
    accumulate = jnp.int32 if w.kind == "int8" else jnp.float32
    y = jax.lax.dot_general(xq, w.data, (((1,), (0,)), ((), ())), preferred_element_type=accumulate)
    return (y.astype(jnp.float32) * x_scale * w.scale).astype(x.dtype)
