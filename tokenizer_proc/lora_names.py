"""The LoRA adapters the front door lets requests name, and how it lists them.

The scheduler decides which adapters exist (``scheduler_proc.lora_control``); the front door keeps the
names it last heard of (the flags' at start, then every load and unload reply's ``loaded_adapters``)
so that a request naming an unknown adapter is answered 400 at once, and ``/v1/models`` can list each
adapter as a model ``BASE:ADAPTER``. A request that passes here while its adapter is being unloaded is
refused by the scheduler with the same code.
"""

from __future__ import annotations

from typing import Any, Sequence

from runtime.config.lora_args import LoraRef
from tokenizer_proc.rejected import Rejected


class LoraNames:
    def __init__(self, refs: Sequence[LoraRef]) -> None:
        self.adapters: dict[str, dict[str, Any]] = {
            ref.name: {"name": ref.name, "path": ref.path, "pinned": ref.pinned} for ref in refs
        }

    def update(self, payload: dict[str, Any]) -> None:
        """A load or unload reply: the adapters loaded afterwards."""
        loaded = payload.get("loaded_adapters")
        if isinstance(loaded, list):
            self.adapters = {str(a["name"]): dict(a) for a in loaded if not a.get("unloading")}

    def check(self, name: str) -> str:
        """``name`` if requests may use it now, else Rejected (400) naming it and the loaded ones."""
        if name not in self.adapters:
            loaded = ", ".join(repr(n) for n in self.adapters) or "none"
            raise Rejected(
                "invalid_request", f"lora_path: LoRA adapter {name!r} is not loaded (loaded: {loaded})", "lora_path"
            )
        return name


def check_adapter(names: LoraNames | None, name: str | None) -> str | None:
    """The adapter a request names, checked (None: the base model)."""
    if name is None:
        return None
    if names is None:
        raise Rejected(
            "invalid_request",
            f"lora_path: LoRA adapter {name!r} cannot be served: this server has no adapters (start it with "
            "--enable-lora or --lora-paths)",
            "lora_path",
        )
    return names.check(name)
