"""What the Mosaic GPU (Hopper) paged-attention kernels share: shape rules, tile sizes, and the
decode kernel's in-kernel loop over KV tiles (TMA page copies -> QK^T -> online softmax -> PV on the
tensor cores).

A warpgroup computes `ROWS` = 64 query rows (wgmma's M) against one KV head. Rows are (token, query
head of the GQA group) pairs, token-major, so 64 rows hold 64 // group tokens. K/V are read with TMA
(`copy_gmem_to_smem`) straight from the layer's pages,
`[num_layers, num_pages, page_size, num_kv_heads, head_dim]`, into a ring of `num_stages` SMEM slots
of `kv_tile` keys, so the next tile's copies are in flight while this one is computed. The decode
kernel runs one warpgroup that both copies and computes (`kv_loop`); the ragged kernel runs
`COMPUTE_WARPGROUPS` consumers and a producer (its own module), sized by `choose_prefill_config`.

Interpret mode (JAX's GPU interpreter, see `interpret.py`) runs the same kernel bodies with two
substitutions the 0.10.2 interpreter needs: register-layout casts are dropped (they carry no math),
and QK^T is a jnp dot over the same SMEM tiles, because the interpreter cannot read a wgmma operand
through `transpose_ref`. Everything else -- TMA copies, barriers, masks, softmax, the PV wgmma, and
the ragged kernel's warpgroups (simulated as threads) -- is the code that lowers for CUDA.

Float8 e4m3 pages (kv_cache_dtype "fp8") are copied into the ring as they are, one byte per element,
and upcast in the kernel: each K (then V) tile goes from the ring through registers into one bfloat16
tile (`upcast_tile`), which the wgmma reads. Hopper's fp8 wgmma would need both operands K-major, and
V -- the B operand of PV, [kv_tile, head_dim] in its page layout -- is not; upcasting K and V alike to
the queries' bfloat16 keeps one product for both page dtypes. Bfloat16 pages take none of this.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8 = jnp.dtype(jnp.float8_e4m3fn)
ROWS = 64  # query rows per compute warpgroup: Hopper's wgmma M
COMPUTE_WARPGROUPS = 2  # the ragged kernel's consumers; its producer warpgroup issues the K/V copies
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SMEM_BYTES = 232448 - 4096  # H100/H200 shared memory per thread block, less room for barriers
NEG_INF = -1e30  # finite: a fully masked row gives zeros, never NaN
LOG2E = math.log2(math.e)
_SWIZZLE = 128  # bytes; every wgmma operand row here is >= 128 bytes (head_dim >= 64, bf16)
UPCAST_COLUMNS = 128  # an upcast block is ROWS x this: 64 values a thread, whatever the head dim


class UnsupportedShapeError(ValueError):
    """A model or engine shape the Pallas kernels cannot take, with the reason."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tile sizes of one kernel instance."""

    kv_tile: int  # keys per loop step, the wgmma N of QK^T and K of PV: whole pages (ragged: or part of one)
    num_stages: int  # SMEM ring depth for K/V tiles


def smem_bytes(cfg: KernelConfig, head_dim: int, itemsize: int, decode: bool, kv_itemsize: int | None = None) -> int:
    """The decode kernel's SMEM: Q, the K/V ring (`kv_itemsize` bytes a value), P, and for narrower pages
    the tile they are upcast into."""
    kv_itemsize = kv_itemsize or itemsize
    q = ROWS * head_dim * itemsize
    kv = 2 * cfg.num_stages * cfg.kv_tile * head_dim * kv_itemsize + ROWS * cfg.kv_tile * itemsize  # K, V, P
    kv += cfg.kv_tile * head_dim * itemsize if kv_itemsize < itemsize else 0  # K's, then V's, upcast tile
    out = ROWS * head_dim * 4 + ROWS * 4 if decode else 0  # f32 partial output and lse, after the loop
    return q + max(kv, out)


