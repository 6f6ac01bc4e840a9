"""Settings left unset are chosen per device (`device_defaults.py`): a CPU keeps the engine's defaults of
before, a GPU gets bfloat16, the measured batch limits and a KV pool sized from its memory; a setting the
user gave always wins, and one that cannot work is refused by name. No GPU needed: the GPUs are described."""

from __future__ import annotations

import dataclasses
import os

import pytest

from jaxserve import SamplingParams

from jaxserve.config import device_defaults
from jaxserve.cli import build_parser
from jaxserve.config.model_config import ModelConfig, RopeConfig
from jaxserve.config.device_defaults import DeviceInfo, MemoryUse, num_pool_pages, resolve
from jaxserve.core.engine import LLMEngine
from jaxserve.config.engine_config import EngineConfig, engine_config_from_args
from jaxserve.config.buckets import decode_buckets, prefill_buckets

GiB = 2**30
CPU = DeviceInfo("cpu", "cpu")
H100 = DeviceInfo("gpu", "NVIDIA H100 80GB HBM3", 80 * GiB)
# Llama-3-8B's shape: 128 KiB of bfloat16 K/V per token
LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                        rope=RopeConfig(theta=500000.0), max_position_embeddings=8192, tie_word_embeddings=False)
MEASURED = MemoryUse(weight_bytes=15 * GiB, step_bytes=2 * GiB)


def test_a_cpu_gets_exactly_the_defaults_of_before():
    """The CPU numbers must not move: float32, 512 MiB of KV pages, 32 sequences, 512-token steps,
    max_model_len the model's context up to 2048, and the bucket ladders those give. (512 MiB of an 8B
    model's float32 K/V is 128 pages of 16 tokens, the dummy page 0 among them: 2032 tokens.)"""
    for context, max_model_len in ((8192, 2032), (128, 128)):
        model_cfg = dataclasses.replace(LLAMA3_8B, max_position_embeddings=context)
        cfg, chosen = resolve(EngineConfig(), model_cfg, CPU)
        assert (cfg.dtype, cfg.max_num_seqs, cfg.max_num_batched_tokens) == ("float32", 32, 512)
        assert (cfg.kv_cache_memory_bytes, cfg.num_kv_pages, cfg.max_model_len) == (512 * 2**20, None, max_model_len)
        assert prefill_buckets(cfg) == [16, 32, 64, 128, 256, 512]
        assert decode_buckets(cfg) == [1, 2, 4, 8, 16, 32]
        assert chosen[:3] == ("dtype float32", "max_num_seqs 32", "max_num_batched_tokens 512")
    # A CPU's memory is never asked for: what a device reports does not move its numbers
    with_memory = dataclasses.replace(CPU, memory_bytes=GiB)
    assert resolve(EngineConfig(), LLAMA3_8B, with_memory) == resolve(EngineConfig(), LLAMA3_8B, CPU)


def test_a_gpu_gets_bfloat16_the_measured_limits_and_the_memory_the_weights_leave():
    cfg, chosen = resolve(EngineConfig(), LLAMA3_8B, H100)
    assert (cfg.dtype, cfg.max_num_seqs, cfg.max_num_batched_tokens) == ("bfloat16", 128, 2048)
    assert prefill_buckets(cfg)[-1] == 2048 and decode_buckets(cfg)[-1] == 128
    # Not sized until the runner has measured: the pool unsized, max_model_len the most it may become
    assert cfg.kv_cache_memory_bytes is None and cfg.max_model_len == 8192
    assert not any(c.startswith(("KV cache", "max_model_len")) for c in chosen)

    cfg, chosen = resolve(EngineConfig(), LLAMA3_8B, H100, MEASURED)
    assert cfg.kv_cache_memory_bytes == int(0.9 * 80 * GiB) - 17 * GiB
    assert num_pool_pages(cfg, LLAMA3_8B) * 16 > 8192 and cfg.max_model_len == 8192  # the model's context
    assert "KV cache 55.0 GiB (gpu_memory_utilization 0.9 of 80.0 GiB, less 15.0 GiB of weights" in ", ".join(chosen)
    assert chosen[-1] == "max_model_len 8192 (the model's context)"

    smaller_share, _ = resolve(EngineConfig(gpu_memory_utilization=0.5), LLAMA3_8B, H100, MEASURED)
    assert smaller_share.kv_cache_memory_bytes == 40 * GiB - 17 * GiB


