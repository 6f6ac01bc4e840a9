"""Which attention implementation runs, decided once at engine start, and the one call that runs it;
and which matmul (`resolve_matmul_backend`).

  xla               `jaxserve.ops.attention.ragged_paged_attention`: pure JAX, any platform, the reference.
  cpu               the same contract, every row (decode rows and prompt chunks) computed by the C++ kernel
                    of `cpu_ffi.py` (XLA:CPU, float32 activations; KV pages in float32, bfloat16 or
                    float8 e4m3; built with the machine's C++ compiler on first use).
  pallas            `pallas_kernels` (Mosaic GPU, Hopper): the ragged kernel for the prefill entry point,
                    the flash-decoding kernel for the decode entry point.
  pallas-interpret  the same kernels run by JAX's GPU interpreter on the CPU: tests and debugging, slow.
  auto              pallas on a Hopper GPU when the model's shapes and KV page dtype fit the kernels
                    (bfloat16 pages, or fp8 pages upcast in the kernel), cpu on a CPU when the kernel builds
                    and the engine is float32, else xla; the reason for falling back is logged.

An explicit cpu / pallas / pallas-interpret that cannot run the model is refused here, with the reason,
before anything is compiled, so no request ever meets an unsupported shape. The model calls
`paged_attention`, the only place that picks an implementation: `attention.py` holds the XLA path and
the reference, and knows nothing of the kernels.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxserve.ops.attention import AttentionMetadata, ragged_paged_attention
from jaxserve.ops.attention import write_kv as xla_write_kv
from jaxserve.config.device_defaults import resolve_kv_cache_dtype
from jaxserve.config.model_config import ModelConfig
from jaxserve.config.engine_config import ATTENTION_BACKENDS, MATMUL_BACKENDS, EngineConfig

logger = logging.getLogger(__name__)

RESOLVED_BACKENDS = ("xla", "cpu", "cpu-bf16", "pallas", "pallas-interpret")
MIN_COMPUTE_CAPABILITY = 9.0  # Mosaic GPU kernels use wgmma and TMA (Hopper and newer)


def _kernel_support_error(model_cfg: ModelConfig, engine_cfg: EngineConfig, interpret: bool) -> str | None:
    """Why the Pallas kernels cannot run this model and engine setting, or None if they can."""
    from pallas_kernels import UnsupportedShapeError, check_supported

    # float8 pages are upcast in the kernels to the engine's dtype; other pages are read in the engine's dtype
    dtype, kv_dtype = jnp.dtype(engine_cfg.dtype), jnp.dtype(resolve_kv_cache_dtype(engine_cfg))
    try:
        check_supported(num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.num_kv_heads,
                        head_dim=model_cfg.head_dim, page_size=engine_cfg.page_size,
                        dtype=kv_dtype if kv_dtype == jnp.float8_e4m3fn else dtype, q_dtype=dtype,
                        interpret=interpret)
    except UnsupportedShapeError as e:
        return str(e)
    return None


def _local_gpu_error() -> str | None:
    """Why this machine's first GPU cannot run Mosaic GPU kernels, or None."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None and float(capability) < MIN_COMPUTE_CAPABILITY:
        return f"the GPU has compute capability {capability}; the Pallas kernels need Hopper ({MIN_COMPUTE_CAPABILITY}+)"
    return None


def _cpu_kernel_error(engine_cfg: EngineConfig, platform: str) -> str | None:
    """Why the C++ CPU kernels cannot run here, or None if they can (building them if needed)."""
    if platform != "cpu":
        return f"it runs on a CPU (this is {platform})"
    if jnp.dtype(engine_cfg.dtype) != jnp.float32:
        return f"it reads float32 weights and KV pages (the engine runs {engine_cfg.dtype})"
    from jaxserve.ops.cpu_ffi import kernel_error

    return kernel_error()


