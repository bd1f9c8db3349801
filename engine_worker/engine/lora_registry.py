"""The engine's LoRA adapters: which names are served, which are loaded in memory (an LRU of at
most max_cpu_loras), and which sit in the model's max_loras slots.

An adapter evicted from memory stays served: it is read again from its directory when a request
needs it. A slot is given to an adapter a step needs, taking a free slot or else the least recently
used one whose adapter no running request uses (the scheduler admits requests of at most max_loras
distinct adapters, so there is always one). An adapter removed while requests still use it keeps
serving them (it is "retiring") and is forgotten when the last one ends.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from engine_worker.model.lora_weights import LoraWeights

Loader = Callable[[str, str], LoraWeights]            # (name, path) -> weights, ValueError if bad
SlotWriter = Callable[[int, "dict | None"], None]     # (slot, LoraWeights.weights or None)


class LoraRegistry:
    def __init__(self, max_loras: int, max_cpu_loras: int, load: Loader, write_slot: SlotWriter):
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.max_cpu_loras = max_cpu_loras
        self._load, self._write_slot = load, write_slot
        self.paths: dict[str, str] = {}                          # served adapters
        self.retiring: dict[str, str] = {}                       # removed, still used by requests
        self.cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # loaded; least recently used first
        self.slots: list[str | None] = [None] * max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.num_loads = 0                                       # reads from disk (tests, stats)

    def add(self, name: str, path: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self.paths or name in self.retiring:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded"
                             + (" (still in use after its removal)" if name in self.retiring else ""))
        self._remember(self._read(name, str(path)))
        self.paths[name] = str(path)

    def remove(self, name: str, in_use: bool) -> bool:
        if name not in self.paths:
            return False
        path = self.paths.pop(name)
        if in_use:
            self.retiring[name] = path
        else:
            self._forget(name)
        return True

    def retire_unused(self, in_use: Iterable[str]) -> list[str]:
        """Forget removed adapters that no request uses any more; returns their names."""
        gone = [n for n in self.retiring if n not in set(in_use)]
        for name in gone:
            del self.retiring[name]
            self._forget(name)
        return gone

    def knows(self, name: str) -> bool:
        return name in self.paths

    def slot_map(self, needed: Iterable[str], running: Iterable[str]) -> dict[str, int]:
        """Slots for the adapters a step `needed`, loading those not in a slot; `running`: the
        adapters of every running request, whose slots are kept."""
        where = {name: slot for slot, name in enumerate(self.slots) if name is not None}
        keep = set(running) | set(needed)
        for name in needed:
            if name not in where:
                where[name] = self._fill(self._victim(keep), name)
            self.slot_lru.move_to_end(where[name])
        return {name: where[name] for name in needed}

    def _victim(self, keep: set[str]) -> int:
        for slot in self.slot_lru:
            if self.slots[slot] is None or self.slots[slot] not in keep:
                return slot
        raise RuntimeError(f"all {len(self.slots)} LoRA slots hold adapters of running requests")

    def _fill(self, slot: int, name: str) -> int:
        weights = self.cpu.get(name)
        if weights is None:
            weights = self._read(name, self.paths.get(name) or self.retiring[name])
            self._remember(weights)
        self.cpu.move_to_end(name)
        self._write_slot(slot, weights.weights)
        self.slots[slot] = name
        return slot

    def _read(self, name: str, path: str) -> LoraWeights:
        self.num_loads += 1
        return self._load(name, path)

    def _remember(self, weights: LoraWeights) -> None:
        self.cpu[weights.name] = weights
        self.cpu.move_to_end(weights.name)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)

    def _forget(self, name: str) -> None:
        self.cpu.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            self._write_slot(slot, None)