def test_a_long_context_is_capped_by_what_the_pool_holds():
    """A 128k-token model on a 24 GiB GPU: max_model_len is what the pool holds, not the model's context."""
    long_context = dataclasses.replace(LLAMA3_8B, max_position_embeddings=131072)
    small_gpu = DeviceInfo("gpu", "NVIDIA L4", 24 * GiB)
    cfg, chosen = resolve(EngineConfig(), long_context, small_gpu, MEASURED)
    pool_tokens = num_pool_pages(cfg, long_context) * cfg.block_size
    assert pool_tokens == ((int(0.9 * 24 * GiB) - 17 * GiB) // (128 * 1024 * 16) - 1) * 16  # less the dummy page
    assert cfg.max_model_len == pool_tokens < 131072
    assert chosen[-1] == f"max_model_len {pool_tokens} (what the KV pool holds)"


def test_a_gpu_of_unknown_memory_gets_a_cpus_pool():
    """A compilation target (check-lowering) says nothing of its memory: 512 MiB, and the reason."""
    cfg, chosen = resolve(EngineConfig(), LLAMA3_8B, DeviceInfo.target("gpu"))
    assert (cfg.dtype, cfg.kv_cache_memory_bytes) == ("bfloat16", 512 * 2**20)
    assert "KV cache 512 MiB (the device's memory is unknown)" in chosen


def test_kv_cache_dtype_auto_follows_dtype_and_cpu_bf16_and_sizes_the_pool_by_its_bytes():
    f32 = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=GiB)
    cfg, chosen = resolve(EngineConfig(**f32), LLAMA3_8B, H100, MEASURED)
    assert cfg.kv_cache_dtype == "float32" and not any("kv_cache_dtype" in c for c in chosen)
    bf16_pages, chosen = resolve(EngineConfig(**f32, matmul_backend="cpu-bf16"), LLAMA3_8B, H100, MEASURED)
    assert bf16_pages.kv_cache_dtype == "bfloat16" and "kv_cache_dtype bfloat16" in chosen
    assert num_pool_pages(bf16_pages, LLAMA3_8B) + 1 == 2 * (num_pool_pages(cfg, LLAMA3_8B) + 1)  # half the bytes
    assert resolve(EngineConfig(dtype="bfloat16"), LLAMA3_8B, H100, MEASURED)[0].kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' needs dtype='float32'"):
        resolve(EngineConfig(dtype="bfloat16", kv_cache_dtype="float32"), LLAMA3_8B, H100, MEASURED)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")  # e4m3 only (vLLM's "fp8")


def test_the_users_settings_win():
    given = EngineConfig(dtype="float32", kv_cache_dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                         kv_cache_memory_bytes=GiB, max_model_len=1024)
    assert resolve(given, LLAMA3_8B, H100, MEASURED) == (given, ())
    # A pool of fixed pages is never sized from memory; max_model_len is then what those pages hold
    cfg, _ = resolve(EngineConfig(num_kv_pages=100), LLAMA3_8B, H100)
    assert cfg.kv_cache_memory_bytes is None and cfg.max_model_len == 1600
    # One limit given: the other yields to it rather than break "a step holds max_num_seqs rows"
    assert resolve(EngineConfig(max_num_batched_tokens=64), LLAMA3_8B, H100)[0].max_num_seqs == 64
    assert resolve(EngineConfig(max_num_seqs=4096), LLAMA3_8B, CPU)[0].max_num_batched_tokens == 4096


def test_a_users_setting_that_cannot_work_is_refused_by_name():
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds the model's max_position_embeddings=8192"):
        resolve(EngineConfig(max_model_len=9000), LLAMA3_8B, H100, MEASURED)
    with pytest.raises(ValueError, match="holds 1600 tokens, fewer than max_model_len=2048: .*num_kv_pages"):
        resolve(EngineConfig(num_kv_pages=100, max_model_len=2048), LLAMA3_8B, H100)
    with pytest.raises(ValueError, match="nothing is left for the KV cache: .*raise gpu_memory_utilization"):
        resolve(EngineConfig(gpu_memory_utilization=0.2), LLAMA3_8B, H100, MEASURED)
    for share in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=.* must be in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=share)
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_the_flags_parse():
    parse = lambda *argv: engine_config_from_args(build_parser().parse_args(["serve", *argv]))  # noqa: E731
    assert parse() == EngineConfig() and EngineConfig().dtype == "auto"
    assert parse("--dtype", "auto", "--gpu-memory-utilization", "0.8").gpu_memory_utilization == 0.8
    assert parse("--max-num-seqs", "256").max_num_seqs == 256
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float16"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        parse("--gpu-memory-utilization", "90")


