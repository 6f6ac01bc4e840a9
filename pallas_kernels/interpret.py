"""The one place that touches JAX's private GPU interpret mode (JAX 0.10.2): the kernels and their
tests reach it through this module.

`InterpretGPUParams` runs a Mosaic GPU kernel on the CPU, simulating shared memory, barriers and TMA
copies, and can detect races. In 0.10.2 it lives in a private module; if a JAX upgrade moves it, this
file is the only one to change.
"""

from __future__ import annotations

import functools

import jax

try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _interpret_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError as e:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        "pallas_kernels needs JAX's Mosaic GPU interpret mode "
        "(jax._src.pallas.mosaic_gpu.interpret, JAX 0.10.x)"
    ) from e

try:  # the runner of multi-warpgroup kernels (Pallas' shared interpreter thread map)
    from jax._src import core as _jax_core
    from jax._src.pallas.mosaic.interpret import thread_map as _thread_map
except ImportError:  # pragma: no cover - depends on the installed JAX
    _thread_map = None

__all__ = ["InterpretGPUParams", "interpret_params", "races_found", "reset_interpreter"]


@functools.lru_cache(maxsize=64)
def _warpgroup_runner(jaxpr, warpgroup: int):
    # One executable per warpgroup, not one per jaxpr: when a program's threads shared one, they
    # deadlocked here (each blocks inside it on barriers that the others must reach).
    del warpgroup

    def run(consts, *args):
        _jax_core.eval_jaxpr(jaxpr, consts, *args)  # its effects (the interpreter's callbacks) are the result

    return jax.jit(run)


def _run_warpgroup(jaxpr, consts, warpgroup, *args):
    _warpgroup_runner(jaxpr, int(warpgroup))(consts, warpgroup, *args)


def _compile_warpgroups_once() -> None:
    """A kernel with several warpgroups (`num_threads` > 1) runs each in its own Python thread, and JAX
    0.10.2 jits every (program, warpgroup) anew: a fresh closure each time misses jit's cache, about 2 s
    of XLA compilation per warpgroup and program on these CPUs. One jitted runner per (warpgroup jaxpr,
    warpgroup) runs the same jaxpr without the recompilations (a ragged parity case: ~50 s -> ~10 s).
    It replaces JAX's runner for the whole process, from the first kernel interpreted here on."""
    if _thread_map is not None and _thread_map._run_jaxpr is not _run_warpgroup:
        _thread_map._run_jaxpr = _run_warpgroup


def interpret_params(*, detect_races: bool = False, num_tma_copies: int = 1) -> InterpretGPUParams:
    """GPU interpret-mode settings for a kernel with up to `num_tma_copies` TMA copies in flight.

    The race detector keeps one vector clock per simulated TMA thread; copies that share a clock look
    ordered with each other, so a read that skipped its barrier can pass unnoticed. One TMA thread per
    copy in flight makes every copy's clock its own.
    """
    _compile_warpgroups_once()
    return InterpretGPUParams(detect_races=detect_races, num_tma_threads_per_device=max(1, num_tma_copies))


def races_found() -> bool:
    """Whether the most recently interpreted kernel (run with detect_races) had a data race."""
    return bool(_interpret_call.get_races().races_found)


def reset_interpreter() -> None:
    """Clears the interpreter's global state; needed after a kernel raised while interpreted."""
    _interpret_call.reset_gpu_interpret_mode_state()
