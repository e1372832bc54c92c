"""A weight update in progress (SGLang's ``update_weights_from_disk``): what it waits for, what it says.

Why it waits: a request that began with the old weights must end with them (its KV was computed by
them, and an RL rollout must be one policy's), so an update pauses admission, lets the running
requests finish (or aborts every request first, when asked), and reloads once none runs; requests
that arrive meanwhile wait and run on the new weights. Every TP rank sees the update arrive with the
same inputs and runs the same schedule, so all of them reach the quiet step together and reload at
that step. The KV cached before it was computed by the old weights: a successful reload flushes the
prefix cache.

The scheduler carries this out (its control side, ``scheduler.py``); this module holds the pending update and the
rules: when the scheduler is quiet enough, and the reply's shape (SGLang's ``success``, ``message``,
``num_paused_requests``, with the loaded ``model_path`` and ``weight_version`` for the front door).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.protocol.messages import WeightUpdate
from scheduler_proc.model_worker import LaunchedStep
from scheduler_proc.queues import RequestQueues

ABORTED_FOR_UPDATE = "aborted for a weight update"
DEFAULT_VERSION = "default"  # SGLang's --weight-version default


@dataclass
class PendingWeightUpdate:
    """An update received, waiting for the running requests to finish."""

    rid: str
    update: WeightUpdate


@dataclass
class ServedWeights:
    """Which checkpoint the model runner serves now, and the version the client gave it."""

    model_path: str
    weight_version: str = DEFAULT_VERSION

    def info(self) -> dict[str, str]:
        return {"model_path": self.model_path, "weight_version": self.weight_version}


def quiet(queues: RequestQueues, inflight: LaunchedStep | None) -> bool:
    """Nothing runs and nothing is in flight: the model may change (waiting requests hold no KV)."""
    return not queues.running and queues.chunked is None and inflight is None


def reply(success: bool, message: str, paused: int, served: ServedWeights) -> dict[str, Any]:
    """SGLang's reply, and what the front door reports afterwards (the served path and version)."""
    return {"success": success, "message": message, "num_paused_requests": paused, **served.info()}
