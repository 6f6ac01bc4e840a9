"""`jaxserve check-lowering`: lowers every bucket's prefill and decode step for a target platform.

Lowering needs no GPU: each bucket's whole step function (forward pass, attention kernels, sampler)
is traced with ShapeDtypeStructs and lowered with `lowering_platforms=(platform,)`, which for Pallas
Mosaic GPU kernels runs their compiler down to NVVM. What this cannot check is PTX assembly, loading
and running, which happen only on a GPU. Params are shapes only: no weights are needed.

Each result also counts the step's control flow outside kernels (`stablehlo.while`, `case`, `if` in
the lowered module; a kernel is one custom call there): on a GPU each one makes the device wait for
the host to read its predicate, so a CUDA step must have none. It also counts the dots by their
operand and result types, and lists every 8-bit matrix widened by a convert: under `quantization` the
weights must enter their dots in int8 or float8 (XLA lowers those to int8 and fp8 GEMMs), never
converted whole to bfloat16 or float32 first. `--dump DIR` writes every module.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.device_defaults import DeviceInfo, resolve_dtype
from jaxserve.runner.resolve import resolve_config
from jaxserve.config.engine_config import EngineConfig
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.models.params import param_shapes as model_param_shapes

PLATFORMS = {"cuda": "gpu", "cpu": "cpu"}  # lowering platform -> JAX backend name


@dataclasses.dataclass
class LoweringResult:
    kind: str  # "prefill" or "decode"
    bucket: int
    attention_backend: str
    ok: bool
    seconds: float
    custom_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    kernels: list = dataclasses.field(default_factory=list)  # pallas_kernels.lowering.LoweredKernel
    control_flow: dict[str, int] = dataclasses.field(default_factory=dict)  # op -> count, outside kernels
    dots: dict[str, int] = dataclasses.field(default_factory=dict)  # "lhs x rhs -> result" element types -> count
    widened: list[str] = dataclasses.field(default_factory=list)  # converts of 8-bit matrices to wider types
    misaligned: list[str] = dataclasses.field(default_factory=list)  # Mosaic GPU inputs XLA may pass unaligned
    error: str = ""


CONTROL_FLOW = re.compile(r"\bstablehlo\.(while|case|if)\b")


def control_flow_ops(module_text: str) -> dict[str, int]:
    """stablehlo.while / case / if ops in a lowered module's text -> how many of each."""
    counts: dict[str, int] = {}
    for match in CONTROL_FLOW.finditer(module_text):
        counts[match.group(0)] = counts.get(match.group(0), 0) + 1
    return counts


_TENSOR = r"tensor<([^>]*)>"
DOT = re.compile(rf"stablehlo\.dot_general\b[^\n]*?:\s*\({_TENSOR},\s*{_TENSOR}\)\s*->\s*{_TENSOR}")
CONVERT = re.compile(rf"stablehlo\.convert\b[^\n]*?:\s*\({_TENSOR}\)\s*->\s*{_TENSOR}")
EIGHT_BIT = ("i8", "ui8", "f8E4M3FN", "f8E5M2")


def _element_type(tensor: str) -> str:
    return tensor.rsplit("x", 1)[-1] if "x" in tensor else tensor  # "64x256xf8E4M3FN" -> "f8E4M3FN"


def dot_types(module_text: str) -> dict[str, int]:
    """Every stablehlo.dot_general in a lowered module by its element types, "lhs x rhs -> result" -> count."""
    counts: dict[str, int] = {}
    for lhs, rhs, out in DOT.findall(module_text):
        key = f"{_element_type(lhs)} x {_element_type(rhs)} -> {_element_type(out)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def widened_matrices(module_text: str) -> list[str]:
    """The converts that widen an 8-bit matrix (rank 2: a weight, or a layer of a stacked one) to another
    type, as "KxN i8 -> f32": what a dequantized weight feeding a float dot looks like. Activations are only
    narrowed to 8 bits; 8-bit KV pages (rank 5) are read by the attention and not matrices."""
    widened = []
    for source, target in CONVERT.findall(module_text):
        shape = source.split("x")[:-1]
        if _element_type(source) in EIGHT_BIT and len(shape) == 2 and _element_type(target) not in EIGHT_BIT:
            widened.append(f"{source.rsplit('x', 1)[0]} {_element_type(source)} -> {_element_type(target)}")
    return widened


