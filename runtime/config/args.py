"""Server configuration, the public module: ``ServerArgs`` and the CLI flags (the ipc endpoints
are ``runtime.config.port_args``).

The flag names are SGLang's so that an SGLang user needs no translation; every flag is
documented in ``tinyserve --help`` (``python launch.py --help``) and in docs/serving.md. The code
is split by flag group (``runtime.config.server_args`` holds the dataclass and the order of the
checks; ``*_args`` one group each); this module is what the rest of the code imports, so that the
split stays an internal matter.
"""

from __future__ import annotations

from runtime.config.execution_args import ATTENTION_BACKEND_CHOICES, DEVICE_CHOICES, DTYPE_CHOICES, QUANTIZATION_CHOICES
from runtime.config.logging_args import LOG_LEVEL_CHOICES
from runtime.config.memory_args import EVICTION_POLICY_CHOICES, HICACHE_WRITE_POLICY_CHOICES
from runtime.config.parallel_args import LOAD_BALANCE_CHOICES
from runtime.config.scheduling_args import FALSE_FLAGS, SCHEDULE_POLICY_CHOICES
from runtime.config.server_args import ServerArgs, endpoint

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "DEVICE_CHOICES",
    "DTYPE_CHOICES",
    "EVICTION_POLICY_CHOICES",
    "FALSE_FLAGS",
    "HICACHE_WRITE_POLICY_CHOICES",
    "LOAD_BALANCE_CHOICES",
    "LOG_LEVEL_CHOICES",
    "QUANTIZATION_CHOICES",
    "SCHEDULE_POLICY_CHOICES",
    "ServerArgs",
    "endpoint",
]
