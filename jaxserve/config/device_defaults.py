"""The settings a user leaves unset, chosen for the device the engine runs on.

An `EngineConfig` setting left unset (None, or dtype "auto") means "what suits this device". `resolve`
turns such a config into one where every setting is a number, for a `DeviceInfo` (one device described:
this machine's by `DeviceInfo.local()`, a compilation target's by `DeviceInfo.target()`, or a made-up
one in tests), and says what it chose and why. On a CPU the choices are the engine's long-standing
defaults; on a GPU the batch limits are those of the measured H100 runs and the KV page pool takes the
memory the weights and a step's activations leave. Sizing from memory needs two numbers that only the
model runner can measure (`MemoryUse`); until it has them, `resolve` leaves the pool unsized.

This module decides numbers only: it places, allocates and compiles nothing (model_runner.py does).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.engine_config import CPU, GPU, EngineConfig, KindDefaults


# XLA's GPU allocator may take this share of each GPU (its own default is 75%): gpu_memory_utilization
# is then a share of nearly the whole card, as vLLM's is, instead of three quarters of it.
XLA_MEMORY_FRACTION = "0.95"


def let_xla_take_the_gpu() -> None:
    """Before JAX starts a GPU backend (later it has no effect): XLA_PYTHON_CLIENT_MEM_FRACTION, unless
    the user set it. On an 80 GB H100 an 8B model's pool grows from about 23 to about 52 GiB."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_MEMORY_FRACTION)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device of the engine's, as the defaults see it (under tensor parallelism each holds a share)."""

    platform: str  # JAX's name: "cpu", "gpu", "tpu"
    kind: str  # JAX's device_kind, such as "NVIDIA H100 80GB HBM3"
    memory_bytes: int | None = None  # what XLA's allocator may hand out on it; None: unknown

    @classmethod
    def local(cls) -> DeviceInfo:
        """This process's first device. Its memory is XLA's allocator limit (memory_stats' bytes_limit),
        not the data sheet's: on a GPU that is 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says
        otherwise. A CPU reports none."""
        import jax  # here: `jaxserve --help` should not start JAX

        device = jax.local_devices()[0]
        stats = device.memory_stats() or {}
        return cls(device.platform, device.device_kind, stats.get("bytes_limit"))

    @classmethod
    def target(cls, platform: str) -> DeviceInfo:
        """A device of `platform` that this machine does not have (check-lowering): memory unknown."""
        return cls(platform, f"{platform} (a compilation target)")


def kind_defaults(device: DeviceInfo) -> KindDefaults:
    """A CPU's defaults on a CPU, a GPU's on any accelerator."""
    return CPU if device.platform == "cpu" else GPU


def resolve_dtype(dtype: str, device: DeviceInfo) -> str:
    """The dtype setting, "auto" made the device's (the weights load in it before `resolve` runs)."""
    return kind_defaults(device).dtype if dtype == "auto" else dtype


class MemoryUse(NamedTuple):
    """What one device holds besides the KV pool, measured by the model runner once the weights are placed."""

    weight_bytes: int  # the weights, and any copy the loader still holds while the pool is allocated
    step_bytes: int  # the largest step's activations, inputs and outputs (XLA's memory analysis)


def _size(num_bytes: float) -> str:
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:.1f} GiB"
    return f"{num_bytes / 2**20:.0f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.0f} KiB"


