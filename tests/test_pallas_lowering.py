"""The Pallas kernels, and whole engine step functions that use them, lower for CUDA on a CPU machine.

`jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))` runs Mosaic GPU's compiler down to
NVVM, so layout, tiling, shared-memory and wgmma operand errors surface here without a GPU; each
lowered kernel is opened to check that it got tensor-core (wgmma) and TMA instructions. What stays
unproven without a GPU: PTX assembly, loading and running (see docs/kernels.md).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from jaxserve.ops.attention_backends import resolve_attention_backend
from jaxserve.tools.check_lowering import check_lowering, format_results
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.config.engine_config import EngineConfig
from pallas_kernels.common import COMPUTE_WARPGROUPS
from pallas_kernels.lowering import misaligned_views, mosaic_kernels

PAGE_SIZES = (8, 16, 32, 64, 128, 256)
GROUPS = (1, 3, 4, 8)
SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5,
                      rope=RopeConfig(theta=100000.0), max_position_embeddings=8192, tie_word_embeddings=True)
TINY_LLAMA = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, intermediate_size=128, rms_norm_eps=1e-5,
                         rope=RopeConfig(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=True)
TINY_GEMMA3 = ModelConfig(  # head_dim 256, GQA 8, soft-cap, sliding-window layers, q/k norms
    architecture="gemma3", vocab_size=320, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=1, head_dim=256,
    intermediate_size=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6), local_rope=RopeConfig(theta=1e4),
    max_position_embeddings=512, tie_word_embeddings=True, qk_norm=True, sandwich_norm=True, hidden_act="gelu_tanh",
    attn_logit_softcap=50.0, sliding_window=32, sliding_layers=(True, False))


def selectable_configs():
    """Every (head_dim, page_size) the engine can select for a GPU (bf16), per check_supported."""
    configs = []
    for head_dim, page_size in itertools.product(pk.SUPPORTED_HEAD_DIMS, PAGE_SIZES):
        try:
            pk.check_supported(num_heads=2, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                               dtype=jnp.bfloat16, interpret=False)
        except pk.UnsupportedShapeError:
            continue
        configs.append((head_dim, page_size))
    return configs


def lower_kernel(kernel, head_dim, page_size, group, soft_cap, num_kv_heads=2, num_tokens=32, num_seqs=8,
                 kv_dtype=jnp.bfloat16):
    dt, i32 = jnp.bfloat16, (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    pages = jax.ShapeDtypeStruct((2, 64, page_size, num_kv_heads, head_dim), kv_dtype)
    args = (jax.ShapeDtypeStruct((num_tokens, group * num_kv_heads, head_dim), dt), pages, pages, i32(),
            i32(num_seqs + 1), i32(num_seqs), i32(num_seqs, 16))
    fn = functools.partial(kernel, scale=head_dim**-0.5, soft_cap=soft_cap)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_the_selectable_configs_are_the_expected_ones():
    """Page sizes 8..256 with head dims 64/128/256; only (256, 256) has no KV tile that fits in SMEM."""
    expected = set(itertools.product(pk.SUPPORTED_HEAD_DIMS, PAGE_SIZES)) - {(256, 256)}
    assert set(selectable_configs()) == expected


def assert_launch_shape(lowered_kernel):
    """The ragged kernel launches three warpgroups (two consumers, one producer that gives its registers
    up with setmaxnreg); the decode kernel one. Both within an H100's shared memory per block."""
    if lowered_kernel.name == "ragged_paged_attention":
        assert lowered_kernel.warpgroups == COMPUTE_WARPGROUPS + 1, lowered_kernel
        assert "setmaxregister" in lowered_kernel.instructions, lowered_kernel
    else:
        assert lowered_kernel.warpgroups == 1, lowered_kernel
    assert 0 < lowered_kernel.smem_bytes <= 232448, lowered_kernel


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kernel", [pk.ragged_paged_attention, pk.decode_attention], ids=["ragged", "decode"])
def test_every_selectable_kernel_config_lowers_for_cuda(kernel, kv_dtype):
    """Each (head_dim, page_size) the engine can select lowers to a Mosaic GPU kernel using wgmma and TMA,
    launched as the kernel's structure says (the ragged kernel: warp-specialized, 384 threads; its old
    single-warpgroup form launched 128 and fails here); GQA ratios 1, 3, 4, 8 and soft-cap on/off rotate
    through the configs (neither changes block sizes). With float8 pages (bfloat16 queries) each also
    upcasts its K/V tiles with Hopper's e4m3 conversion and stays within shared memory; with bfloat16
    pages none does (that path does no extra work)."""
    failures = []
    for i, (head_dim, page_size) in enumerate(selectable_configs()):
        group, soft_cap = GROUPS[i % len(GROUPS)], (0.0, 30.0)[i % 2]
        try:
            (lowered_kernel,) = mosaic_kernels(lower_kernel(kernel, head_dim, page_size, group, soft_cap,
                                                            kv_dtype=kv_dtype))
            assert lowered_kernel.uses_wgmma and lowered_kernel.uses_tma, lowered_kernel
            assert lowered_kernel.upcasts_fp8 == (kv_dtype == jnp.float8_e4m3fn), lowered_kernel
            assert_launch_shape(lowered_kernel)
        except Exception as e:  # noqa: BLE001 - collect them all: one run names every failing config
            failures.append(f"{head_dim=} {page_size=} {group=} {soft_cap=}: {type(e).__name__}: {e}"[:300])
    assert not failures, "\n".join(failures)