def param_shapes(cfg: ModelConfig, dtype) -> dict:
    """The params pytree of `models/params.py` as ShapeDtypeStructs (what `weights` would load)."""
    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), model_param_shapes(cfg),
                        is_leaf=lambda node: isinstance(node, tuple))


def check_lowering(model_cfg: ModelConfig, engine_cfg: EngineConfig, params=None,
                   platform: str = "cuda", dump_dir: str | Path | None = None) -> list[LoweringResult]:
    """Lowers every bucket of both entry points for `platform`; one result per bucket, failures included.
    dump_dir: each module's text is written there as `{entry}-{bucket}.mlir`.

    params: shapes (or arrays) in `engine_cfg.dtype`, by default those of models/params.py.
    Raises ValueError (before lowering anything) if an explicit Pallas backend cannot run the model.
    """
    from pallas_kernels.lowering import custom_call_targets, misaligned_views, mosaic_kernels

    if platform not in PLATFORMS:
        raise ValueError(f"{platform=} is not one of {sorted(PLATFORMS)}")
    device = DeviceInfo.target(PLATFORMS[platform])
    resolved = resolve_config(engine_cfg, model_cfg, device, platform=PLATFORMS[platform],
                              dtype=resolve_dtype(engine_cfg.dtype, device))
    if params is None:
        params = param_shapes(model_cfg, resolved.engine.dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    runner = ModelRunner(model_cfg, resolved, params)
    results = []
    for kind, buckets in (("prefill", runner.prefill_buckets), ("decode", runner.decode_buckets)):
        for bucket in buckets:
            start = time.perf_counter()
            result = LoweringResult(kind, bucket, runner.attention_backend, ok=False, seconds=0.0)
            try:
                lowered = runner.lower(kind, bucket, platforms=(platform,))
                result.custom_calls = dict(custom_call_targets(lowered))
                result.kernels = mosaic_kernels(lowered)
                result.misaligned = misaligned_views(lowered)
                text = lowered.as_text()
                result.control_flow = control_flow_ops(text)
                result.dots, result.widened = dot_types(text), widened_matrices(text)
                if dump_dir is not None:
                    Path(dump_dir).mkdir(parents=True, exist_ok=True)
                    (Path(dump_dir) / f"{kind}-{bucket}.mlir").write_text(text)
                result.ok = True
            except Exception as e:  # noqa: BLE001 - report every bucket, whatever breaks
                result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            result.seconds = time.perf_counter() - start
            results.append(result)
    return results


def format_results(results: list[LoweringResult], platform: str) -> str:
    """A table: one row per bucket, what lowered with which attention backend, or why it failed."""
    rows = [("entry", "bucket", "attention", "lowered", "seconds", f"custom calls / kernels on {platform}")]
    for r in results:
        if r.ok:
            kernels = "; ".join(f"{k.name} ({'wgmma' if k.uses_wgmma else 'no wgmma'}, "
                                f"{'TMA' if k.uses_tma else 'no TMA'})" for k in r.kernels)
            calls = ", ".join(f"{name} x{n}" for name, n in sorted(r.custom_calls.items())) or "none"
            flow = ", ".join(f"{op} x{n}" for op, n in sorted(r.control_flow.items())) or "none"
            detail = calls + (f": {kernels}" if kernels else "") + f"; control flow outside kernels: {flow}"
            eight_bit = sum(n for key, n in r.dots.items() if key.split(" x ")[0] in EIGHT_BIT)
            if eight_bit or r.widened:
                detail += f"; 8-bit dots: {eight_bit}, 8-bit matrices widened: {len(r.widened)}"
            if r.misaligned:
                detail += "; kernel inputs XLA may pass unaligned: " + ", ".join(r.misaligned)
        else:
            detail = r.error
        rows.append((r.kind, str(r.bucket), r.attention_backend, "ok" if r.ok else "FAILED", f"{r.seconds:.1f}",
                     detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    num_failed = sum(not r.ok for r in results)
    lines.append(f"{len(results) - num_failed} of {len(results)} step functions lowered for {platform}")
    return "\n".join(lines)