def num_pool_pages(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Pages in the pool (the dummy page not counted): num_kv_pages, else what kv_cache_memory_bytes
    holds for `model_cfg` (a device's share under tensor parallelism)."""
    if cfg.num_kv_pages is not None:
        return cfg.num_kv_pages
    assert cfg.kv_cache_memory_bytes is not None, "the pool is sized from memory: measure first"
    # The array's dummy page 0 comes out of the same budget
    page_bytes = model_cfg.kv_bytes_per_token(resolve_kv_cache_dtype(cfg)) * cfg.page_size
    return cfg.kv_cache_memory_bytes // page_bytes - 1


# vLLM's names for float8 e4m3 pages -> JAX's dtype name, which the resolved config holds.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(cfg: EngineConfig, dtype: str | None = None) -> str:
    """The KV pages' dtype, a name jnp takes: kv_cache_dtype ("fp8" and "fp8_e4m3" as "float8_e4m3fn"),
    or for "auto" that of the engine's `dtype` (resolved; cfg.dtype by default), bfloat16 under
    matmul_backend "cpu-bf16" or a quantization (whose weights already cost more precision than bfloat16
    pages do: at batch 32 the float32 pages' bytes were a fifth of an int8 engine's decode step)."""
    if cfg.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return "float8_e4m3fn"
    if cfg.kv_cache_dtype != "auto":
        return cfg.kv_cache_dtype
    return "bfloat16" if cfg.matmul_backend == "cpu-bf16" or cfg.quantization else (dtype or cfg.dtype)


def resolve(cfg: EngineConfig, model_cfg: ModelConfig, device: DeviceInfo,
            memory: MemoryUse | None = None, *, dtype: str | None = None) -> tuple[EngineConfig, tuple[str, ...]]:
    """`cfg` with its unset settings chosen for `device` and a model of `model_cfg` (a device's share under
    tensor parallelism), and what was chosen ("setting value", with the reason where it is not the kind's
    `why`). A setting the user gave is kept; one that cannot work raises ValueError naming it.

    When the KV pool is to be sized from the device's memory, it stays unsized (kv_cache_memory_bytes
    None, max_model_len the most it may become) until `memory` is given: resolve again with it.
    dtype: the engine's dtype where the caller took it already from `resolve_dtype` (the weights load in it).
    """
    kind = kind_defaults(device)
    chosen, changes = [], {}
    if cfg.dtype == "auto":
        changes["dtype"] = dtype or resolve_dtype(cfg.dtype, device)
    dtype = changes.get("dtype", cfg.dtype)
    if cfg.kv_cache_dtype == "float32" and dtype != "float32":
        raise ValueError(f"kv_cache_dtype='float32' needs dtype='float32' (the engine runs {dtype}); "
                         f"leave kv_cache_dtype 'auto'")
    kv_cache_dtype = resolve_kv_cache_dtype(cfg, dtype)
    if cfg.kv_cache_dtype == "auto" and kv_cache_dtype != dtype:  # said at start-up only where it is not dtype
        changes["kv_cache_dtype"] = kv_cache_dtype
    # An unset limit yields to one the user gave: a step of max_num_batched_tokens holds max_num_seqs rows.
    max_num_seqs = cfg.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = changes["max_num_seqs"] = min(kind.max_num_seqs, cfg.max_num_batched_tokens or kind.max_num_seqs)
    if cfg.max_num_batched_tokens is None:
        changes["max_num_batched_tokens"] = max(kind.max_num_batched_tokens, max_num_seqs)
    chosen += [f"{name} {value}" for name, value in changes.items()]
    cfg = dataclasses.replace(cfg, **(changes | {"kv_cache_dtype": kv_cache_dtype}))

    if cfg.num_kv_pages is None and cfg.kv_cache_memory_bytes is None:
        kv_bytes, why = _kv_cache_bytes(cfg, kind, device, memory)
        if kv_bytes is not None:
            cfg = dataclasses.replace(cfg, kv_cache_memory_bytes=kv_bytes)
            chosen.append(f"KV cache {_size(kv_bytes)}" + (f" ({why})" if why else ""))

    context = model_cfg.max_position_embeddings
    pool_tokens = None if cfg.num_kv_pages is None and cfg.kv_cache_memory_bytes is None else (
        num_pool_pages(cfg, model_cfg) * cfg.page_size)
    if cfg.num_kv_pages is None and pool_tokens is not None and pool_tokens <= 0:
        page_bytes = model_cfg.kv_bytes_per_token(cfg.kv_cache_dtype) * cfg.page_size
        raise ValueError(f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} holds "
                         f"{cfg.kv_cache_memory_bytes // page_bytes} pages of {page_bytes} bytes; at least 2 are needed")
    if cfg.max_model_len is not None:
        if cfg.max_model_len > context:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={context}")
        if pool_tokens is not None and cfg.max_model_len > pool_tokens:
            raise ValueError(f"the KV page pool holds {pool_tokens} tokens, fewer than max_model_len="
                             f"{cfg.max_model_len}: lower max_model_len or raise num_kv_pages, kv_cache_memory_bytes "
                             f"or gpu_memory_utilization")
        return cfg, tuple(chosen)
    limits = [(context, "the model's context")]
    if kind.max_model_len_cap is not None:
        limits.append((kind.max_model_len_cap, f"at most {kind.max_model_len_cap} on {kind.name}"))
    if pool_tokens is not None:
        limits.append((pool_tokens, "what the KV pool holds"))
    max_model_len, why = min(limits)
    cfg = dataclasses.replace(cfg, max_model_len=max_model_len)
    if pool_tokens is not None:  # settled: the pool is sized
        chosen.append(f"max_model_len {max_model_len} ({why})")
    return cfg, tuple(chosen)


def _kv_cache_bytes(cfg: EngineConfig, kind: KindDefaults, device: DeviceInfo,
                    memory: MemoryUse | None) -> tuple[int | None, str]:
    """The pool's bytes per device and why ("" for the kind's own number); None until `memory` is
    measured where the pool comes from the device's memory."""
    if kind.kv_cache_memory_bytes is not None:
        return kind.kv_cache_memory_bytes, ""
    if device.memory_bytes is None:
        return CPU.kv_cache_memory_bytes, "the device's memory is unknown"
    if memory is None:
        return None, ""
    # vLLM's gpu_memory_utilization: of the memory granted, the pool takes what the weights and the
    # largest step leave; the rest is headroom for what nobody measured (the runtime's own buffers).
    granted = int(cfg.gpu_memory_utilization * device.memory_bytes)
    kv_bytes = granted - memory.weight_bytes - memory.step_bytes
    why = (f"gpu_memory_utilization {cfg.gpu_memory_utilization} of {_size(device.memory_bytes)}, less "
           f"{_size(memory.weight_bytes)} of weights and {_size(memory.step_bytes)} for a step")
    if kv_bytes <= 0:
        raise ValueError(f"nothing is left for the KV cache: {why}; raise gpu_memory_utilization or give "
                         f"kv_cache_memory_bytes")
    return kv_bytes, why