def test_float32_does_not_lower_and_says_why(monkeypatch):
    """float32 K/V would need a transposed tf32 wgmma, which Hopper lacks: check_supported refuses it
    up front, and the lowering itself fails (so the refusal is not overcautious)."""
    with pytest.raises(pk.UnsupportedShapeError, match="float32"):
        pk.check_supported(num_heads=2, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32,
                           interpret=False)
    from pallas_kernels import common

    monkeypatch.setattr(common, "check_supported", lambda **kw: None)
    # tiles sized for 2-byte K/V would overflow shared memory at 4 bytes first; halve them
    monkeypatch.setattr(common, "choose_prefill_config", lambda *a: common.KernelConfig(kv_tile=64, num_stages=2))
    pages = jax.ShapeDtypeStruct((2, 8, 16, 2, 64), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    fn = functools.partial(pk.ragged_paged_attention, scale=0.125)
    with pytest.raises(ValueError, match="transposes"):
        jax.jit(fn).trace(jax.ShapeDtypeStruct((8, 2, 64), jnp.float32), pages, pages, i32(), i32(3), i32(2),
                          i32(2, 4)).lower(lowering_platforms=("cuda",))


def _assert_all_lowered_with_kernels(results, backend="pallas", layer_kinds=1):
    """layer_kinds: distinct layer functions (global and sliding-window layers lower separately; the
    layers of one kind share one lowered body, so its kernel appears once)."""
    table = format_results(results, "cuda")
    assert all(r.ok for r in results), table
    for r in results:
        assert r.attention_backend == backend, table
        expected = "paged_decode_attention" if r.kind == "decode" else "ragged_paged_attention"
        assert [k.name for k in r.kernels] == [expected] * layer_kinds, table
        assert all(k.uses_wgmma and k.uses_tma for k in r.kernels), table
        for k in r.kernels:
            assert_launch_shape(k)
        assert r.control_flow == {}, f"a CUDA step must not wait on the host for a branch:\n{table}"
        assert r.misaligned == [], f"a Mosaic GPU call refuses inputs not aligned to 256 bytes:\n{table}"


@pytest.mark.parametrize("kernel", [pk.ragged_paged_attention, pk.decode_attention], ids=["ragged", "decode"])
def test_a_kernel_input_sliced_from_a_row_is_found_and_a_column_is_not(kernel):
    """XLA:GPU passes a contiguous slice to a custom call as an address inside its source, and the
    Mosaic GPU call refuses one not aligned to 256 bytes (kv_lens, a row of the step's packed [5, S + 1]
    int32 array, at byte offset 4 (S + 1): an H200 run of 8742fc2). misaligned_views finds it through
    the kernel wrapper; a column of [S + 1, 5] (the layout since) is strided, so XLA copies it."""
    num_seqs, pages = 4, jax.ShapeDtypeStruct((2, 16, 16, 2, 64), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((16, 4, 64), jnp.bfloat16)
    tables = jnp.zeros((num_seqs, 4), jnp.int32)

    def rows(q, k, v, seqs):  # kv_lens through jnp.where in the decode wrapper: a fresh buffer
        return kernel(q, k, v, 0, seqs[0, :num_seqs + 1], seqs[1, :num_seqs], tables, scale=0.125)

    def columns(q, k, v, seqs):
        return kernel(q, k, v, 0, seqs[:, 0], seqs[:num_seqs, 1], tables, scale=0.125)

    def lower(fn, shape):
        return jax.jit(fn).trace(q, pages, pages, jax.ShapeDtypeStruct(shape, jnp.int32)).lower(
            lowering_platforms=("cuda",))

    found = misaligned_views(lower(rows, (5, num_seqs + 1)))
    if kernel is pk.ragged_paged_attention:
        assert found == ["input 1: a contiguous slice at byte offset 20 of tensor<5x5xi32>"]
    else:
        assert found == []
    assert misaligned_views(lower(columns, (num_seqs + 1, 5))) == []
    # a contiguous slice at an aligned offset is passed as a view and is fine: row 1 of [5, 64]
    assert misaligned_views(lower(rows, (5, 64))) == []


def test_tiny_model_step_functions_lower_for_cuda():
    """The engine's whole jitted prefill and decode steps (forward, Pallas attention, sampler) of a tiny
    llama lower for CUDA in every bucket, with one kernel per step in the layer loop."""
    engine = EngineConfig(dtype="bfloat16", attention_backend="pallas", max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=32, num_kv_pages=32)
    _assert_all_lowered_with_kernels(check_lowering(TINY_LLAMA, engine, platform="cuda"))


def test_tiny_model_step_functions_lower_for_cuda_with_fp8_pages():
    """kv_cache_dtype fp8 with the Pallas backend: every prefill and decode step of a tiny llama lowers
    for CUDA with the kernels reading the float8 pages (each upcasts its K/V tiles)."""
    engine = EngineConfig(dtype="bfloat16", attention_backend="pallas", kv_cache_dtype="fp8", max_model_len=256,
                          max_num_seqs=4, max_num_batched_tokens=32, num_kv_pages=32)
    results = check_lowering(TINY_LLAMA, engine, platform="cuda")
    _assert_all_lowered_with_kernels(results)
    assert all(k.upcasts_fp8 for r in results for k in r.kernels), format_results(results, "cuda")


def test_gemma3_shapes_lower_for_cuda():
    """head_dim 256, eight query heads per KV head, soft-cap and per-layer sliding windows (a traced
    scalar) in a whole step function: the most demanding selectable kernel configuration."""
    engine = EngineConfig(dtype="bfloat16", attention_backend="pallas", max_model_len=256, max_num_seqs=2,
                          max_num_batched_tokens=16, num_kv_pages=32, block_size=32)
    assert len(set(TINY_GEMMA3.layer_is_sliding)) == 2
    _assert_all_lowered_with_kernels(check_lowering(TINY_GEMMA3, engine, platform="cuda"), layer_kinds=2)


def test_default_model_step_functions_lower_for_cuda():
    """SmolLM2-135M's shapes (30 layers, 9 heads over 3 KV heads, head_dim 64, vocab 49152), params as
    ShapeDtypeStructs, a GPU's default buckets: every prefill and decode step lowers for CUDA."""
    engine = EngineConfig(dtype="bfloat16", attention_backend="pallas", num_kv_pages=256)
    results = check_lowering(SMOLLM2, engine, platform="cuda")
    assert len(results) == 16  # prefill 16..2048, decode 1..128
    _assert_all_lowered_with_kernels(results)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_step_functions_lower_for_cuda(tp):
    """Split over a mesh (of this machine's CPU devices, lowered for CUDA): each device's share runs the
    Pallas kernels under shard_map (tp 4 replicates the two KV heads), with the layer's all-reduces."""
    engine = EngineConfig(dtype="bfloat16", attention_backend="pallas", max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=32, num_kv_pages=32, tensor_parallel_size=tp)
    results = check_lowering(TINY_LLAMA, engine, platform="cuda")
    _assert_all_lowered_with_kernels(results)
    assert all(r.custom_calls for r in results)


def test_auto_picks_pallas_for_a_gpu_only_when_the_model_fits(caplog):
    """auto resolves to pallas for a bf16 model the kernels take, and to xla -- with the reason logged --
    for float32 or an unsupported head dim; on CPU it is always xla. Bad settings are refused by name."""
    bf16 = EngineConfig(dtype="bfloat16")
    assert resolve_attention_backend("auto", SMOLLM2, bf16, platform="gpu") == "pallas"
    assert resolve_attention_backend("auto", SMOLLM2, bf16, platform="cpu") == "xla"
    with caplog.at_level(logging.WARNING, logger="jaxserve.ops.attention_backends"):
        assert resolve_attention_backend("auto", SMOLLM2, EngineConfig(dtype="float32"), platform="gpu") == "xla"
        odd = ModelConfig(**{**TINY_LLAMA.__dict__, "head_dim": 16})
        assert resolve_attention_backend("auto", odd, bf16, platform="gpu") == "xla"
    assert "float32" in caplog.text and "head_dim=16" in caplog.text
    with pytest.raises(ValueError, match="float32"):
        resolve_attention_backend("pallas", SMOLLM2, EngineConfig(dtype="float32"), platform="gpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_attention_backend("pallas", SMOLLM2, bf16, platform="cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="triton")
    with pytest.raises(ValueError, match="forbid_compilation_after_warmup"):
        EngineConfig(attention_backend="pallas-interpret", forbid_compilation_after_warmup=True)


def test_a_bucket_that_fails_to_lower_is_reported_not_raised(monkeypatch):
    """check_lowering keeps going past a failing bucket and names the error in its row and summary."""
    from jaxserve.runner.model_runner import ModelRunner

    real_lower = ModelRunner.lower

    def lower(self, kind, bucket, platforms=None):
        if kind == "decode" and bucket == 2:
            raise RuntimeError("injected failure")
        return real_lower(self, kind, bucket, platforms)

    monkeypatch.setattr(ModelRunner, "lower", lower)
    engine = EngineConfig(dtype="bfloat16", attention_backend="xla", max_model_len=64, max_num_seqs=2,
                          max_num_batched_tokens=16, num_kv_pages=8)
    results = check_lowering(TINY_LLAMA, engine, platform="cuda")
    table = format_results(results, "cuda")
    assert [r.ok for r in results] == [True, True, False], table
    assert "RuntimeError: injected failure" in table and "2 of 3 step functions lowered" in table


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the script's behaviour on a machine without a GPU")
def test_kernel_benchmark_without_a_gpu_says_so_and_exits_0(capsys, monkeypatch):
    """benchmarks/bench_kernels.py on a machine without a GPU prints why it measures nothing and returns 0;
    its smoke run (the kernels interpreted on two tiny cases) goes through the same parity check and table."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up there
    spec.loader.exec_module(bench)
    assert bench.main([]) == 0
    assert "no GPU here" in capsys.readouterr().out
    assert bench.main(["--smoke", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    assert "| decode 3x1 ctx 40 H4/2 D64 |" in table and "| prefill 2x20 ctx 50 H4/2 D64 |" in table
    assert "kernel output off its reference" not in table


def test_a_cpu_step_keeps_its_branches_and_dump_writes_every_module(tmp_path):
    """The control-flow count can fail: lowered for the CPU the sampler keeps its lax.conds (cheaper
    there), which the count sees; --dump writes each bucket's module, the same text that was counted."""
    engine = EngineConfig(dtype="float32", attention_backend="xla", matmul_backend="xla", max_model_len=64,
                          max_num_seqs=2, max_num_batched_tokens=16, num_kv_pages=16)
    results = check_lowering(TINY_LLAMA, engine, platform="cpu", dump_dir=tmp_path)
    assert all(r.ok for r in results), format_results(results, "cpu")
    assert all(r.control_flow.get("stablehlo.case", 0) >= 4 for r in results), format_results(results, "cpu")
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == sorted(f"{r.kind}-{r.bucket}.mlir" for r in results)
    text = (tmp_path / written[0]).read_text()
    assert "stablehlo.case" in text and "control flow outside kernels: stablehlo.case" in format_results(results, "cpu")



@pytest.mark.parametrize("platform, dtype, highest", [("cuda", "float32", True), ("cuda", "bfloat16", False),
                                                      ("cpu", "float32", False)])
def test_float32_on_a_gpu_lowers_its_dots_at_full_precision(tmp_path, platform, dtype, highest):
    """A GPU's default float32 dot is TF32: float32 steps lowered for CUDA ask for HIGHEST on every dot
    (on an H100, TF32 changed greedy tokens against HF torch's float32); bfloat16 and the CPU's modules
    are left as they were."""
    engine = EngineConfig(dtype=dtype, attention_backend="xla", matmul_backend="xla", max_model_len=64,
                          max_num_seqs=2, max_num_batched_tokens=16, num_kv_pages=16)
    results = check_lowering(TINY_LLAMA, engine, platform=platform, dump_dir=tmp_path)
    assert all(r.ok for r in results), format_results(results, platform)
    for module in tmp_path.iterdir():
        dots = [line for line in module.read_text().splitlines() if "stablehlo.dot_general" in line]
        assert dots, module.name
        assert all(("precision = [HIGHEST, HIGHEST]" in line) == highest for line in dots), (module.name, dots[0][:300])
