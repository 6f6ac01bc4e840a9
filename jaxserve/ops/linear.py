"""The model's matmuls, whatever holds the weight: a plain array (XLA's dot), a `PackedWeight` (the C++
CPU matmul, float32, bfloat16 or int8) or a `QuantizedWeight` (XLA's 8-bit dot). The model calls these
and never asks which."""

from __future__ import annotations

from jaxserve.ops import packed_matmul, quantized
from jaxserve.ops.packed_matmul import PackedWeight
from jaxserve.ops.quantized import QuantizedWeight


def matmul(x, w, rows=None):
    """x [M, K] @ w -> [M, N]. rows (a traced int32 or None): the C++ kernel multiplies only x's first
    `rows` rows (a padded step's real tokens) and gives zeros below them; XLA computes every row."""
    if isinstance(w, PackedWeight):
        return packed_matmul.matmul(x, w, rows)
    if isinstance(w, QuantizedWeight):
        return quantized.matmul(x, w)
    return x @ w


def silu_gated_matmul(x, w, rows=None, add=None, out_dtype=None):
    """silu(x @ w_gate) * (x @ w_up) for w = [w_gate | w_up]: one C++ kernel call where it can (see
    `packed_matmul.silu_gated_matmul`), else the matmul and XLA. add (LoRA's deltas [M, 2 I]) or None:
    added to x @ w before the activation. out_dtype: the result's dtype, or None: as computed."""
    if isinstance(w, PackedWeight):
        return packed_matmul.silu_gated_matmul(x, w, rows, add, out_dtype)
    return packed_matmul.gated_activation(matmul(x, w, rows), add, out_dtype)
