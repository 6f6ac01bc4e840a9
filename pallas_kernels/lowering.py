"""Looks inside a lowered JAX program for its Mosaic GPU kernels: names and the Hopper instructions used.

Lowering for CUDA on a CPU-only machine (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`)
runs Mosaic GPU's Python pipeline down to the NVVM/LLVM dialects and stores each kernel's module as
bytecode in a `mosaic_gpu_v2` custom call. Reading those modules back shows whether a kernel really
got the tensor-core (wgmma) and TMA instructions it was written for, and how it is launched: threads
per block (128 per warpgroup) and dynamic shared memory, the operands of the module's `gpu.launch`.
PTX assembly happens only on a GPU, so this is as far as a CPU machine can see.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
_INSTRUCTIONS = re.compile(r"wgmma\.mma_async[\w.]*|cp\.async\.bulk\.tensor\.[\w.]*|mbarrier\.try_wait[\w.]*"
                           r"|setmaxregister|cvt\.rn\.f16x2\.e4m3x2")
_LAUNCH = re.compile(r'"stable_mosaic_gpu\.gpu\.launch"\(%\w+((?:, %\w+){7})\)')  # token, grid xyz, block xyz, smem
_CONSTANT = re.compile(r'(%\w+) = "stable_mosaic_gpu\.arith\.constant"\(\) \{value = (\d+) : (?:index|i32)\}')
THREADS_PER_WARPGROUP = 128
_KERNEL_NAME = re.compile(r'sym_name = "(\w+)_mosaic_gpu"')


@dataclasses.dataclass(frozen=True)
class LoweredKernel:
    name: str  # the kernel_name given to plgpu.kernel
    instructions: tuple[str, ...]  # distinct wgmma / TMA / mbarrier-wait / setmaxregister / fp8-upcast ops
    threads_per_block: int = 0  # 0: no launch found
    smem_bytes: int = 0  # dynamic shared memory per block

    @property
    def warpgroups(self) -> int:
        return self.threads_per_block // THREADS_PER_WARPGROUP

    @property
    def uses_wgmma(self) -> bool:
        return any(i.startswith("wgmma") for i in self.instructions)

    @property
    def uses_tma(self) -> bool:
        return any(i.startswith("cp.async.bulk.tensor") for i in self.instructions)

    @property
    def upcasts_fp8(self) -> bool:
        """Whether it widens float8 e4m3 values (K/V tiles of fp8 pages) with Hopper's conversion."""
        return "cvt.rn.f16x2.e4m3x2" in self.instructions


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
        kernels.append(LoweredKernel(name.group(1) if name else "?", tuple(sorted(set(_INSTRUCTIONS.findall(text)))),
                                     *_launch_shape(text)))
    return kernels


def _launch_shape(text: str) -> tuple[int, int]:
    """(threads per block, dynamic SMEM bytes) from the module's gpu.launch, whose sizes are constants."""
    launch = _LAUNCH.search(text)
    if not launch:
        return 0, 0
    constants = {name: int(value) for name, value in _CONSTANT.findall(text[:launch.start()])}
    operands = [constants.get(name.strip()) for name in launch.group(1).split(",")[1:]]
    if None in operands[3:]:
        return 0, 0
    block_x, block_y, block_z, smem = operands[3:]
    return block_x * block_y * block_z, smem


def _register_mosaic_gpu_dialect(context) -> None:
    """Mosaic GPU's own types inside a memref (barriers, for one) parse only with its dialect registered:
    under JAX 0.11 a module read back without it failed with "invalid memref element type", about one
    lowering in three. Older JAX did without it."""
    try:
        from jax._src.lib import mosaic_gpu_dialect
    except ImportError:
        return
    mosaic_gpu_dialect.register_dialect(context)


# ----------------------------------------------------------------------------------------------
# Operands XLA may pass as views: a Mosaic GPU call refuses any buffer not aligned to 256 bytes

MOSAIC_GPU_ALIGNMENT = 256  # bytes: the custom call checks every input and output (jaxlib/mosaic/gpu)
_PASS_THROUGH = ("stablehlo.reshape", "stablehlo.bitcast_convert")  # a view of their operand, same bytes


