"""LoRA adapters in the engine core: one registry of adapters for the engine's API, request validation
and the scheduler, and the slot writes each step carries to the device.

`EngineLoRA` wraps the host bookkeeping (`lora/residency.py`: adapters registered, the host cache, which
adapter sits in which device slot and how many running requests pin it) behind one lock, because a
request is validated on its caller's thread (`LLMEngine.make_request`, from the server) while the
engine's thread admits and finishes requests. The scheduler acquires a slot for a request when it
admits it (a request whose adapter finds every slot pinned by others waits) and releases it when the
request finishes or is preempted; an adapter newly placed in a slot is queued here as a slot write,
which the engine hands to the runner before the step that first reads it (`runner/lora_slots.py`).

Not here: reading PEFT directories (lora/peft_loader.py), the device arrays and the math
(runner/lora_slots.py, ops/lora.py), the prefix cache's adapter seed (request.py, page_pool.py).
"""

from __future__ import annotations

import collections
import threading
import time

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.errors import InvalidParameter
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft_loader import AdapterWeights, load_adapter
from jaxserve.lora.residency import LoRAResidency


class EngineLoRA:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig):
        self.max_loras = cfg.max_loras
        self._load = lambda lora: load_adapter(lora.lora_path, model_cfg, cfg.max_lora_rank, name=lora.lora_name)
        max_cpu_loras = cfg.max_cpu_loras if cfg.max_cpu_loras is not None else cfg.max_loras
        self._residency = LoRAResidency(cfg.max_loras, max_cpu_loras, self._load)
        self._lock = threading.Lock()
        self._writes: list[tuple[int, AdapterWeights]] = []  # (slot, weights) not on the device yet
        self.num_slot_writes = 0  # adapters written into device slots so far (loads and reloads)

    # -- the engine's API (any thread) ----------------------------------------------------------------

    def add(self, lora: LoRARequest) -> None:
        """Registers and loads an adapter (idempotent); LoRAError if it cannot be served, ValueError if its
        name is taken by another. Its files are read outside the lock, which the scheduler takes every
        step: loading a large adapter never holds up the steps of the requests already running."""
        with self._lock:
            if self._residency.known(lora.lora_name) == lora:
                return
        weights = self._load(lora)
        with self._lock:
            self._residency.add(lora, weights)

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._residency.remove(name)

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return [self._residency.known(name) for name in self._residency.names()]

    def resident(self) -> dict[str, int]:
        with self._lock:
            return dict(self._residency.resident())

    # -- the scheduler's (the engine's thread) ------------------------------------------------------------

    def acquire(self, lora: LoRARequest) -> int | None:
        """Pins the adapter's device slot for one request and returns it (1..max_loras), queueing its
        weights for writing if it was not in that slot; None when every slot is pinned by other adapters."""
        with self._lock:
            got = self._residency.acquire(lora)
            if got is None:
                return None
            slot, weights = got
            if weights is not None:
                self._writes = [(s, w) for s, w in self._writes if s != slot] + [(slot, weights)]
            return slot

    def release(self, lora: LoRARequest) -> None:
        with self._lock:
            self._residency.release(lora.lora_name)

    def take_writes(self) -> list[tuple[int, AdapterWeights]]:
        """The slot writes queued since the last call, for the device."""
        with self._lock:
            writes, self._writes = self._writes, []
        self.num_slot_writes += len(writes)
        return writes

    def stats(self, running, waiting) -> dict:
        """vLLM's lora_requests_info: the adapters of the running and of the waiting requests, max_lora,
        and when (time.time()); with the requests per adapter and each resident adapter's slot."""
        count = lambda requests: collections.Counter(r.lora_request.lora_name for r in requests  # noqa: E731
                                                     if r.lora_request is not None)
        on_device, in_waiting = count(running), count(waiting)
        return {"running_lora_adapters": sorted(on_device), "waiting_lora_adapters": sorted(in_waiting),
                "max_lora": self.max_loras, "time": time.time(), "running": dict(on_device),
                "waiting": dict(in_waiting), "resident": self.resident(), "num_slot_writes": self.num_slot_writes}


def check_lora_request(lora: EngineLoRA | None, request: LoRARequest | None) -> None:
    """A request's adapter, validated before the request is queued (any thread): registered and loaded if
    new (LoRAError if it cannot be served); a name taken by another adapter is a ValueError naming it."""
    if request is None:
        return
    if lora is None:
        raise InvalidParameter("lora_request", "LoRA adapters need enable_lora (--enable-lora)")
    if not isinstance(request, LoRARequest):
        raise InvalidParameter("lora_request", f"expected a LoRARequest, got {type(request).__name__}")
    lora.add(request)


def lora_api(lora: EngineLoRA | None, call: str) -> EngineLoRA:
    """The engine's adapters for one of its LoRA calls; a ValueError naming enable_lora without them."""
    if lora is None:
        raise ValueError(f"{call} needs enable_lora (--enable-lora)")
    return lora