def prefill_smem_bytes(cfg: KernelConfig, head_dim: int, itemsize: int, kv_itemsize: int | None = None) -> int:
    """The ragged kernel's SMEM: a Q tile and a P tile per compute warpgroup, the K/V ring (`kv_itemsize`
    bytes a value) and, for narrower pages, an upcast tile per compute warpgroup."""
    kv_itemsize = kv_itemsize or itemsize
    q_p = COMPUTE_WARPGROUPS * ROWS * (head_dim + cfg.kv_tile) * itemsize
    kv = 2 * cfg.num_stages * cfg.kv_tile * head_dim * kv_itemsize
    upcast = COMPUTE_WARPGROUPS * cfg.kv_tile * head_dim * itemsize if kv_itemsize < itemsize else 0
    return q_p + kv + upcast


def choose_prefill_config(head_dim: int, page_size: int, kv_itemsize: int = 2) -> KernelConfig:
    """The ragged kernel's tiles: KV tiles of 128 keys, else 64, in the deepest ring (3 or 2 stages) that fits.

    A KV tile may be a slice of one page or span several whole pages (both are powers of two), so
    every page size gets a ring of at least two stages: with a producer warpgroup, one stage would
    leave the copies of tile j + 1 waiting for tile j's PV. Sized for 2-byte Q/P, the GPU's dtype, and
    K/V of `kv_itemsize` bytes (1 for float8 pages, which also need the upcast tiles).
    """
    for kv_tile in (128, 64):
        for num_stages in (3, 2):
            cfg = KernelConfig(kv_tile, num_stages)
            if prefill_smem_bytes(cfg, head_dim, 2, kv_itemsize) <= SMEM_BYTES:
                return cfg
    raise UnsupportedShapeError(f"no two-stage ring of 64-key tiles fits in shared memory for {head_dim=}")


def copies_per_kv_tile(kv_tile: int, page_size: int) -> int:
    """TMA copies that fill one KV tile of K (or V): one per page, or one slice of a larger page."""
    return max(1, kv_tile // page_size)


def gpu_itemsize(kv_dtype) -> int:
    """Bytes a K/V value takes in the tiles' sizing: float8 1, else 2 (float32, interpret only, runs bf16's)."""
    return 1 if jnp.dtype(kv_dtype) == FP8 else 2


def operand_dtype(kv_dtype, q_dtype):
    """The dtype of the wgmma operands (Q, K, V, P): the pages' own, or for float8 pages the queries'
    (bfloat16 on a GPU), which the kernel upcasts each K/V tile to."""
    return jnp.dtype(q_dtype) if jnp.dtype(kv_dtype) == FP8 else jnp.dtype(kv_dtype)


def check_supported(*, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
                    interpret: bool, q_dtype=jnp.bfloat16) -> None:
    """Raises UnsupportedShapeError naming the first shape the kernels cannot take. dtype: the KV pages';
    q_dtype: the queries', which matters only for float8 pages (upcast to it)."""
    dtype = jnp.dtype(dtype)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedShapeError(f"{head_dim=} is not supported by the Pallas kernels (one of {SUPPORTED_HEAD_DIMS})")
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or group > ROWS:
        raise UnsupportedShapeError(f"{num_heads=} per {num_kv_heads=} must be a whole group of at most {ROWS}")
    if page_size % 8 or page_size & (page_size - 1):
        raise UnsupportedShapeError(f"{page_size=} must be a power of two and a multiple of 8 (TMA tile rows)")
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), FP8):
        raise UnsupportedShapeError(
            f"KV dtype {dtype} is not supported (bfloat16, float8_e4m3fn, or float32 in interpret mode)")
    operand = operand_dtype(dtype, q_dtype)
    if operand not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise UnsupportedShapeError(f"float8 KV pages are upcast to the queries' dtype, which must be bfloat16 "
                                    f"(or float32 in interpret mode), not {operand}")
    if operand == jnp.float32 and not interpret:
        what = "float32 KV pages are" if dtype == jnp.float32 else "float8 KV pages read by float32 queries are"
        raise UnsupportedShapeError(
            f"{what} not supported on GPU: Hopper's tf32 wgmma cannot read V in its page layout; "
            "use dtype='bfloat16' (float32 runs only in interpret mode)")
    choose_prefill_config(head_dim, page_size, gpu_itemsize(dtype))
    choose_config(head_dim, page_size, decode=True, kv_itemsize=gpu_itemsize(dtype))


