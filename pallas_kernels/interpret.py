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

try:  # the runner of multi-warpgroup kernels (Pallas' shared interpreter thread map), and its callbacks
    from jax._src import callback as _callback
    from jax._src import config as _config
    from jax._src import core as _jax_core
    from jax._src.pallas.mosaic.interpret import thread_map as _thread_map
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as _gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as _jaxpr_interpret
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


@functools.cache
def _thread_settings() -> list:
    """Every JAX setting a thread can override (the flags and the mesh and axis contexts), but the
    default device and those whose override also reaches the runtime (transfer guards and the like)."""
    states = {id(s): s for s in [*_config.config_states.values(), *vars(_config).values()]
              if isinstance(s, _config.config_ext.Config)}
    return [s for s in states.values()
            if s is not _config.default_device and getattr(s, "_update_thread_local_hook", None) is None]


def _without_thread_settings(host_callback):
    """`host_callback` run under the process-wide JAX settings only, as on a thread of XLA's own.

    XLA runs an interpreted kernel's host callbacks on the thread that called the kernel when it runs
    the kernel inline, on one of its own when an input was still in flight: a race. The callbacks' eager
    jnp ops (`jnp.array` of a numpy buffer) compile one executable per thread-local JAX setting (JAX keys
    its op cache on them), so a caller inside `with jax.default_matmul_precision(...)` got a compilation
    on a later call whenever a callback first ran on the other kind of thread. The default device stays:
    io_callback itself sets it to the CPU around each callback."""
    settings = _thread_settings()

    @functools.wraps(host_callback)
    def run(*args, **kwargs):
        callers = [state.swap_local(_config.config_ext.unset) for state in settings]
        try:
            return host_callback(*args, **kwargs)
        finally:
            for state, value in zip(settings, callers):
                state.set_local(value)

    return run


class _InterpreterCallbacks:
    """`jax._src.callback` as the interpreter's modules see it: their io_callbacks ignore thread settings."""

    def __getattr__(self, name):
        return getattr(_callback, name)

    @staticmethod
    def io_callback(host_callback, *args, **kwargs):
        return _callback.io_callback(_without_thread_settings(host_callback), *args, **kwargs)


def _patch_interpreter_once() -> None:
    """Two changes to JAX's interpreter, for the whole process from the first kernel interpreted here on.

    A kernel with several warpgroups (`num_threads` > 1) runs each in its own Python thread, and JAX
    0.10.2 jits every (program, warpgroup) anew: a fresh closure each time misses jit's cache, about 2 s
    of XLA compilation per warpgroup and program on these CPUs. One jitted runner per (warpgroup jaxpr,
    warpgroup) runs the same jaxpr without the recompilations (a ragged parity case: ~50 s -> ~10 s).
    And its host callbacks ignore the settings of the thread they run on (`_without_thread_settings`)."""
    if _thread_map is not None and _thread_map._run_jaxpr is not _run_warpgroup:
        _thread_map._run_jaxpr = _run_warpgroup
        for module in (_thread_map, _gpu_callbacks, _jaxpr_interpret, _interpret_call):
            module.callback = _InterpreterCallbacks()


def interpret_params(*, detect_races: bool = False, num_tma_copies: int = 1) -> InterpretGPUParams:
    """GPU interpret-mode settings for a kernel with up to `num_tma_copies` TMA copies in flight.

    The race detector keeps one vector clock per simulated TMA thread; copies that share a clock look
    ordered with each other, so a read that skipped its barrier can pass unnoticed. One TMA thread per
    copy in flight makes every copy's clock its own.
    """
    _patch_interpreter_once()
    return InterpretGPUParams(detect_races=detect_races, num_tma_threads_per_device=max(1, num_tma_copies))


def races_found() -> bool:
    """Whether the most recently interpreted kernel (run with detect_races) had a data race."""
    return bool(_interpret_call.get_races().races_found)


def reset_interpreter() -> None:
    """Clears the interpreter's global state; needed after a kernel raised while interpreted."""
    _interpret_call.reset_gpu_interpret_mode_state()