def _bits(element_type) -> int:
    element_type = element_type.maybe_downcast() if hasattr(element_type, "maybe_downcast") else element_type
    width = getattr(element_type, "width", None)
    if width is None:
        raise ValueError(f"no bit width for {element_type}")
    return width


def _contiguous_offset(op) -> int | None:
    """A stablehlo.slice's byte offset into its operand when its elements are one contiguous run of
    the operand's (row-major) buffer, else None (XLA must copy it into a buffer of its own)."""
    source = ir.RankedTensorType(op.operands[0].type)
    starts = list(ir.DenseI64ArrayAttr(op.attributes["start_indices"]))
    limits = list(ir.DenseI64ArrayAttr(op.attributes["limit_indices"]))
    strides = list(ir.DenseI64ArrayAttr(op.attributes["strides"]))
    sizes = [hi - lo for lo, hi in zip(starts, limits)]
    full, partial_seen = source.shape, False
    for dim in reversed(range(len(sizes))):  # inner dims whole, then one partial, then only sizes of 1
        if partial_seen and sizes[dim] != 1:
            return None
        if sizes[dim] != full[dim] or strides[dim] != 1:
            if strides[dim] != 1 and sizes[dim] > 1:
                return None
            partial_seen = True
    offset, row = 0, _bits(source.element_type) // 8
    for dim in reversed(range(len(sizes))):
        offset += starts[dim] * row
        row *= full[dim]
    return offset


def misaligned_views(lowered, alignment: int = MOSAIC_GPU_ALIGNMENT) -> list[str]:
    """Operands of the program's Mosaic GPU calls that XLA may hand over as a view into another buffer
    at an offset that is not a multiple of `alignment` bytes; one description each, empty when none.

    XLA:GPU passes a contiguous slice (a row of a [5, S + 1] array, say) to a custom call as the address
    inside its source rather than copying it, and a Mosaic GPU kernel refuses an input that is not
    256-byte aligned ("Input buffer 1 is not 256-byte aligned", seen on an H200). Followed back through
    reshapes and bitcasts, and through a called function's arguments to each call site. Every dynamic
    slice is reported too: its offset is known only when it runs."""
    calls = collections.defaultdict(list)  # function name -> the ops that call it

    def index(op):
        for region in op.regions:
            for block in region:
                for child in block:
                    if child.name == "func.call":
                        calls[ir.FlatSymbolRefAttr(child.attributes["callee"]).value].append(child)
                    index(child)

    index(lowered.compiler_ir("stablehlo").operation)
    found = []

    def sources(value, seen):
        """The ops whose results `value` may be (through pass-through ops and function arguments)."""
        value = value.maybe_downcast() if hasattr(value, "maybe_downcast") else value
        if isinstance(value, ir.BlockArgument):
            arg = value
            parent = arg.owner.owner.operation
            if parent.name != "func.func":
                return
            name = ir.StringAttr(parent.attributes["sym_name"]).value
            for call in calls.get(name, ()):
                if (id(call), arg.arg_number) not in seen:
                    seen.add((id(call), arg.arg_number))
                    yield from sources(call.operands[arg.arg_number], seen)
            return
        op = value.owner.operation
        if op.name in _PASS_THROUGH:
            yield from sources(op.operands[0], seen)
        else:
            yield op

    for call in _custom_calls(lowered):
        if ir.StringAttr(call.attributes["call_target_name"]).value != MOSAIC_GPU_TARGET:
            continue
        for i, operand in enumerate(call.operands):
            for op in sources(operand, set()):
                if op.name == "stablehlo.slice":
                    offset = _contiguous_offset(op)
                    if offset is not None and offset % alignment:
                        found.append(f"input {i}: a contiguous slice at byte offset {offset} of "
                                     f"{op.operands[0].type}")
                elif op.name == "stablehlo.dynamic_slice":
                    found.append(f"input {i}: a dynamic slice of {op.operands[0].type} (offset unknown)")
    return sorted(set(found))