def _cpu_or_xla(setting: str, requested: str, engine_cfg: EngineConfig, platform: str, fallback: str) -> str:
    """"cpu" when the C++ kernels can run; else an explicit "cpu" is refused and "auto" falls back to
    XLA, logging why."""
    reason = _cpu_kernel_error(engine_cfg, platform)
    if not reason:
        return "cpu"
    if requested == "cpu":
        raise ValueError(f"{setting}='cpu' cannot run this model: {reason}")
    logger.warning("%s='auto' uses %s: %s", setting, fallback, reason)
    return "xla"


def resolve_attention_backend(requested: str, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                              platform: str | None = None) -> str:
    """Turns the engine's `attention_backend` into one of RESOLVED_BACKENDS for `platform`.

    platform: "gpu" or "cpu" (JAX's names) to decide for a target machine without one (check-lowering);
    None decides for this machine, including its GPU's compute capability. Raises ValueError when an
    explicitly requested Pallas backend cannot run the model.
    """
    assert requested in ATTENTION_BACKENDS, requested
    local = platform is None
    platform = jax.default_backend() if local else platform
    if requested == "xla":
        return "xla"
    if requested == "cpu" or (requested == "auto" and platform == "cpu"):
        return _cpu_or_xla("attention_backend", requested, engine_cfg, platform, "XLA attention")
    if requested == "auto":
        if platform != "gpu":
            return "xla"
        reason = _kernel_support_error(model_cfg, engine_cfg, interpret=False) or (local and _local_gpu_error())
        if reason:
            logger.warning("attention_backend='auto' uses XLA attention: %s", reason)
            return "xla"
        return "pallas"
    interpret = requested == "pallas-interpret"
    reason = _kernel_support_error(model_cfg, engine_cfg, interpret=interpret)
    if not interpret and not reason:
        if platform != "gpu":
            reason = f"it needs a GPU (this is {platform}); use 'pallas-interpret' to run the kernels on CPU"
        elif local:
            reason = _local_gpu_error()
    if reason:
        raise ValueError(f"attention_backend={requested!r} cannot run this model: {reason}")
    return requested


def resolve_matmul_backend(requested: str, engine_cfg: EngineConfig, platform: str | None = None) -> str:
    """"cpu" or "cpu-bf16" (the weights packed for `packed_matmul.matmul`, in float32 or bfloat16) or "xla", for
    `platform` (None: this machine). Raises ValueError when an explicit "cpu" or "cpu-bf16" cannot run."""
    assert requested in MATMUL_BACKENDS, requested
    if requested == "xla":
        return "xla"
    platform = platform or jax.default_backend()
    if requested == "auto" and platform != "cpu":
        return "xla"
    if requested == "cpu-bf16":
        reason = _cpu_kernel_error(engine_cfg, platform)
        if reason:
            raise ValueError(f"matmul_backend='cpu-bf16' cannot run this model: {reason}")
        return requested
    return _cpu_or_xla("matmul_backend", requested, engine_cfg, platform, "XLA's dot")


def unquantized_packed_dtype(packed_dtype: str | None) -> str | None:
    """What 8-bit packed weights ("int8", "fp8") leave unquantized, decided here once: fp8's LM head
    (transformer.serving_params) and the attention's products (`paired_attention_backend`) in "bfloat16" on a
    CPU the kernels are built for with AVX512-BF16 (it multiplies bfloat16 at twice float32's rate), else in
    "float32". None for any other packed type, or none."""
    if packed_dtype not in ("int8", "fp8"):
        return None
    from jaxserve.ops.cpu_ffi import bf16_dot_instructions

    return "bfloat16" if bf16_dot_instructions() else "float32"