def choose_config(head_dim: int, page_size: int, decode: bool, kv_itemsize: int = 2) -> KernelConfig:
    """A two-stage ring of the largest KV tile that fits in shared memory, else a one-stage ring.

    Sized for 2-byte Q/P, the GPU's dtype, and K/V of `kv_itemsize` bytes (float8: 1, plus the upcast
    tile); float32 in interpret mode runs the same tiles.
    """
    for num_stages in (2, 1):
        for kv_tile in (128, 64, 256):
            if kv_tile < page_size or kv_tile % page_size:
                continue
            cfg = KernelConfig(kv_tile, num_stages)
            if smem_bytes(cfg, head_dim, 2, decode, kv_itemsize) <= SMEM_BYTES:
                return cfg
    raise UnsupportedShapeError(f"no KV tile of whole {page_size=} pages fits in shared memory for {head_dim=}")


def tile_transforms(dtype, row_len: int | None = None):
    """SMEM layout the wgmma operands need: (8 x 128-byte) tiles, 128-byte swizzle. A narrower row
    (`row_len` values: float8 K/V at head_dim 64, 64 bytes) is one tile wide, swizzled at its width."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(_SWIZZLE, row_len * itemsize) if row_len else _SWIZZLE
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def kv_scratch(cfg: KernelConfig, head_dim: int, page_size: int, dtype, kv_dtype=None):
    """SMEM and barriers for the KV loop: K ring, V ring, P tile, one barrier per ring slot each, and for
    K/V in a narrower `kv_dtype` (float8) than the operands' `dtype` the tile they are upcast into."""
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    t = tile_transforms(dtype)
    t_kv = tile_transforms(kv_dtype, head_dim)
    pages_per_kv_tile = cfg.kv_tile // page_size
    scratch = (
        plgpu.SMEM((cfg.num_stages, cfg.kv_tile, head_dim), kv_dtype, transforms=t_kv),  # K
        plgpu.SMEM((cfg.num_stages, cfg.kv_tile, head_dim), kv_dtype, transforms=t_kv),  # V
        plgpu.SMEM((ROWS, cfg.kv_tile), dtype, transforms=t),  # P
        plgpu.Barrier(num_arrivals=pages_per_kv_tile, num_barriers=cfg.num_stages),
        plgpu.Barrier(num_arrivals=pages_per_kv_tile, num_barriers=cfg.num_stages),
    )
    if kv_dtype != jnp.dtype(dtype):
        scratch += (plgpu.SMEM((1, cfg.kv_tile, head_dim), dtype, transforms=t),)  # K's, then V's, upcast tile
    return scratch


def upcast_tile(src, dst) -> None:
    """dst[...] = src[...] widened to dst's dtype ([kv_tile, head_dim] SMEM refs, both tiled and swizzled),
    through registers in blocks of ROWS x UPCAST_COLUMNS (64 values a thread: a compute warpgroup keeps
    its accumulators); then makes the stores visible to the wgmma that reads dst."""
    num_rows, num_cols = dst.shape
    cols = min(num_cols, UPCAST_COLUMNS)
    for r in range(0, num_rows, ROWS):
        for c in range(0, num_cols, cols):
            block = (pl.ds(r, ROWS), pl.ds(c, cols))
            # e4m3 -> f16 is one Hopper instruction; -> bf16 is not before PTX ISA 9.2, so the cast goes
            # e4m3 -> f16 -> f32 -> bf16, every step exact (an e4m3 value has 4 significant bits)
            dst[block] = src[block].astype(jnp.float32).astype(dst.dtype)
    plgpu.commit_smem()


def kv_operand(ring, slot, upcast):
    """(ref, index): ref.at[index] is the wgmma operand [kv_tile, head_dim] of K or V ring slot `slot`, the
    slot itself or, for float8 pages, its bfloat16 copy made here into upcast = (tiles, index). One upcast
    tile serves K, then V: reading QK^T's accumulator waited for the wgmma that read K, and PV's for V."""
    if upcast is None:
        return ring, slot
    tiles, index = upcast
    upcast_tile(ring.at[slot], tiles.at[index])
    return tiles, index


