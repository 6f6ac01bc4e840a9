"""The C++ packed-weight matmul (`cpu_kernels/packed_matmul.cc`, built and registered by `cpu_ffi`): the
weights packed once at load (`PackedWeight`), and the calls the model makes (`matmul`, `silu_gated_matmul`).

XLA:CPU's dot runs the few-row matmuls of decode steps far below its large-matmul rate; with the weights
packed in column panels the kernel keeps a few rows' accumulators in registers and streams each panel
once, which is faster there and no slower on prompt-sized matmuls (benchmarks/results/cpu_kernels_history.md).
Four weight types: float32; bfloat16 (`matmul_backend "cpu-bf16"`: x rounded to bfloat16, float32 sums,
vdpbf16ps on AVX512-BF16); int8 (`quantization "int8"`: per-column scales, x quantized in groups of its
row's k, vpdpbusd on AVX512-VNNI); float8 e4m3 (`quantization "fp8"`: per-column scales, x in bfloat16, each
weight widened to bfloat16 in the register and multiplied by vdpbf16ps: W8A16, as vLLM runs fp8 weights
on GPUs without fp8 arithmetic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops import cpu_ffi
from jaxserve.ops.cpu_ffi import PANEL_WIDTH
from jaxserve.ops.quantized import QuantizedWeight


# The int8 kernel quantizes x in groups of consecutive k of a row, each with its own scale: one outlier
# channel then coarsens only its group (the default model's perplexity: about +1% over float32 weights,
# against +4.5% with one scale a row). A group is the first of these sizes that divides a device's K (the
# whole K where none does); the larger the group, the fewer times the kernel turns its integer sums into
# float (at 96, about a tenth of its time for 32 rows).
INT8_GROUPS = (128, 96, 64, 32)
AMX_INT8_GROUPS = (128, 64)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"], meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight w [K, n] for `matmul`, packed in column panels of PANEL_WIDTH columns, each one contiguous
    run of K rows, zero-padded past n. float32: data [ceil(n / PANEL_WIDTH), K, PANEL_WIDTH]. bfloat16:
    data [panels, K / 2, 2 PANEL_WIDTH], rows 2i and 2i + 1 interleaved column by column, so that each
    32-bit lane holds the pair (w[2i, c], w[2i + 1, c]) the kernel multiplies at once. int8: data
    [panels, K / 4, 4 PANEL_WIDTH] uint8, four rows to a lane the same way, each q[k, c] + 128 (offset
    binary: vpdpbusd's unsigned operand), w[k, c] ~= q[k, c] * scale[c]. fp8: data [panels, K / 2,
    2 PANEL_WIDTH] float8_e4m3fn paired as bfloat16's, w[k, c] ~= q[k, c] * scale[c] / 2^FP8_SCALE_SHIFT
    (the kernel's bfloat16 form of q is q * 2^-120 and its x is x * 2^64: `packed_matmul.cc`, F8Pairs),
    no subnormal q (`_fp8_normal`)."""

    data: jax.Array
    n: int
    scale: jax.Array | None = None  # int8, fp8: [panels * PANEL_WIDTH] float32, each column's scale

    @property
    def kind(self) -> str:
        """The weights' type: "float32", "bfloat16", "int8" or "fp8"."""
        return {jnp.dtype(jnp.uint8): "int8", jnp.dtype(jnp.float8_e4m3fn): "fp8"}.get(jnp.dtype(self.data.dtype),
                                                                                      jnp.dtype(self.data.dtype).name)

    @classmethod
    def pack(cls, w, num_shards: int = 1, dtype=np.float32, k_shards: int = 1) -> PackedWeight:
        """From w [K, n]; a numpy w is packed on the host, a jax one (or shapes) by XLA. dtype: float32,
        bfloat16 (w rounded to it; K even), int8 (each column's max |w| -> 127; K a multiple of 4) or "fp8"
        (each column's max |w| -> 448, rounded to float8 e4m3; K even).

        num_shards: w's columns are cut into that many equal blocks, each packed on its own and the
        panels concatenated, so that splitting `data` by panels gives each device its block's
        PackedWeight (whose n, the one this returns, is a block's width). k_shards (int8): w's rows are
        split into that many blocks over devices (tensor parallelism by rows): each block holds whole
        quads of rows."""
        xp = np if isinstance(w, np.ndarray) else jnp
        n = w.shape[1] // num_shards
        packed = _panels(w, num_shards, n, 0, xp)
        if dtype == "fp8":
            packed = packed.astype(xp.float32)
            absmax = xp.max(xp.abs(packed), axis=1)  # [panels, PANEL_WIDTH]
            scale = xp.where(absmax > 0, absmax * np.float32(1 / FP8_MAX), np.float32(1)).astype(xp.float32)
            q = xp.clip(packed / scale[:, None, :], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
            return cls._from_fp8(q, scale.reshape(-1), n, xp)
        if np.dtype(dtype) == np.int8:
            packed = packed.astype(xp.float32)
            absmax = xp.max(xp.abs(packed), axis=1)  # [panels, PANEL_WIDTH]
            # times the reciprocal: XLA turns a division by a constant into that, and host and device must agree
            scale = xp.where(absmax > 0, absmax * np.float32(1 / 127), np.float32(1)).astype(xp.float32)
            q = xp.clip(xp.round(packed / scale[:, None, :]), -127, 127).astype(xp.int8)
            return cls._from_int8(q, scale.reshape(-1), n, k_shards, xp)
        if np.dtype(dtype) == jnp.bfloat16:
            panels, k, _ = packed.shape
            assert k % 2 == 0, f"bfloat16 packing pairs rows: K = {k} is odd"
            pairs = packed.reshape(panels, k // 2, 2, PANEL_WIDTH).transpose(0, 1, 3, 2)
            packed = pairs.reshape(panels, k // 2, 2 * PANEL_WIDTH).astype(jnp.bfloat16)
        return cls(np.ascontiguousarray(packed) if xp is np else packed, n)

    @classmethod
    def from_quantized(cls, w: QuantizedWeight, num_shards: int = 1, dtype=np.int8, k_shards: int = 1) -> PackedWeight:
        """An int8 or fp8 `QuantizedWeight` [K, n] (a quantized checkpoint's) packed as `pack` packs its
        type, its values and column scales taken as they are: no second rounding (fp8's subnormals aside:
        `_fp8_normal`). num_shards, k_shards: as `pack`'s; dtype must be the weight's own type."""
        assert str(dtype) == w.kind == "fp8" or (np.dtype(dtype) == np.int8 and w.kind == "int8"), \
            f"{w.kind} weights packed as {dtype}"
        xp = np if isinstance(w.data, np.ndarray) else jnp
        n = w.shape[1] // num_shards
        scale = _panels(w.scale.astype(xp.float32)[None, :], num_shards, n, 1.0, xp)  # padding columns: scale 1
        if w.kind == "fp8":  # padded through its bits (numpy pads no float8)
            bits = _panels(_fp8_bits(w.data, xp), num_shards, n, 0, xp)
            q = bits.view(jnp.float8_e4m3fn) if xp is np else jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
            return cls._from_fp8(q, scale.reshape(-1), n, xp)
        q = _panels(w.data, num_shards, n, 0, xp)  # [panels, K, PANEL_WIDTH] int8
        return cls._from_int8(q, scale.reshape(-1), n, k_shards, xp)

    @classmethod
    def _from_fp8(cls, q, scale, n: int, xp) -> PackedWeight:
        """From q [panels, K, PANEL_WIDTH] float8_e4m3fn and scale [panels * PANEL_WIDTH]: the pairs of
        `_fp8_normal(q)`, and the scales times 2^FP8_SCALE_SHIFT (exact)."""
        panels, k, _ = q.shape
        assert k % 2 == 0, f"fp8 packing pairs rows: K = {k} is odd"
        pairs = _fp8_normal(q, xp).reshape(panels, k // 2, 2, PANEL_WIDTH).transpose(0, 1, 3, 2)
        pairs = pairs.reshape(panels, k // 2, 2 * PANEL_WIDTH)
        scale = (scale * np.float32(2.0 ** FP8_SCALE_SHIFT)).astype(xp.float32)
        if xp is np:
            pairs, scale = np.ascontiguousarray(pairs), np.ascontiguousarray(scale)
        return cls(pairs, n, scale)

    @classmethod
    def _from_int8(cls, q, scale, n: int, k_shards: int, xp) -> PackedWeight:
        """From q [panels, K, PANEL_WIDTH] int8 and scale [panels * PANEL_WIDTH]: the quads of q + 128."""
        panels, k, _ = q.shape
        assert k % (4 * k_shards) == 0, f"int8 packing takes rows by fours in each of {k_shards} blocks: K = {k}"
        offset = (q.astype(xp.int16) + 128).astype(xp.uint8)
        quads = offset.reshape(panels, k // 4, 4, PANEL_WIDTH).transpose(0, 1, 3, 2).reshape(panels, k // 4, 4 * PANEL_WIDTH)
        if xp is np:
            quads, scale = np.ascontiguousarray(quads), np.ascontiguousarray(scale)
        return cls(quads, n, scale)

    def columns(self, ids):
        """w[:, ids].T, [len(ids), K] float32: an embedding lookup when w is a tied LM head (embed.T)."""
        panels, rows, width = self.data.shape
        if width == PANEL_WIDTH:
            return self.data[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH]
        if self.kind == "fp8":
            pairs = self.data.reshape(panels, rows, PANEL_WIDTH, 2)[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH, :]
            scale = self.scale[ids][:, None] * np.float32(2.0 ** -FP8_SCALE_SHIFT)
            return pairs.reshape(-1, 2 * rows).astype(jnp.float32) * scale
        if self.scale is not None:  # int8, as q + 128
            quads = self.data.reshape(panels, rows, PANEL_WIDTH, 4)[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH, :]
            return (quads.reshape(-1, 4 * rows).astype(jnp.float32) - 128) * self.scale[ids][:, None]
        pairs = self.data.reshape(panels, rows, PANEL_WIDTH, 2)[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH, :]
        return pairs.reshape(-1, 2 * rows).astype(jnp.float32)  # [len(ids), K / 2, 2] -> [len(ids), K]


def int8_group(k: int) -> int:
    """The int8 kernel's activation group over a device's k rows: the first of INT8_GROUPS that divides k,
    else all of k; where the kernels use AMX tiles (`cpu_ffi.amx_available`), the first of AMX_INT8_GROUPS,
    whole tiles of 64 k, before those (576 = 9 x 64: this model's perplexity +1.17% against 96's +0.94%,
    for the tile unit's rate)."""
    groups = AMX_INT8_GROUPS + INT8_GROUPS if cpu_ffi.amx_available() else INT8_GROUPS
    return next((group for group in groups if k % group == 0), k)


# fp8 weights: the largest e4m3 value a column's max |w| maps to, and the power of two the packed column
# scales carry for the kernel: 2^120 (its bfloat16 form of an e4m3 value is the value times 2^-120) over
# 2^64 (it multiplies x by 2^64 first, so that no product falls below float32's normal range).
FP8_MAX = 448.0
FP8_SCALE_SHIFT = 120 - 64


def _fp8_bits(q, xp):
    """float8_e4m3fn q as its uint8 bits."""
    return q.view(np.uint8) if xp is np else jax.lax.bitcast_convert_type(q, jnp.uint8)


def _fp8_normal(q, xp):
    """float8_e4m3fn q with each subnormal (exponent field 0: m * 2^-9, m 1..7) rounded to 0 or +-2^-6, the
    nearest of the two (ties to 0): the kernel widens e4m3 to bfloat16 by moving bits, which would make
    these bfloat16 subnormals, and vdpbf16ps reads those as zero. A change of at most 2^-7 (of the column's
    scale), where e4m3 itself rounds by up to 16 near its largest values."""
    bits = _fp8_bits(q, xp)
    sign, exponent, mantissa = bits & 0x80, bits & 0x78, bits & 0x07
    subnormal = (exponent == 0) & (mantissa != 0)
    rounded = xp.where(mantissa > 4, sign | 0x08, sign).astype(xp.uint8)
    bits = xp.where(subnormal, rounded, bits).astype(xp.uint8)
    return bits.view(jnp.float8_e4m3fn) if xp is np else jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def _panels(a, num_shards: int, n: int, pad_value, xp):
    """a [rows, num_shards * n] -> [num_shards * panels, rows, PANEL_WIDTH]: each shard's n columns in panels,
    padded with pad_value."""
    rows, panels = a.shape[0], -(-n // PANEL_WIDTH)
    blocks = a.reshape(rows, num_shards, n).transpose(1, 0, 2)  # [shards, rows, n]
    padded = xp.pad(blocks, ((0, 0), (0, 0), (0, panels * PANEL_WIDTH - n)), constant_values=pad_value)
    packed = padded.reshape(num_shards, rows, panels, PANEL_WIDTH).transpose(0, 2, 1, 3)
    return packed.reshape(num_shards * panels, rows, PANEL_WIDTH)


def _rows_operand(x, rows):
    return jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32)


def _packed_call(target: str, x, w: PackedWeight, columns: int, rows, *extra, bf16_out: bool = False):
    """The kernel `target` (its _bf16 twin for bfloat16 weights, x rounded to bfloat16; its _int8 twin for
    int8 weights, x quantized in the kernel in groups of int8_group(K); its _fp8 twin for fp8 weights, x
    rounded to bfloat16) -> [M, columns] float32 (bf16_out: bfloat16, from the _bf16_out twin); `extra`
    operands follow rows."""
    assert x.dtype == jnp.float32 or (x.dtype == jnp.bfloat16 and kernel_input_dtype(w) == jnp.bfloat16), \
        "the CPU matmul kernel takes float32 activations (bfloat16 ones for bfloat16 and fp8 weights)"
    out = jax.ShapeDtypeStruct((x.shape[0], columns), jnp.bfloat16 if bf16_out else jnp.float32)
    if w.kind == "fp8":
        suffix = "_fp8_bf16_out" if bf16_out else "_fp8"
        return jax.ffi.ffi_call(f"{target}{suffix}", out)(x.astype(jnp.bfloat16), w.data, w.scale,
                                                          _rows_operand(x, rows), *extra)
    if bf16_out:
        assert w.data.dtype == jnp.bfloat16 and not extra, "a bfloat16 result comes from bfloat16 weights"
        return jax.ffi.ffi_call(f"{target}_bf16_out", out)(x.astype(jnp.bfloat16), w.data, _rows_operand(x, rows))
    if w.scale is not None:
        assert w.data.dtype == jnp.uint8, w.data.dtype
        group = np.int64(int8_group(x.shape[1]))
        return jax.ffi.ffi_call(f"{target}_int8", out)(x, w.data, w.scale, _rows_operand(x, rows), *extra, group=group)
    if w.data.dtype == jnp.bfloat16:
        target, x = f"{target}_bf16", x.astype(jnp.bfloat16)
    else:
        assert w.data.dtype == jnp.float32, w.data.dtype
    return jax.ffi.ffi_call(target, out)(x, w.data, _rows_operand(x, rows), *extra)


def matmul(x, w, rows=None):
    """x [M, K] @ w: the packed kernel for a PackedWeight, XLA's dot for a plain array.

    rows (a traced int32 or None: all): the kernel multiplies only x's first `rows` rows, the real
    tokens of a padded step, and gives zeros below them; XLA's dot computes every row.
    """
    if not isinstance(w, PackedWeight):
        return x @ w
    return _packed_call("jaxserve_packed_matmul", x, w, w.n, rows)


def kernel_input_dtype(w):
    """The dtype `matmul` hands w's kernel its activations in: bfloat16 for bfloat16 and fp8 weights (rounded
    from float32 by XLA before the call, unless they come as bfloat16), else None (float32, or XLA's dot)."""
    return jnp.bfloat16 if isinstance(w, PackedWeight) and w.kind in ("bfloat16", "fp8") else None


def silu_gated_matmul(x, w, rows=None, add=None, out_dtype=None):
    """silu(x @ w_gate) * (x @ w_up) for w = [w_gate | w_up] [K, 2 I]: one kernel call for a PackedWeight
    whose halves are whole panels (I a multiple of PANEL_WIDTH), else matmul and XLA. rows: as for matmul.
    add [M, 2 I] float32 (LoRA's deltas), or None: added to x @ w before the activation (in the kernel for
    float32 and bfloat16 weights). out_dtype: the result's dtype (None: the kernel's float32, or XLA's);
    bfloat16 with bfloat16 weights and no add comes out of the kernel already rounded, the way the next
    bfloat16 matmul takes it (`kernel_input_dtype`), so no convert runs between the two calls."""
    out = None
    if isinstance(w, PackedWeight) and w.n % (2 * PANEL_WIDTH) == 0:
        if add is None:
            bf16_out = out_dtype == jnp.bfloat16 and w.kind in ("bfloat16", "fp8")
            out = _packed_call("jaxserve_packed_gated_matmul", x, w, w.n // 2, rows, bf16_out=bf16_out)
        elif w.scale is None:
            out = _packed_call("jaxserve_packed_gated_matmul_add", x, w, w.n // 2, rows, add.astype(jnp.float32))
    if out is None:
        return gated_activation(matmul(x, w, rows), add, out_dtype)
    return out if out_dtype is None else out.astype(out_dtype)


def gated_activation(gate_up, add=None, out_dtype=None):
    """silu(gate) * up for gate_up = x @ [w_gate | w_up] [M, 2 I] computed by a plain matmul, in XLA; add (LoRA's
    deltas [M, 2 I]) or None: added before the activation. out_dtype: the result's dtype, or None: gate_up's."""
    if add is not None:
        gate_up = gate_up + add.astype(gate_up.dtype)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jax.nn.silu(gate) * up
    return out if out_dtype is None else out.astype(out_dtype)
