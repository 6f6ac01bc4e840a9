"""The C++ LoRA kernel (cpu_kernels/lora_bgmv.cc) against XLA's masked form of the same delta (ops/lora.py):
each token through its own slot, the base model's tokens and the padding zeros, float32 and bfloat16 slots,
ranks held in registers (one, two or four vectors) and any other rank, tiles split over threads; and the
C++ gated matmul that adds the gate and up deltas before its activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.ops import lora
from jaxserve.ops.cpu_ffi import kernel_error
from jaxserve.ops.packed_matmul import PANEL_WIDTH, PackedWeight, matmul, silu_gated_matmul

pytestmark = pytest.mark.skipif(kernel_error() is not None, reason=f"no CPU kernels: {kernel_error()}")


def _case(num_tokens: int, max_loras: int, rank: int, k: int, n: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, k)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((k, max_loras * rank)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((max_loras * rank, n)), dtype)
    slots = jnp.asarray(rng.integers(0, max_loras + 1, num_tokens), jnp.int32)
    return x, a, b, slots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens, max_loras, rank, k, n", [
    (8, 2, 16, 64, 96),  # a decode step: u in one vector (16 lanes) or two (8)
    (5, 3, 8, 48, 40),  # rank 8, columns not a whole vector block
    (300, 4, 32, 128, 72),  # a prompt step: more tiles than threads, several tiles a slot
    (40, 2, 64, 32, 64),  # rank of four vectors (AVX-512) or eight
    (17, 2, 24, 32, 48),  # a rank no vector count fits: the generic loop
])
def test_kernel_equals_the_masked_delta(num_tokens, max_loras, rank, k, n, dtype):
    x, a, b, slots = _case(num_tokens, max_loras, rank, k, n, dtype)
    rows = num_tokens - 3  # the last three tokens are padding
    got = jax.jit(lambda *args: lora.bgmv(*args[:3], lora.TokenSlots(args[3], args[4], rank)))(
        x, a, b, slots, jnp.int32(rows))
    masked_slots = jnp.where(jnp.arange(num_tokens) < rows, slots, 0)
    mask = lora.slot_mask(masked_slots, max_loras, rank, jnp.float32)
    want = lora.delta(x, a.astype(jnp.float32), b.astype(jnp.float32), mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[rows:].any()  # padding
    base = np.asarray(masked_slots) == 0
    assert base.any() and (~base).any(), "the case should mix the base model and adapters"
    assert not np.asarray(got)[base].any()  # the base model's tokens get no delta


def test_model_delta_takes_token_slots_for_the_kernel():
    """ops/lora.delta runs the kernel when handed TokenSlots in place of the mask."""
    x, a, b, slots = _case(6, 2, 16, 32, 32, jnp.float32, seed=1)
    via_delta = lora.delta(x, a, b, lora.TokenSlots(slots, jnp.int32(6), 16))
    want = lora.delta(x, a, b, lora.slot_mask(slots, 2, 16, jnp.float32))
    np.testing.assert_allclose(np.asarray(via_delta), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("m", [3, 9, 40])
def test_gated_matmul_adds_the_deltas_before_the_activation(m, dtype):
    """silu(x @ w_gate + d_gate) * (x @ w_up + d_up): in the C++ gated kernel for float32 and bfloat16
    weights (its _add form), through XLA for int8; rows past `rows` (padding) stay zeros."""
    rng = np.random.default_rng(m)
    k, inter = 64, 2 * PANEL_WIDTH
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, 2 * inter), np.float32) / 8
    add = rng.standard_normal((m, 2 * inter), np.float32)
    packed = jax.device_put(PackedWeight.pack(w, dtype=dtype))
    rows = m - 1
    got = np.asarray(jax.jit(silu_gated_matmul)(jnp.asarray(x), packed, jnp.int32(rows), jnp.asarray(add)))
    plain = np.asarray(jax.jit(matmul)(jnp.asarray(x), packed, jnp.int32(rows)))  # the kernel's own x @ w
    gate, up = np.split(plain.astype(np.float64) + add, 2, axis=-1)
    want = gate / (1.0 + np.exp(-gate)) * up
    np.testing.assert_allclose(got[:rows], want[:rows], rtol=1e-4, atol=1e-4)
    if dtype != "int8":  # the kernel zeroes padding rows; XLA's add leaves silu(d_gate) * d_up there
        assert not got[rows:].any()
