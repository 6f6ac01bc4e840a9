"""Which adapters are known, which sit in the host cache, and which hold which device slot.

Pure host bookkeeping (no JAX, no device arrays): the model runner writes the weights `acquire` hands
it into the slot it names. Device slots are 1..max_loras (slot 0 is the base model: zeros). A running
request pins its adapter's slot; a slot no request pins is evicted least recently used first, when
another adapter needs it. The host cache keeps up to max_cpu_loras adapters' weights, least recently
used out first; an adapter that fell out is read again through `load` when it next needs a slot.
"""

from __future__ import annotations

import collections
from typing import Callable

from jaxserve.lora.peft_loader import AdapterWeights
from jaxserve.lora.request import LoRARequest


class LoRAResidency:
    """Adapters by name: registered (`add`/`remove`), cached on the host, resident in device slots."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load: Callable[[LoRARequest], AdapterWeights]):
        assert 1 <= max_loras <= max_cpu_loras, (max_loras, max_cpu_loras)
        self.max_loras, self.max_cpu_loras, self.load = max_loras, max_cpu_loras, load
        self._known: dict[str, LoRARequest] = {}
        self._host: collections.OrderedDict[str, AdapterWeights] = collections.OrderedDict()  # LRU first
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()  # resident, LRU first
        self._owner: dict[str, LoRARequest] = {}  # the request whose weights each resident name's slot holds
        self._pins: collections.Counter[str] = collections.Counter()
        self._removed: set[str] = set()  # removed while pinned: their slots are freed at the last release

    def add(self, lora: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Registers `lora` and reads it into the host cache (LoRAError if it cannot be served), or takes
        `weights` already read. The same request again does nothing; another request under a known name
        or id is a ValueError."""
        known = self._known.get(lora.name)
        if known == lora:
            return
        if known is not None:
            raise ValueError(f"a LoRA adapter named {lora.name!r} is already loaded, from {known.path!r} "
                             f"(lora_int_id={known.id}); unload it first")
        same_id = next((other for other in self._known.values() if other.id == lora.id), None)
        if same_id is not None:
            raise ValueError(f"lora_int_id={lora.id} of LoRA adapter {lora.name!r} is already the id of "
                             f"{same_id.name!r}")
        if lora.name in self._owner and self._owner[lora.name] != lora:
            raise ValueError(f"LoRA adapter {lora.name!r} was unloaded but requests still run with it; "
                             f"add it again once they finish")
        self._cache(lora.name, self.load(lora) if weights is None else weights)
        self._known[lora.name] = lora
        self._removed.discard(lora.name)

    def remove(self, name: str) -> bool:
        """Forgets adapter `name` (False if it was not known). Its slot is freed now, or once the
        requests running with it release it."""
        if self._known.pop(name, None) is None:
            return False
        self._host.pop(name, None)
        if self._pins[name]:
            self._removed.add(name)
        else:
            self._free(name)
        return True

    def known(self, name: str) -> LoRARequest | None:
        return self._known.get(name)

    def names(self) -> list[str]:
        """The registered adapters' names, in the order they were added."""
        return list(self._known)

    def acquire(self, lora: LoRARequest) -> tuple[int, AdapterWeights | None] | None:
        """Pins `lora` for one request: (its slot, the weights to write there, or None when the slot
        already holds them), or None when every slot is pinned by other adapters (the request waits).
        An unknown adapter is added first (LoRAError or ValueError as `add`)."""
        self.add(lora)
        if lora.name in self._slots:
            self._slots.move_to_end(lora.name)
            self._pins[lora.name] += 1
            return self._slots[lora.name], None
        slot = self._free_slot()
        if slot is None:
            return None
        weights = self._host.get(lora.name)
        if weights is None:
            weights = self.load(lora)
        self._cache(lora.name, weights)
        self._slots[lora.name], self._owner[lora.name] = slot, lora
        self._pins[lora.name] += 1
        return slot, weights

    def release(self, lora_name: str) -> None:
        """Unpins one request's hold on `lora_name`'s slot."""
        assert self._pins[lora_name] > 0, f"{lora_name!r} is not pinned"
        self._pins[lora_name] -= 1
        if not self._pins[lora_name]:
            del self._pins[lora_name]
            if lora_name in self._removed:
                self._removed.discard(lora_name)
                self._free(lora_name)

    def resident(self) -> dict[str, int]:
        """Slot of each adapter whose weights are on the device."""
        return dict(self._slots)

    def pinned(self, name: str) -> int:
        """How many requests hold `name`'s slot."""
        return self._pins[name]

    def cached(self) -> list[str]:
        """The adapters in the host cache, least recently used first."""
        return list(self._host)

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one (evicting its adapter), else None."""
        used = set(self._slots.values())
        empty = next((slot for slot in range(1, self.max_loras + 1) if slot not in used), None)
        if empty is not None:
            return empty
        victim = next((name for name in self._slots if not self._pins[name]), None)
        if victim is None:
            return None
        return self._free(victim)

    def _free(self, name: str) -> int | None:
        self._owner.pop(name, None)
        return self._slots.pop(name, None)

    def _cache(self, name: str, weights: AdapterWeights) -> None:
        self._host[name] = weights
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
