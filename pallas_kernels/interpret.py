"""The one place that touches JAX's private GPU interpret mode (JAX 0.10.2): the kernels and their
tests reach it through this module.

`InterpretGPUParams` runs a Mosaic GPU kernel on the CPU, simulating shared memory, barriers and TMA
copies, and can detect races. In 0.10.2 it lives in a private module; if a JAX upgrade moves it, this
file is the only one to change.
"""

from __future__ import annotations

try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _interpret_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        "pallas_kernels needs JAX's Mosaic GPU interpret mode "
        "(jax._src.pallas.mosaic_gpu.interpret, JAX 0.10.x)"
    ) from e

__all__ = ["InterpretGPUParams", "interpret_params", "races_found", "reset_interpreter"]


def interpret_params(*, detect_races: bool = False, num_tma_copies: int = 1) -> InterpretGPUParams:
    """GPU interpret-mode settings for a kernel with up to `num_tma_copies` TMA copies in flight.

    The race detector keeps one vector clock per simulated TMA thread; copies that share a clock look
    ordered with each other, so a read that skipped its barrier can pass unnoticed. One TMA thread per
    copy in flight makes every copy's clock its own.
    """
    return InterpretGPUParams(detect_races=detect_races, num_tma_threads_per_device=max(1, num_tma_copies))


def races_found() -> bool:
    """Whether the most recently interpreted kernel (run with detect_races) had a data race."""
    return bool(_interpret_call.get_races().races_found)


def reset_interpreter() -> None:
    """Clears the interpreter's global state; needed after a kernel raised while interpreted."""
    _interpret_call.reset_gpu_interpret_mode_state()