def paired_attention_backend(attention: str, matmul: str, requested: str = "auto",
                             unquantized_dtype: str | None = None) -> str:
    """The resolved attention backend given the resolved matmul one: "cpu-bf16" (the C++ kernel with the
    products of its prompt tiles, and of decode rows over bfloat16 pages, in bfloat16:
    `cpu_ffi.paged_row_attention`'s bf16_products) where attention was left to choose (`requested` "auto")
    and resolved to the C++ kernel, and the matmuls multiply in bfloat16 ("cpu-bf16"), or in 8 bits (packed
    int8 weights, whose activations are rounded to 8 bits, far coarser than bfloat16's; packed e4m3
    weights, bfloat16 activations) whose unquantized parts are bfloat16 (`unquantized_dtype`,
    `unquantized_packed_dtype`); else `attention` unchanged. An explicit "cpu" keeps float32 products.

    Under int8 on a 2-core AMD EPYC with AVX512-BF16 (2026-12-03, benchmarks/bench_quantization.py) the
    bfloat16 products gave 1.19x / 1.32x the prefill tokens/s at 1,024-token prompts (batch 1 / 8), decode
    level; `jaxserve bench quality` measured the cost (README, Quantization)."""
    if attention != "cpu" or requested != "auto":
        return attention
    if matmul == "cpu-bf16" or unquantized_dtype == "bfloat16":
        return "cpu-bf16"
    return attention


def cpu_half_precision(engine_cfg: EngineConfig, platform: str | None = None) -> str | None:
    """Why dtype "auto" runs a CPU engine in bfloat16, or None where it stays float32.

    vLLM serves a float32 checkpoint in half precision where the device computes it fast; so does this, on
    a CPU that multiplies bfloat16 at twice float32's rate (AVX512-BF16, which AMX CPUs have too): the
    weights and KV pages in bfloat16, multiplied by the "cpu-bf16" matmul and attention (activations and
    sums stay float32). Only where every setting it changes was left to choose (dtype, matmul and attention
    backends) and no quantization is asked; `dtype="float32"` keeps Hugging Face's float32 tokens."""
    platform = platform or jax.default_backend()
    if (platform != "cpu" or engine_cfg.dtype != "auto" or engine_cfg.matmul_backend != "auto"
            or engine_cfg.attention_backend not in ("auto", "cpu") or engine_cfg.quantization):
        return None
    from jaxserve.ops.cpu_ffi import amx_available, bf16_dot_instructions, kernel_error

    if not bf16_dot_instructions() or kernel_error():
        return None
    has = "AVX512-BF16 and AMX tiles" if amx_available() else "AVX512-BF16"
    return ("dtype auto: bfloat16 weights and KV pages (the cpu-bf16 matmul and attention, float32 sums: this CPU "
            f"has {has}); --dtype float32 keeps Hugging Face's float32 tokens")


def write_kv(k_pages, v_pages, layer, k, v, slot_mapping, *, backend: str = "xla"):
    """Writes this step's keys and values [T, KVH, D] into the pages of `layer` (attention.write_kv's
    XLA scatter; with the C++ attention backends and bfloat16 or float8 pages, the C++ writer, since
    XLA:CPU widens the whole array around a scatter in either dtype)."""
    if backend in ("cpu", "cpu-bf16") and k_pages.dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        from jaxserve.ops.cpu_ffi import write_pages

        return write_pages(k_pages, v_pages, layer, k, v, slot_mapping)
    return xla_write_kv(k_pages, v_pages, layer, k, v, slot_mapping)


def rotates_in_writer(backend: str, page_dtype) -> bool:
    """Whether `rope_and_write_kv` takes the layer's rope and page writes in one C++ call: with the C++
    attention backends and bfloat16 or float8 pages, whose writer is C++ already (`write_kv`)."""
    return backend in ("cpu", "cpu-bf16") and page_dtype in (jnp.bfloat16, jnp.float8_e4m3fn)


