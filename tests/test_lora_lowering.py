"""With `enable_lora`, the CUDA-lowered step holds the LoRA deltas' dots, on a CPU machine (issue 39).

The engine's whole step (every prefill and decode bucket) is lowered for CUDA as `check-lowering` does.
Each projection an adapter may target adds two dots to the function every layer calls: x [T, in] @ A
[in, S * r] (every slot's columns at once), then the masked product [T, S * r] @ B [S * r, out]. On a GPU
they run in every step (a branch that skipped them would make the device wait for the host), so the
lowered step has no control flow outside kernels either. That XLA's GPU compiler runs them well is left
to a GPU run.
"""

from __future__ import annotations

import re

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.tools.check_lowering import check_lowering, format_results

TINY_LLAMA = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, intermediate_size=96, rms_norm_eps=1e-5,
                         rope=RopeConfig(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=True)
MAX_LORAS, MAX_LORA_RANK = 3, 8
COLUMNS = MAX_LORAS * MAX_LORA_RANK  # 24: no other dimension of the model is 24
NUM_TARGETS = 7  # q, k, v, o, gate, up, down
LIMITS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32)
DOT_SHAPES = re.compile(r"stablehlo\.dot_general\b[^\n]*?:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)")


def lora_dots(module_text: str) -> tuple[int, int]:
    """(dots x @ A: a right operand of COLUMNS columns, dots u @ B: a left operand of COLUMNS columns and a
    right one of COLUMNS rows) in a lowered module."""
    num_a = num_b = 0
    for lhs, rhs in DOT_SHAPES.findall(module_text):
        lhs_dims, rhs_dims = lhs.split("x")[:-1], rhs.split("x")[:-1]
        num_a += len(rhs_dims) == 2 and rhs_dims[1] == str(COLUMNS)
        num_b += lhs_dims[-1:] == [str(COLUMNS)] and len(rhs_dims) == 2 and rhs_dims[0] == str(COLUMNS)
    return num_a, num_b


def test_the_cuda_step_with_lora_holds_the_lora_dots(tmp_path):
    """Every bucket lowers for CUDA with enable_lora; each module has one x @ A and one u @ B dot per target
    projection, no control flow outside kernels, and the same step without LoRA has none of them."""
    cfg = EngineConfig(**LIMITS, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_LORA_RANK)
    results = check_lowering(TINY_LLAMA, cfg, platform="cuda", dump_dir=tmp_path / "lora")
    assert results and all(r.ok for r in results), format_results(results, "cuda")
    plain = check_lowering(TINY_LLAMA, EngineConfig(**LIMITS), platform="cuda", dump_dir=tmp_path / "plain")
    assert all(r.ok for r in plain), format_results(plain, "cuda")
    for r, p in zip(results, plain):
        text = (tmp_path / "lora" / f"{r.kind}-{r.bucket}.mlir").read_text()
        assert lora_dots(text) == (NUM_TARGETS, NUM_TARGETS), (r.kind, r.bucket, lora_dots(text))
        assert r.control_flow == {}, (r.kind, r.bucket, r.control_flow)
        assert sum(r.dots.values()) == sum(p.dots.values()) + 2 * NUM_TARGETS, (r.kind, r.bucket, r.dots, p.dots)
        assert lora_dots((tmp_path / "plain" / f"{p.kind}-{p.bucket}.mlir").read_text()) == (0, 0)
