"""Loading and unloading LoRA adapters at run time (SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``).

Why here and not in the front door: which adapters exist is the scheduler's to decide (every TP rank
sees the same control request among the same inputs and does the same), and an unload must wait for
the requests already accepted on the adapter: they finish on it, and only then is it dropped and its
name refused (``LoraSlots.servable`` refuses new requests from the moment the unload arrives). A
load past ``--max-loaded-loras`` gives up the least recently used unpinned adapter that no request
uses, after the new one loaded (a failed load changes nothing).

Replies carry SGLang's ``success`` and ``message`` and the adapters loaded afterwards
(``loaded_adapters``), which the front door keeps for its own checks and listings.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from runtime.config.lora_args import LoraRef
from runtime.protocol.messages import LoraControl, SchedControlOut
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.req import Req

logger = logging.getLogger(__name__)


class AdapterRunner(Protocol):
    def load_lora_adapter(self, uid: str, path: str) -> None: ...

    def unload_lora_adapter(self, uid: str) -> None: ...


class LoraAdapterControl:
    """Carries out load and unload requests on the scheduler's ``LoraSlots`` and the model runner."""

    def __init__(
        self,
        slots: LoraSlots,
        runner: AdapterRunner,
        live_requests: Callable[[], list[Req]],
        send: Callable[[SchedControlOut], None],
    ) -> None:
        self.slots = slots
        self.runner = runner
        self.live_requests = live_requests  # every request accepted and not finished
        self.send = send  # into the scheduler's outbox

    def _reply(self, rid: str, kind: str, success: bool, message: str, **extra: Any) -> None:
        payload = {"success": success, "message": message, "loaded_adapters": self.slots.info(), **extra}
        self.send(SchedControlOut(rid, kind, payload))

    def in_use(self) -> set[str]:
        return {req.lora_uid for req in self.live_requests() if req.lora_uid is not None}

    def load(self, rid: str, spec: LoraControl) -> None:
        name, slots = spec.lora_name, self.slots
        if not spec.lora_path:
            return self._reply(rid, "load_lora", False, "a load needs lora_path (the adapter's PEFT folder)")
        if name in slots.adapters:
            return self._reply(rid, "load_lora", False, f"a LoRA adapter named {name!r} is already loaded")
        if spec.pinned and slots.pinned_count() + 1 >= slots.num_slots:
            return self._reply(
                rid,
                "load_lora",
                False,
                f"at most --max-loras-per-batch - 1 ({slots.num_slots - 1}) adapters may be pinned "
                "(one slot stays for the others)",
            )
        victim = None
        if slots.over_limit():
            victim = slots.eviction_candidate(self.in_use())
            if victim is None:
                return self._reply(
                    rid,
                    "load_lora",
                    False,
                    f"{len(slots.adapters)} adapters are loaded, the most --max-loaded-loras allows, and every one "
                    "is pinned or in use: unload one first",
                )
        uid = slots.next_uid(name)
        try:
            self.runner.load_lora_adapter(uid, spec.lora_path)
        except (ValueError, OSError) as exc:  # LoraAdapterError names the folder and what is wrong
            return self._reply(rid, "load_lora", False, f"LoRA adapter {name!r} not loaded: {exc}")
        evicted = None
        if victim is not None:
            slots.remove(victim.name)
            self.runner.unload_lora_adapter(victim.uid)
            evicted = victim.name
            logger.info("LoRA adapter %r unloaded to make room (--max-loaded-loras %s)", victim.name, slots.max_loaded)
        slots.add(LoraRef(name, spec.lora_path, spec.pinned))
        logger.info("LoRA adapter %r loaded from %s%s", name, spec.lora_path, " (pinned)" if spec.pinned else "")
        self._reply(rid, "load_lora", True, f"Loaded LoRA adapter {name!r}.", evicted=evicted)

    def begin_unload(self, rid: str, spec: LoraControl) -> None:
        adapter = self.slots.adapters.get(spec.lora_name)
        if adapter is None or adapter.unloading_rid is not None:
            return self._reply(rid, "unload_lora", False, f"LoRA adapter {spec.lora_name!r} is not loaded")
        adapter.unloading_rid = rid  # (no new request may name it from now on)
        self.advance()

    def pending(self) -> bool:
        return any(a.unloading_rid is not None for a in self.slots.adapters.values())

    def advance(self) -> None:
        """Drop every adapter being unloaded whose requests have all finished, and answer its unload."""
        in_use = self.in_use()
        for adapter in [a for a in self.slots.adapters.values() if a.unloading_rid is not None]:
            if adapter.uid in in_use:
                continue
            self.slots.remove(adapter.name)
            self.runner.unload_lora_adapter(adapter.uid)
            logger.info("LoRA adapter %r unloaded", adapter.name)
            assert adapter.unloading_rid is not None
            self._reply(adapter.unloading_rid, "unload_lora", True, f"Unloaded LoRA adapter {adapter.name!r}.")
