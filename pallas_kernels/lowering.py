"""Looks inside a lowered JAX program for its Mosaic GPU kernels: names and the Hopper instructions used.

Lowering for CUDA on a CPU-only machine (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`)
runs Mosaic GPU's Python pipeline down to the NVVM/LLVM dialects and stores each kernel's module as
bytecode in a `mosaic_gpu_v2` custom call. Reading those modules back shows whether a kernel really
got the tensor-core (wgmma) and TMA instructions it was written for. PTX assembly happens only on a
GPU, so this is as far as a CPU machine can see.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
_INSTRUCTIONS = re.compile(r"wgmma\.mma_async[\w.]*|cp\.async\.bulk\.tensor\.[\w.]*|mbarrier\.try_wait[\w.]*")
_KERNEL_NAME = re.compile(r'sym_name = "(\w+)_mosaic_gpu"')


@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    name: str  # the kernel_name given to plgpu.kernel
    instructions: tuple[str, ...]  # distinct wgmma / TMA / mbarrier-wait instructions in its module

    @property
    def uses_wgmma(self) -> bool:
        return any(i.startswith("wgmma") for i in self.instructions)

    @property
    def uses_tma(self) -> bool:
        return any(i.startswith("cp.async.bulk.tensor") for i in self.instructions)


def _custom_calls(lowered):
    found = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for child in block:
                    if child.name == "stablehlo.custom_call":
                        found.append(child)
                    walk(child)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def custom_call_targets(lowered) -> collections.Counter:
    """call_target_name -> count, over the whole lowered program (loop bodies included once)."""
    return collections.Counter(ir.StringAttr(op.attributes["call_target_name"]).value for op in _custom_calls(lowered))


def mosaic_kernels(lowered) -> list[LoweredKernel]:
    """Every Mosaic GPU kernel in the lowered program, with the instructions its module contains."""
    kernels = []
    for op in _custom_calls(lowered):
        if ir.StringAttr(op.attributes["call_target_name"]).value != MOSAIC_GPU_TARGET:
            continue
        module_bytes = ir.StringAttr(ir.DictAttr(op.attributes["mhlo.backend_config"])["module"]).value_bytes
        context = jax_mlir.make_ir_context()
        context.allow_unregistered_dialects = True  # the serialized dialect is versioned ("stable_mosaic_gpu")
        _register_mosaic_gpu_dialect(context)
        with context:
            text = str(ir.Module.parse(module_bytes))
        name = _KERNEL_NAME.search(text)
        kernels.append(LoweredKernel(name.group(1) if name else "?", tuple(sorted(set(_INSTRUCTIONS.findall(text))))))
    return kernels


def _register_mosaic_gpu_dialect(context) -> None:
    """Mosaic GPU's own types inside a memref (barriers, for one) parse only with its dialect registered:
    under JAX 0.11 a module read back without it failed with "invalid memref element type", about one
    lowering in three. Older JAX did without it."""
    try:
        from jax._src.lib import mosaic_gpu_dialect
    except ImportError:
        return
    mosaic_gpu_dialect.register_dialect(context)
