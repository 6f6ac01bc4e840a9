"""The start-up lines an engine prints once built and once warm (`jaxserve.startup` logger, stderr):
what the device's defaults chose, the KV pool, the mesh, and how long compiling took."""

from __future__ import annotations

from jaxserve.config import device_defaults
from jaxserve.log import STARTUP
from jaxserve.runner.model_runner import ModelRunner


def log_engine_shape(runner: ModelRunner, source: str) -> None:
    resolved = runner.resolved
    if resolved.chosen:
        STARTUP.info("defaults for %s (%s): %s", resolved.device.kind,
                     device_defaults.kind_defaults(resolved.device).why, ", ".join(resolved.chosen))
    if resolved.half_precision:
        STARTUP.info("%s", resolved.half_precision)
    STARTUP.info(f"{resolved.model.architecture} from {source}; KV cache {runner.num_pages - 1} pages x "
                 f"{runner.cfg.page_size} tokens = {runner.max_concurrent_tokens} max concurrent tokens "
                 f"({runner.kv_cache_bytes / 2**20:.0f} MiB)")
    STARTUP.info(f"weights {describe_weights(runner)}, {runner.device_weight_bytes / 2**20:.1f} MiB per device; "
                 f"KV pages {runner.cfg.kv_cache_dtype}, {runner.device_kv_cache_bytes / 2**20:.1f} MiB per device")
    if runner.mesh is not None:
        STARTUP.info(f"tensor parallel over {runner.mesh.size} {runner.mesh.devices.flat[0].platform} devices "
                     f"({runner.parallel.describe()}); per device: weights "
                     f"{runner.device_weight_bytes / 2**20:.1f} MiB, KV cache "
                     f"{runner.device_kv_cache_bytes / 2**20:.1f} MiB; {runner.describe_weights_read()}")


def describe_weights(runner: ModelRunner) -> str:
    """How the weight matrices are held: "int8 (W8A8, the C++ matmul)", "fp8 (W8A16, the C++ matmul)", "fp8
    (W8A8, XLA's dot)", "bfloat16 ..."."""
    resolved = runner.resolved
    quantization = quantization_in_use(runner)
    where = "the C++ matmul" if resolved.packed_dtype else "XLA's dot"
    if quantization:  # the C++ matmul's fp8 weights take bfloat16 activations; every other 8-bit kind, 8-bit ones
        scheme = "W8A16" if resolved.packed_dtype == "fp8" else "W8A8"
        return f"{quantization} ({scheme}, {where})"
    return f"{resolved.packed_dtype or resolved.engine.dtype} ({where})"


def quantization_in_use(runner: ModelRunner) -> str | None:
    """The weights' quantization ("int8", "fp8"), None for float weights."""
    resolved = runner.resolved
    return resolved.quantization or (resolved.packed_dtype if resolved.packed_dtype in ("int8", "fp8") else None)


def log_warmup(summary: dict) -> None:
    STARTUP.info(f"{summary['num_executables']} executables ready in {summary['seconds']:.1f} s, "
                 f"{summary['num_cache_hits']} from the compilation cache (prefill token buckets "
                 f"{summary['prefill_buckets']}, decode batch buckets {summary['decode_buckets']})")