@pytest.mark.parametrize("avx512_bf16, amx", [(False, False), (True, False), (True, True)])
def test_no_flags_on_a_cpu_start_the_engine_of_before(tiny_model_dir, capsys, monkeypatch, avx512_bf16, amx):
    """`jaxserve serve MODEL` on a CPU: today's numbers, and the start-up line says what was chosen; where
    the CPU has AVX512-BF16, the weights and KV pages are bfloat16 (the cpu-bf16 kernels), and it says so,
    naming AMX's tiles where the matmul uses them."""
    from jaxserve.ops import cpu_ffi

    if cpu_ffi.kernel_error() is not None:
        pytest.skip(f"the C++ kernels do not build here: {cpu_ffi.kernel_error()}")
    monkeypatch.setattr(cpu_ffi, "bf16_dot_instructions", lambda: avx512_bf16)
    monkeypatch.setattr(cpu_ffi, "amx_available", lambda: amx)
    engine, _ = LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(), warmup=False)
    cfg = engine.cfg
    assert (cfg.dtype, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_memory_bytes) == (
        "float32", 32, 512, 512 * 2**20)
    assert cfg.max_model_len == min(2048, engine.model_cfg.max_position_embeddings)
    assert engine.runner.decode_buckets == [1, 2, 4, 8, 16, 32]
    err = capsys.readouterr().err
    half = "dtype auto: bfloat16 weights and KV pages (the cpu-bf16 matmul and attention"
    if avx512_bf16:
        assert (cfg.matmul_backend, cfg.kv_cache_dtype, engine.runner.attention_backend) == (
            "cpu-bf16", "bfloat16", "cpu-bf16")
        assert half in err and "weights bfloat16 (the C++ matmul)" in err
        assert ("this CPU has AVX512-BF16 and AMX tiles)" in err) == amx
        assert ("jaxserve: defaults for cpu (a CPU's defaults): kv_cache_dtype bfloat16, max_num_seqs 32, "
                "max_num_batched_tokens 512, KV cache 512 MiB, max_model_len") in err
    else:
        assert (cfg.kv_cache_dtype, engine.runner.attention_backend) == ("float32", "cpu") and half not in err
        assert ("jaxserve: defaults for cpu (a CPU's defaults): dtype float32, max_num_seqs 32, "
                "max_num_batched_tokens 512, KV cache 512 MiB, max_model_len") in err


def test_no_flags_on_a_described_gpu_size_the_pool_from_its_memory(tiny_model_dir, monkeypatch, capsys):
    """The GPU path end to end on this CPU: the runner measures the weights and the largest steps, the pool
    takes the rest of gpu_memory_utilization of the (described) memory, max_model_len is capped by it when
    it is small, and nothing compiles after warm-up. Small limits keep the compiles few."""
    limits = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, forbid_compilation_after_warmup=True)

    def start(memory_bytes: int, warmup: bool) -> LLMEngine:
        monkeypatch.setattr(DeviceInfo, "local", classmethod(lambda cls: DeviceInfo("gpu", "a GPU", memory_bytes)))
        return LLMEngine.from_config(tiny_model_dir("llama"), EngineConfig(**limits), warmup=warmup,
                                     show_progress=False)[0]

    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    roomy = start(256 * 2**20, warmup=False)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"  # XLA may take the card, not 75% of it
    runner, cfg = roomy.runner, roomy.cfg
    assert cfg.dtype == "bfloat16" and runner.kv_cache[0].dtype.name == "bfloat16"
    step_bytes = int(0.9 * 256 * 2**20) - runner.device_weight_bytes - cfg.kv_cache_memory_bytes
    assert 0 < step_bytes < 16 * 2**20  # measured, and small for a tiny model
    assert cfg.max_model_len == roomy.model_cfg.max_position_embeddings
    assert "jaxserve: defaults for a GPU (the engine measured on an H100): dtype bfloat16" in capsys.readouterr().err

    # Room for 40 pages of K/V after the same weights and step, the dummy page 0 among them:
    # max_model_len is what the other 39 hold
    per_page = runner.device_kv_cache_bytes // runner.num_pages
    tight = start(int((runner.device_weight_bytes + step_bytes + 40 * per_page) / 0.9) + 10, warmup=True)
    assert tight.runner.num_pages == 40 and tight.cfg.max_model_len == 39 * 8
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt in ([1, 2, 3], list(range(40))):
        tight.add_request(prompt, params)
    while tight.has_unfinished:
        tight.step()
    assert tight.num_compilations_since_warmup == 0


def test_a_users_xla_memory_fraction_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    device_defaults.let_xla_take_the_gpu()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
