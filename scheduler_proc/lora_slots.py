"""The scheduler's adapters: which are loaded, which slot each batch's adapters sit in, who may run.

Why the scheduler decides slots: a batch may use at most ``--max-loras-per-batch`` adapters (the device
holds that many slots), and the decode step runs every running request at once, so the rule that
keeps every batch within the slots is an admission rule: a request joins the running ones only if
the adapters of the running, the chunked and the planned requests, its own and the pinned ones fit
in the slots; otherwise it waits (other requests may pass it). Which adapter sits in which slot is
then decided per batch here (least recently used unpinned slots are given up first), and the batch
carries the plan (``ForwardBatch.lora``) to the model runner, which writes the adapters it names.
Every TP rank runs the same schedule from the same inputs, so every rank's slots agree.

An adapter is known by its load id (``uid``): a name loaded again after an unload is a new adapter,
and the prefix cache keys requests by it (``namespace``), so no adapter (nor the base model) ever
reuses KV another computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from runtime.config.lora_args import LoraRef
from runtime.engine.forward_batch import LoraBatch
from scheduler_proc.req import Req

NAMESPACE_PREFIX = "lora:"


@dataclass
class LoadedAdapter:
    name: str
    uid: str
    path: str
    pinned: bool = False
    # The control request waiting for this adapter's requests to finish before it is unloaded.
    unloading_rid: str | None = None

    def info(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": self.path,
            "pinned": self.pinned,
            "unloading": self.unloading_rid is not None,
        }


def load_uid(name: str, load_count: int) -> str:
    """The load id of the ``load_count``-th adapter loaded (from 0: --lora-paths' in order), named ``name``."""
    return f"{name}#{load_count}"


def initial_adapters(refs: Sequence[LoraRef]) -> tuple[tuple[str, str], ...]:
    """``(uid, path)`` of --lora-paths' adapters, as ``LoraSlots`` registers them (the model runner's)."""
    return tuple((load_uid(ref.name, i), ref.path) for i, ref in enumerate(refs))


def namespace(uid: str) -> str:
    """The prefix cache's key namespace of requests on adapter ``uid``."""
    return NAMESPACE_PREFIX + uid


class LoraSlots:
    """The adapters loaded and the slot table (see the module docstring)."""

    def __init__(self, num_slots: int, max_loaded: int | None, refs: Sequence[LoraRef] = ()) -> None:
        self.num_slots = num_slots
        self.max_loaded = max_loaded
        self.adapters: dict[str, LoadedAdapter] = {}  # by name
        self.slot_uid: list[str | None] = [None] * num_slots
        self._written = [False] * num_slots  # the slot's adapter is in the device's buffers
        self._last_used: dict[str, int] = {}  # uid -> tick of the last batch (or load) that used it
        self._tick = 0
        self._loads = 0
        for ref in refs:
            self.add(ref)

    # ------------------------------------------------------------------ loaded adapters

    def next_uid(self, name: str) -> str:
        """The load id the next adapter loaded as ``name`` gets (the model runner loads it under it)."""
        return load_uid(name, self._loads)

    def add(self, ref: LoraRef) -> LoadedAdapter:
        """Register ``ref`` under ``next_uid`` (the model runner has it); a pinned adapter takes a slot now."""
        adapter = LoadedAdapter(ref.name, self.next_uid(ref.name), ref.path, ref.pinned)
        self._loads += 1
        self.adapters[ref.name] = adapter
        self._tick += 1
        self._last_used[adapter.uid] = self._tick
        if adapter.pinned:
            self._place(adapter.uid, keep=set())
        return adapter

    def remove(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.pop(name)
        for slot, uid in enumerate(self.slot_uid):
            if uid == adapter.uid:
                self.slot_uid[slot], self._written[slot] = None, False
        self._last_used.pop(adapter.uid, None)
        return adapter

    def pinned_count(self) -> int:
        return sum(a.pinned for a in self.adapters.values())

    def servable(self, name: str) -> LoadedAdapter | None:
        """The adapter requests may name now (None: not loaded, or being unloaded)."""
        adapter = self.adapters.get(name)
        return adapter if adapter is not None and adapter.unloading_rid is None else None

    def eviction_candidate(self, in_use: set[str]) -> LoadedAdapter | None:
        """The least recently used unpinned adapter no request uses (what a load past
        ``--max-loaded-loras`` gives up), or None."""
        idle = [a for a in self.adapters.values() if not a.pinned and a.uid not in in_use and a.unloading_rid is None]
        return min(idle, key=lambda a: self._last_used.get(a.uid, 0), default=None)

    def over_limit(self) -> bool:
        """Loading one more adapter would pass ``--max-loaded-loras``."""
        return self.max_loaded is not None and len(self.adapters) >= self.max_loaded

    def info(self) -> list[dict[str, object]]:
        return [adapter.info() for adapter in self.adapters.values()]

    # ------------------------------------------------------------------ admission and batches

    def admits(self, uid: str | None, in_use: Iterable[str | None]) -> bool:
        """Whether a request on ``uid`` (None: the base model) may join requests on ``in_use``: their
        adapters, its own and the pinned ones fit in the slots."""
        if uid is None:
            return True
        need = {u for u in in_use if u is not None} | {uid}
        pinned = {a.uid for a in self.adapters.values() if a.pinned}
        return len(need | pinned) <= self.num_slots

    def plan(self, reqs: Sequence[Req]) -> LoraBatch | None:
        """Slots for a batch of ``reqs`` (admission kept their adapters within the slots): each request's
        slot (-1: the base model) and the adapters to write first; None where no request has one."""
        uids = [req.lora_uid for req in reqs]
        distinct = list(dict.fromkeys(uid for uid in uids if uid is not None))
        if not distinct:
            return None
        self._tick += 1
        slot_of: dict[str, int] = {}
        for uid in distinct:
            slot_of[uid] = self._place(uid, keep=set(distinct))
            self._last_used[uid] = self._tick
        loads = []
        for uid in distinct:
            slot = slot_of[uid]
            if not self._written[slot]:
                loads.append((slot, uid))
                self._written[slot] = True
        return LoraBatch(slots=[slot_of[uid] if uid is not None else -1 for uid in uids], loads=loads)

    def _place(self, uid: str, keep: set[str]) -> int:
        """``uid``'s slot: the one it has, else a free one, else the least recently used slot whose
        adapter is unpinned and not in ``keep`` (the batch's own)."""
        if uid in self.slot_uid:
            return self.slot_uid.index(uid)
        pinned = {a.uid for a in self.adapters.values() if a.pinned}
        free = [s for s, u in enumerate(self.slot_uid) if u is None]
        if free:
            slot = free[0]
        else:
            candidates = [s for s, u in enumerate(self.slot_uid) if u not in pinned and u not in keep]
            if not candidates:
                raise RuntimeError(f"no LoRA slot for {uid}: admission let in more adapters than slots")
            slot = min(candidates, key=lambda s: self._last_used.get(self.slot_uid[s] or "", 0))
        self.slot_uid[slot], self._written[slot] = uid, False
        return slot
