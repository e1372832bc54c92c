"""The model runner's adapters: those loaded (prepared in host memory) and the device slots a batch uses.

The scheduler decides which adapter sits in which slot (``scheduler_proc.lora_slots``: every TP rank
runs the same schedule, so every rank's slots agree) and hands each forward its plan
(``ForwardBatch.lora``: each request's slot and the adapters to write first). This manager carries it
out: it writes those adapters into their slots, turns the requests' slots into runs of the packed
token axis (``LoraSegments``) and sets them as the forward's context, which every adapted linear
reads (``LinearBase.add_lora``).

Adapters are named by a load id (``uid``: the adapter's name and its load count), never reused, so
that an adapter unloaded and loaded again under the same name is a new adapter to everything that
keys by it (the prefix cache's namespace).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runtime.checkpoints.lora_targets import LORA_TARGET_MODULES
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.lora.adapter import LoraAdapter, LoraAdapterError, read_adapter
from runtime.engine.lora.pool import LoraPool, PreparedAdapter, model_projections
from runtime.engine.ops.lora import LoraSegments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags as the model runner needs them: slots, the largest rank (None: the initial
    adapters'), the target projections (None: the initial adapters'; ``all``: every one the model
    has) and the adapters to load at start, as ``(uid, path)``."""

    slots: int
    max_rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    initial: tuple[tuple[str, str], ...] = field(default_factory=tuple)


class LoraManager:
    def __init__(self, model: nn.Module, settings: LoraSettings, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        read = {uid: read_adapter(path) for uid, path in settings.initial}
        rank = settings.max_rank or max((adapter.max_rank for adapter in read.values()), default=0)
        if rank <= 0:
            raise LoraAdapterError("--enable-lora without adapters at start needs --max-lora-rank")
        self.target_leaves = self._target_leaves(model, settings.target_modules, read.values())
        self.pool = LoraPool(model, settings.slots, rank, self.target_leaves, dtype, device)
        self.adapters: dict[str, PreparedAdapter] = {}
        for uid, adapter in read.items():
            self._add(uid, adapter)
        logger.info(
            "LoRA: %d slots of rank %d over %d linears (%s), %.1f MiB; %d adapter(s) loaded",
            settings.slots,
            rank,
            len(self.pool.linears),
            ", ".join(sorted(self.target_leaves)),
            self.pool.nbytes() / 2**20,
            len(self.adapters),
        )

    @staticmethod
    def _target_leaves(model: nn.Module, modules: tuple[str, ...] | None, adapters: Any) -> set[str]:
        if modules is not None and "all" in modules or modules is None and not any(True for _ in adapters):
            return {name.rpartition(".")[2] for name in model_projections(model)} & set(LORA_TARGET_MODULES)
        if modules is not None:
            return set(modules)
        leaves: set[str] = set()
        for adapter in adapters:
            leaves |= adapter.target_leaves
        return leaves

    @property
    def rank(self) -> int:
        return self.pool.rank

    def _add(self, uid: str, adapter: LoraAdapter) -> None:
        self.adapters[uid] = self.pool.prepare(adapter)

    def load(self, uid: str, path: str) -> None:
        """Read and prepare the adapter at ``path`` as ``uid`` (``LoraAdapterError`` naming what is wrong;
        nothing changes then)."""
        self._add(uid, read_adapter(path))

    def unload(self, uid: str) -> None:
        """Forget ``uid`` (the scheduler has freed its slot and no request uses it)."""
        self.adapters.pop(uid, None)

    def begin(self, batch: ForwardBatch) -> None:
        """Before ``batch``'s forward: its adapters in their slots, its runs as the linears' context."""
        plan = batch.lora
        if plan is None:
            self.pool.context.segments = None
            return
        for slot, uid in plan.loads:
            self.pool.write(slot, self.adapters[uid])
        lengths = batch.extend_lens_cpu or [1] * batch.batch_size
        segments = LoraSegments.from_runs(list(lengths), list(plan.slots), self.device)
        self.pool.context.segments = segments if segments.any_adapter else None

    def end(self) -> None:
        self.pool.context.segments = None

    def info(self) -> dict[str, Any]:
        """What ``server_info`` reports of the adapters on this rank."""
        return {
            "max_lora_rank": self.rank,
            "max_loras_per_batch": self.pool.slots,
            "target_modules": sorted(self.target_leaves),
            "slot_bytes": self.pool.nbytes(),
            "host_bytes": {uid: adapter.nbytes for uid, adapter in self.adapters.items()},
        }
