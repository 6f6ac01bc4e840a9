"""Every decision the engine takes from its settings, the model and the device, taken once.

`resolve_config` turns an `EngineConfig` (settings left unset: None, "auto") into a frozen
`ResolvedConfig` before anything is built: the defaults for the device, the attention and matmul
backends, the buckets, asynchronous scheduling, the speculation batch limit, the KV pool's pages. The
runner, the page pool, the scheduler and the input builder read the record and decide nothing. One
decision waits: a pool sized from the device's memory needs the largest step's measured activations,
so the runner compiles those two steps, then calls `size_pool` (the one step after compilation).

It lives in the runner layer because choosing a backend asks the ops layer whether its kernels run.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import device_defaults
from jaxserve.config.buckets import decode_buckets, prefill_buckets
from jaxserve.config.device_defaults import DeviceInfo, MemoryUse
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.ops.attention_backends import (cpu_half_precision, paired_attention_backend,
                                             resolve_attention_backend, resolve_matmul_backend,
                                             unquantized_packed_dtype)
from jaxserve.parallel.tp_layout import HeadLayout

# The dtype of the packed weights each C++ matmul backend takes ("xla": not packed)
PACKED_DTYPES = {"cpu": "float32", "cpu-bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """What the engine runs with: every setting a number, and what was chosen from them."""

    engine: EngineConfig  # every setting a number (kv_cache_memory_bytes None while the pool waits to be sized)
    requested: EngineConfig  # as given: `size_pool` resolves it again with the measured memory
    model: ModelConfig
    device_model: ModelConfig  # what one device runs: the model, or its share under tensor parallelism
    layout: HeadLayout | None  # which heads each device holds (tensor parallelism), else None
    device: DeviceInfo  # what the defaults are sized for (this machine's first device, or a target's)
    platform: str  # what the steps compile for: JAX's "cpu" or "gpu"
    chosen: tuple[str, ...]  # the defaults chosen for the device, as the start-up line says them
    attention_backend: str
    matmul_backend: str
    half_precision: str | None  # why dtype auto chose bfloat16 on a CPU (said at start-up), else None
    packed_dtype: str | None  # the C++ matmul's packed weights, None for XLA's dot
    quantization: str | None  # XLA's 8-bit weights (QuantizedWeight), None where packed or unquantized
    # what 8-bit packed weights leave unquantized (fp8's LM head, the attention's products): "bfloat16" or
    # "float32" (`unquantized_packed_dtype`); None where the packed weights are not 8-bit or nothing is packed
    unquantized_dtype: str | None
    sampler_branches: bool  # the sampler branches on device data (not on a GPU: a branch waits for the host)
    sampler_kernel: bool  # top-k / top-p thresholds and the greedy token by the C++ kernels (XLA:CPU, built)
    kv_tile: int  # keys per iteration of XLA's attention loop
    max_positions: int  # positions the rope tables cover (max_model_len before the pool may lower it)
    prefill_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    async_scheduling: bool
    spec_batch_limit: int  # speculation's batch limit, 0 without speculation
    num_pages: int | None  # pages of the KV array, the dummy page 0 included; None until `size_pool`

    @property
    def padding_rows_cost(self) -> bool:
        """Whether a prompt step's padding rows cost about what its real rows do: XLA's dots multiply every
        row of the step's bucket; the C++ matmul (packed weights) multiplies only the real ones, so a step
        mostly of padding costs little more than its tokens there (and the scheduler does not split a
        prompt to spare its bucket: `Scheduler._token_budget`)."""
        return self.packed_dtype is None


def resolve_async_scheduling(setting: bool | None, platform: str, speculative: bool = False) -> bool:
    """Unset: on where the device runs apart from the host (a GPU); a CPU's host work and XLA share the cores.
    Speculative decoding proposes from the tokens read: it runs synchronously."""
    return setting if setting is not None else platform == "gpu" and not speculative


def resolve_sampler_kernel(platform: str) -> bool:
    """Whether the sampler takes its top-k / top-p thresholds and its greedy tokens from the C++ kernels
    (`sampling.cpu_truncation_threshold`, `sampling.cpu_argmax`): where the steps compile for XLA:CPU and the
    kernels build. XLA's own passes over the vocabulary, the reference, took 120 ms (thresholds) and 0.97 ms
    (greedy tokens) of a batch-32 step of the default model there."""
    if platform != "cpu":
        return False
    from jaxserve.ops.cpu_ffi import kernel_error

    return kernel_error() is None


def _defaults(cfg: EngineConfig, model_cfg: ModelConfig, device: DeviceInfo, half_precision: str | None,
              memory: MemoryUse | None = None, *, dtype: str | None) -> tuple[EngineConfig, tuple[str, ...]]:
    """device_defaults.resolve, its choice of dtype left unsaid where `half_precision` says it instead."""
    engine, chosen = device_defaults.resolve(cfg, model_cfg, device, memory, dtype=dtype)
    return engine, tuple(c for c in chosen if not (half_precision and c.startswith("dtype ")))


def checkpoint_quantization_for(cfg: EngineConfig, model_cfg: ModelConfig, source: str | None) -> str | None:
    """The weights' quantization ("int8", "fp8" or None) that `cfg.quantization` asks of the checkpoint at
    `source` (its path; None: not known) whose config is `model_cfg`. The names of a checkpoint's own format
    are checked against it, as vLLM checks them: compressed-tensors wants 8-bit weights declared by its
    quantization_config (served as stored), gguf a GGUF file (kept quantized: int8). A checkpoint stored in
    8 bits is served so, and a different 8-bit type asked of it is refused."""
    asked, stored = cfg.quantization, model_cfg.quantization
    if asked == "compressed-tensors":
        if stored is None:
            raise ValueError("quantization='compressed-tensors' names a checkpoint's own 8-bit weights, but this "
                             "checkpoint declares no quantization_config: leave quantization unset, or ask "
                             "for 'int8' or 'fp8' to quantize its float weights")
        return stored
    if asked == "gguf":
        if source is None or not str(source).endswith(".gguf"):
            model = f"the model {str(source)!r}" if source else "the model (its file not known here)"
            raise ValueError(f"quantization='gguf' keeps a GGUF file's weights quantized, but {model} is not a "
                             f".gguf file: leave quantization unset, or ask for 'int8' or 'fp8'")
        return "int8"
    if stored and asked not in (None, stored):
        raise ValueError(f"quantization={asked!r}, but the checkpoint's weights are stored in {stored} (its "
                         f"quantization_config): leave quantization unset")
    return asked or stored


def resolve_config(cfg: EngineConfig, model_cfg: ModelConfig, device: DeviceInfo | None = None, *,
                   platform: str | None = None, dtype: str | None = None, source: str | None = None) -> ResolvedConfig:
    """The record for serving a model of `model_cfg` with `cfg` on `device` (this machine's by default).
    platform: decide for "gpu" or "cpu" instead of this machine (check-lowering). dtype: the engine's dtype
    when the caller decided it already (`device_defaults.resolve_dtype`: the weights load in it). source:
    the model's path, which quantization "gguf" checks."""
    device = device or (DeviceInfo.target(platform) if platform else DeviceInfo.local())
    cfg = dataclasses.replace(cfg, quantization=checkpoint_quantization_for(cfg, model_cfg, source))
    tp = cfg.tensor_parallel_size
    layout = HeadLayout.for_model(model_cfg, tp) if tp > 1 else None
    device_model = layout.device_config(model_cfg) if layout else model_cfg
    half_precision = cpu_half_precision(cfg, platform or device.platform)
    if half_precision:
        cfg = dataclasses.replace(cfg, matmul_backend="cpu-bf16")
    engine, chosen = _defaults(cfg, device_model, device, half_precision, dtype=dtype)
    attention = resolve_attention_backend(engine.attention_backend, device_model, engine, platform)
    matmul = resolve_matmul_backend(engine.matmul_backend, engine, platform)
    compiled_for = platform or jax.default_backend()
    packed_dtype = PACKED_DTYPES.get(matmul)
    if packed_dtype and engine.quantization in ("int8", "fp8"):  # the C++ matmul's 8-bit weights
        packed_dtype = engine.quantization
    unquantized = unquantized_packed_dtype(packed_dtype)
    spec = engine.speculative_config
    sized = engine.num_kv_pages is not None or engine.kv_cache_memory_bytes is not None
    return ResolvedConfig(
        engine=engine, requested=cfg, model=model_cfg, device_model=device_model, layout=layout, device=device,
        platform=compiled_for, chosen=chosen,
        attention_backend=paired_attention_backend(attention, matmul, engine.attention_backend, unquantized),
        matmul_backend=matmul,
        half_precision=half_precision, packed_dtype=packed_dtype, unquantized_dtype=unquantized,
        quantization=engine.quantization if packed_dtype is None else None,
        sampler_branches=compiled_for != "gpu", sampler_kernel=resolve_sampler_kernel(compiled_for), kv_tile=min(engine.kv_tile, engine.max_model_len),
        max_positions=engine.max_model_len,
        prefill_buckets=tuple(prefill_buckets(engine)), decode_buckets=tuple(decode_buckets(engine)),
        async_scheduling=resolve_async_scheduling(engine.async_scheduling, compiled_for, spec is not None),
        spec_batch_limit=spec.batch_limit if spec else 0,
        num_pages=device_defaults.num_pool_pages(engine, device_model) + 1 if sized else None,
    )


def size_pool(resolved: ResolvedConfig, memory: MemoryUse) -> ResolvedConfig:
    """The record with its KV pool sized from the device's memory, now that the runner measured what the
    weights and the largest step take (`memory`); max_model_len may fall to what the pool holds. The
    buckets, backends and rope tables were settled before and stay."""
    engine, chosen = _defaults(resolved.requested, resolved.device_model, resolved.device, resolved.half_precision,
                               memory, dtype=resolved.engine.dtype)
    return dataclasses.replace(resolved, engine=engine, chosen=chosen,
                               num_pages=device_defaults.num_pool_pages(engine, resolved.device_model) + 1)
