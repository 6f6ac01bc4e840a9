"""XLA's 8-bit weights (`ops/quantized.py`), and the engine serving them.

QuantizedWeight.matmul is W8A8: x quantized per row, w per column, the 8-bit product summed in int32
(int8) or float32 (fp8), then scaled. Its reference here is numpy: the same quantization written out
(ml_dtypes' float8_e4m3fn rounds as XLA's convert does) and an exact float64 product. Then the engine:
quantization "int8" and "fp8" under matmul_backend "xla" on a CPU serve QuantizedWeights, give the float
model's greedy tokens on a tiny model and compile nothing after warm-up; at tensor parallelism 2 (forced
CPU devices) both the C++ matmul's packed int8 and XLA's QuantizedWeight give the one-device tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.ops.packed_matmul import PackedWeight
from jaxserve.ops.quantized import KINDS, QuantizedWeight, matmul

LARGEST = {"int8": 127.0, "fp8": 448.0}


def reference_matmul(x: np.ndarray, w: np.ndarray, kind: str) -> np.ndarray:
    """numpy's W8A8: x per row and w per column to `kind`, the product exact (float64), then the scales."""
    def quantize(a, axis):
        absmax = np.abs(a).max(axis=axis, keepdims=True)
        scale = np.where(absmax > 0, absmax / LARGEST[kind], 1.0).astype(np.float32)
        q = np.clip(a / scale, -LARGEST[kind], LARGEST[kind])
        q = np.round(q) if kind == "int8" else q.astype(ml_dtypes.float8_e4m3fn)
        return q.astype(np.float64), scale.astype(np.float64)

    xq, x_scale = quantize(x.astype(np.float32), axis=1)
    wq, w_scale = quantize(w.astype(np.float32), axis=0)
    return (xq @ wq) * x_scale * w_scale


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (7, 256, 96), (33, 128, 320)])
def test_matmul_is_numpys_w8a8(kind, m, k, n):
    """The product of the quantized operands to float32's rounding, and the float product within the
    quantization error; one column of zeros (scale 1) stays zero."""
    rng = np.random.default_rng(m * k + n)
    x = rng.normal(size=(m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32)
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), QuantizedWeight.quantize(jnp.asarray(w), kind)))
    want = reference_matmul(x, w, kind)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert not got[:, 3].any()
    exact = x.astype(np.float64) @ w
    error = np.sqrt(np.mean((got - exact) ** 2)) / exact.std()
    assert error < (0.02 if kind == "int8" else 0.06), error


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_dequantize_and_layout(kind):
    """Per-column scales (max |w| -> the type's largest), numpy in numpy out, a layer of a stacked weight
    by index, and concatenate's shard-by-shard layout with each column's scale beside it."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 16, 8)).astype(np.float32)  # [layers, K, N]
    q = QuantizedWeight.quantize(w, kind)
    assert isinstance(q.data, np.ndarray) and q.data.dtype == KINDS[kind][0] and q.scale.shape == (3, 8)
    np.testing.assert_allclose(np.abs(q.data.astype(np.float32)).max(axis=1), LARGEST[kind])
    step = 1 / 127 if kind == "int8" else 1 / 16  # e4m3 keeps 3 mantissa bits
    assert np.abs(q.dequantize(np.float32) - w).max() <= step * np.abs(w).max()
    np.testing.assert_array_equal(q[1].data, q.data[1])
    a, b = QuantizedWeight(q.data[0, :, :4], q.scale[0, :4]), QuantizedWeight(q.data[0, :, 4:], q.scale[0, 4:])
    fused = QuantizedWeight.concatenate([a, b], num_shards=2)  # [a0 | b0 | a1 | b1], each 2 columns
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    np.testing.assert_array_equal(fused.data, q.data[0][:, order])
    np.testing.assert_array_equal(fused.scale, q.scale[0][order])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_matmul_answers_in_the_activations_dtype(kind):
    """bfloat16 in, bfloat16 out (as x @ w): a float32 result would make a bfloat16 model's residual
    stream float32 from its first layer on, and compile every later layer a second time."""
    x = jnp.ones((2, 32), jnp.bfloat16)
    w = QuantizedWeight.quantize(jnp.full((32, 4), 0.5), kind)
    assert matmul(x, w).dtype == jnp.bfloat16
    assert matmul(x.astype(jnp.float32), w).dtype == jnp.float32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized_xla")
    tiny_models.make_tiny_model("llama", path, attention_std=0.1, embedding_std=1.0)
    return path


SETTINGS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_pages=16,
                forbid_compilation_after_warmup=True)
PROMPTS = [{"prompt_token_ids": list(b"The quick brown fox")}, {"prompt_token_ids": list(b"Once upon a time, ")}]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _tokens(llm) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def float_tokens(model_path):
    return _tokens(LLM(str(model_path), **SETTINGS))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_engine_serves_quantized_weights_through_xla(model_path, float_tokens, kind):
    """quantization int8 / fp8 under matmul_backend "xla" on a CPU: the runner holds QuantizedWeights (the
    LM head too under int8), gives the float model's greedy tokens, and compiles nothing after warm-up (the settings
    forbid it: a compile would raise)."""
    llm = LLM(str(model_path), quantization=kind, matmul_backend="xla", **SETTINGS)
    runner = llm.engine.runner
    assert runner.resolved.quantization == kind and runner.resolved.packed_dtype is None
    layer = runner.params["layers"][0]
    assert all(isinstance(layer[name], QuantizedWeight) and layer[name].kind == kind
               for name in ("w_qkv", "wo", "w_gate_up", "w_down"))
    if kind == "int8":
        assert isinstance(runner.params["lm_head"], QuantizedWeight)
    else:  # fp8 keeps the LM head in the model's dtype (tied here: the embeddings), as vLLM does
        assert "lm_head" not in runner.params and not isinstance(runner.params["embed"], QuantizedWeight)
    assert _tokens(llm) == float_tokens
    assert llm.engine.num_compilations_since_warmup == 0


@pytest.mark.parametrize("matmul_backend", ["auto", "xla"])
def test_tensor_parallel_2_gives_the_one_device_tokens(model_path, matmul_backend):
    """int8 split over 2 forced CPU devices, as the C++ matmul's packed int8 (auto) and as XLA's
    QuantizedWeight: the scales split with their columns, the row-split matrices' activations quantized in
    groups of each device's block of K, and the tokens are the one-device engine's."""
    settings = dict(SETTINGS, quantization="int8", matmul_backend=matmul_backend)
    one = LLM(str(model_path), **settings)
    two = LLM(str(model_path), tensor_parallel_size=2, **settings)
    expected = PackedWeight if matmul_backend == "auto" else QuantizedWeight
    assert isinstance(two.engine.runner.params["layers"][0]["w_down"], expected)
    assert _tokens(two) == _tokens(one)
    assert two.engine.num_compilations_since_warmup == 0
