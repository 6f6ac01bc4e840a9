"""Under `quantization`, the CUDA-lowered step takes 8-bit weights into its dots, on a CPU machine.

The engine's whole step (prefill and decode buckets) is lowered for CUDA as `check-lowering` does, with
the weights as XLA's `QuantizedWeight`s: every weight matmul must be a dot_general of float8_e4m3fn
operands (fp8: XLA's cuBLASLt fp8 GEMM on a Hopper GPU) or of int8 operands summed in int32 (int8), and
no weight matrix may be converted whole to bfloat16 or float32 before a dot (what a dequantize-then-dot
path would lower to, a full-size copy of every weight on every step). What a GPU alone can show, that
XLA's GPU compiler picks the 8-bit GEMM for these dots, is left to a GPU run.
"""

from __future__ import annotations

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.tools.check_lowering import check_lowering, dot_types, format_results, widened_matrices

TINY_LLAMA = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, intermediate_size=128, rms_norm_eps=1e-5,
                         rope=RopeConfig(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=True)
# w_qkv, wo, w_gate_up, w_down in the one function every layer calls (forward's jitted `_layer`), then
# the LM head (int8 only: fp8 keeps it in the model's dtype, as vLLM does): dots as written in the module
NUM_WEIGHT_DOTS = {"int8": 4 + 1, "fp8": 4}
EXPECTED_DOT = {"fp8": "f8E4M3FN x f8E4M3FN -> f32", "int8": "i8 x i8 -> i32"}
FLOAT_DOT = {"bfloat16": "bf16 x bf16 -> f32", "float32": "f32 x f32 -> f32"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_the_cuda_step_takes_8_bit_operands_into_its_dots(quantization, dtype):
    """Every bucket lowers for CUDA; each has one 8-bit dot per weight matrix (and the LM head under int8),
    of the expected operand and accumulator types, and widens no 8-bit matrix; fp8's LM head is a dot in
    the model's dtype."""
    cfg = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32,
                       quantization=quantization, dtype=dtype)
    results = check_lowering(TINY_LLAMA, cfg, platform="cuda")
    assert results and all(r.ok for r in results), format_results(results, "cuda")
    for r in results:
        assert r.dots.get(EXPECTED_DOT[quantization]) == NUM_WEIGHT_DOTS[quantization], (r.kind, r.bucket, r.dots)
        assert not [key for key in r.dots if key != EXPECTED_DOT[quantization] and "8" in key.split(" x ")[0]]
        assert r.widened == [], (r.kind, r.bucket, r.widened)
        if quantization == "fp8":
            assert r.dots.get(FLOAT_DOT[dtype], 0) >= 1, (r.kind, r.bucket, r.dots)
    expected = f"8-bit dots: {NUM_WEIGHT_DOTS[quantization]}, 8-bit matrices widened: 0"
    assert expected in format_results(results, "cuda")


def test_a_checkpoints_quantization_lowers_without_the_flag():
    """A model whose checkpoint declares fp8 (ModelConfig.quantization) lowers with fp8 dots unasked."""
    model = ModelConfig(**{**TINY_LLAMA.__dict__, "quantization": "fp8"})
    results = check_lowering(model, EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                                 num_kv_pages=32), platform="cuda")
    assert all(r.ok and r.dots.get(EXPECTED_DOT["fp8"]) == NUM_WEIGHT_DOTS["fp8"] and not r.widened for r in results)


def test_unquantized_steps_have_no_8_bit_dots():
    """The counts tell: without quantization the weight dots are bfloat16 ones."""
    results = check_lowering(TINY_LLAMA, EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                                                      num_kv_pages=32), platform="cuda")
    assert all(r.ok and not any(key.startswith(("i8", "f8")) for key in r.dots) for r in results)
    assert all(r.dots.get("bf16 x bf16 -> f32", 0) + r.dots.get("bf16 x bf16 -> bf16", 0) >= NUM_WEIGHT_DOTS["int8"]
               for r in results), [r.dots for r in results]


def test_the_scanners_read_stablehlo():
    """dot_types and widened_matrices on hand-written ops: a dequantized weight is caught, a quantized
    activation (narrowed) and 8-bit KV pages (rank 5) are not."""
    text = "\n".join([
        "%0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x64xi8>, tensor<64x32xi8>)"
        " -> tensor<4x32xi32>",
        "%1 = stablehlo.convert %w : (tensor<64x32xf8E4M3FN>) -> tensor<64x32xbf16>",
        "%2 = stablehlo.convert %x : (tensor<4x64xf32>) -> tensor<4x64xf8E4M3FN>",
        "%3 = stablehlo.convert %p : (tensor<2x8x16x2x64xf8E4M3FN>) -> tensor<2x8x16x2x64xbf16>",
    ])
    assert dot_types(text) == {"i8 x i8 -> i32": 1}
    assert widened_matrices(text) == ["64x32 f8E4M3FN -> bf16"]