def rope_and_write_kv(k_pages, v_pages, layer, qkv, cos, sin, slot_mapping, *, num_heads: int):
    """Where `rotates_in_writer`: the qkv matmul's rows [T, (H + 2 KVH) D] -> (q [T, H, D] rotated by the
    rope, the pages with k rotated and v written at their slots), `cpu_ffi.rope_write_pages`: XLA's slices,
    rotations and the writer's call made four passes over the rows (7.0 ms of a 512-token prompt step on
    an AMX Xeon, against 4.0 for this call; docs/benchmarks.md)."""
    from jaxserve.ops.cpu_ffi import rope_write_pages

    return rope_write_pages(k_pages, v_pages, layer, qkv, cos, sin, slot_mapping, num_heads=num_heads)


def paged_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer,  # int32 scalar
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window=0,  # int32 scalar, 0 = none
    soft_cap: float = 0.0,
    q_tile: int = 16,
    kv_tile: int = 128,
    backend: str = "xla",
    decode_only: bool = False,
    out_dtype=None,
):
    """Attention over the paged KV cache with the resolved `backend`; returns [T, H, D] in q's dtype, or
    out_dtype (the C++ kernel rounds to bfloat16 itself over bfloat16 or float8 pages; the others convert).

    decode_only: every sequence has at most one query row (the engine's decode entry point); the
    Pallas backends then use the flash-decoding kernel. q_tile / kv_tile tune the XLA path only.
    """
    assert backend in RESOLVED_BACKENDS, f"resolve {backend=} first"
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if backend in ("cpu", "cpu-bf16"):
        return _cpu_kernel_attention(q, k_pages, v_pages, layer, md, scale=scale, sliding_window=sliding_window,
                                     soft_cap=soft_cap, bf16_products=backend == "cpu-bf16", out_dtype=out_dtype)
    return _other_attention(q, k_pages, v_pages, layer, md, scale=scale, sliding_window=sliding_window,
                            soft_cap=soft_cap, q_tile=q_tile, kv_tile=kv_tile, backend=backend,
                            decode_only=decode_only).astype(out_dtype)


def _other_attention(q, k_pages, v_pages, layer, md: AttentionMetadata, *, scale: float, sliding_window,
                     soft_cap: float, q_tile: int, kv_tile: int, backend: str, decode_only: bool):
    """paged_attention's XLA and Pallas backends, in q's dtype."""
    if backend == "xla":
        return ragged_paged_attention(q, k_pages, v_pages, layer, md, scale=scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap, q_tile=q_tile, kv_tile=kv_tile, decode_only=decode_only)
    from pallas_kernels import decode_attention, ragged_paged_attention as pallas_ragged

    kernel = decode_attention if decode_only else pallas_ragged
    return kernel(q, k_pages, v_pages, layer, md.cu_q_lens, md.kv_lens, md.block_tables, scale=scale,
                  sliding_window=sliding_window, soft_cap=soft_cap, interpret=backend == "pallas-interpret")


def _cpu_kernel_attention(q, k_pages, v_pages, layer, md: AttentionMetadata, *, scale: float, sliding_window,
                          soft_cap: float, bf16_products: bool, out_dtype):
    """Every query row (decode rows and prompt-chunk rows alike) to the C++ kernel of `cpu_ffi.py`, one
    call per layer: it needs each row's sequence and causal key count, which the ragged metadata
    gives per sequence."""
    from jaxserve.ops.cpu_ffi import paged_row_attention

    num_tokens = q.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seqs = jnp.minimum(jnp.searchsorted(md.cu_q_lens[1:], rows, side="right"), md.kv_lens.shape[0] - 1)
    positions = md.kv_lens[seqs] - md.cu_q_lens[seqs + 1] + rows  # kv_len - q_len + row offset
    kv_lens = jnp.where(rows < md.cu_q_lens[-1], positions + 1, 0)  # padding rows: nothing
    rounded = out_dtype == jnp.bfloat16 and k_pages.dtype != jnp.float32  # by the kernel
    return paged_row_attention(q, k_pages, v_pages, layer, kv_lens, seqs, md.block_tables, scale=scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, bf16_products=bf16_products,
                               out_dtype=jnp.bfloat16 if rounded else jnp.float32).astype(out_dtype)