def max_copies_in_flight(cfg: KernelConfig, page_size: int) -> int:
    return 2 * cfg.num_stages * (cfg.kv_tile // page_size) + 1  # K and V pages, plus Q


def layout(x, interpret):
    """Pins a register array to the wgmma layout (a no-op the interpreter cannot evaluate)."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def row_layout(x, interpret):
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def kv_loop(q_smem, k_ref, v_ref, scratch, *, layer, kv_head, page_of, first_kv_tile, num_kv_tiles, mask_of,
            cfg: KernelConfig, page_size: int, scale: float, soft_cap: float, interpret):
    """Online softmax of the Q tile in `q_smem` [ROWS, D] over KV tiles first_kv_tile + [0, num_kv_tiles).

    page_of(kv_tile, i): page id of the KV tile's i-th page. mask_of(key_pos [ROWS, cfg.kv_tile]): which
    (row, key) pairs attend. Returns (acc: tuple of [ROWS, <=128] f32 column chunks, m, l), with m
    and the exponentials in base 2.
    """
    k_smem, v_smem, p_smem, k_bar, v_bar, *upcast = scratch
    upcast = (upcast[0], 0) if upcast else None
    head_dim, dtype = q_smem.shape[1], q_smem.dtype
    tk, stages = cfg.kv_tile, cfg.num_stages
    pages_per_kv_tile = tk // page_size
    chunk = min(head_dim, 128)  # PV in column chunks: fresh accumulators keep register use bounded

    def issue(j, slot):  # the copies of KV tile first_kv_tile + j into ring slot `slot`
        for i in range(pages_per_kv_tile):
            page = page_of(first_kv_tile + j, i)
            rows = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, kv_head, :], k_smem.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, kv_head, :], v_smem.at[slot, rows], v_bar.at[slot])

    for s in range(stages - 1):
        pl.when(s < num_kv_tiles)(lambda s=s: issue(s, s))

    col = layout(lax.broadcasted_iota(jnp.int32, (ROWS, tk), 1), interpret)

    def body(j, carry):
        acc, m, l = carry
        ahead = j + stages - 1
        pl.when(ahead < num_kv_tiles)(lambda: issue(ahead, lax.rem(ahead, stages)))
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        k_tiles, k_index = kv_operand(k_smem, slot, upcast)
        if interpret:
            s = lax.dot_general(q_smem[...], k_tiles.at[k_index][...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        else:
            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tiles.at[k_index], (1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, tk), jnp.float32))
        if soft_cap:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / soft_cap))
        else:
            s = s * (scale * LOG2E)
        mask = mask_of((first_kv_tile + j) * tk + col)
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
        l = l * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()  # P's generic-proxy stores must be visible to the wgmma below
        plgpu.barrier_wait(v_bar.at[slot])
        v_tiles, v_index = kv_operand(v_smem, slot, upcast)
        new_acc = []
        for c, a in enumerate(acc):
            def pv(acc_ref, c=c):
                plgpu.wgmma(acc_ref, p_smem, v_tiles.at[v_index, :, pl.ds(c * chunk, chunk)])
                return acc_ref[...]
            pv_c = pl.run_scoped(pv, plgpu.ACC((ROWS, chunk), jnp.float32))
            new_acc.append(a * lax.broadcast_in_dim(alpha, a.shape, [0]) + pv_c)
        return tuple(new_acc), m_new, l

    init = (
        tuple(layout(jnp.zeros((ROWS, chunk), jnp.float32), interpret) for _ in range(head_dim // chunk)),
        row_layout(jnp.full((ROWS,), NEG_INF, jnp.float32), interpret),
        row_layout(jnp.zeros((ROWS,), jnp.float32), interpret),
    )
    return lax.fori_loop(0, num_kv_tiles, body, init)


def row_iota(interpret, width):
    return layout(lax.broadcasted_iota(jnp.int32, (ROWS, width), 0), interpret)


def cdiv(a, b):
    return (a + b - 1) // b


