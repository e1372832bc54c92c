"""The Python client of a tinyserve server: ``from runtime.client import Client`` (docs/serving.md).

``clients.py`` (``AsyncClient``), ``sync_client.py`` (``Client``, the blocking one on a loop thread), ``connection.py`` (one DEALER socket, its
liveness and reply routing), ``generate_call.py`` (what ``generate`` returns), ``errors.py``.
"""

from runtime.client.clients import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_IVL_S,
    HEARTBEAT_TIMEOUT_S,
    AsyncClient,
    GenerateCall,
    RequestError,
    RequestTimeout,
    ServerGone,
)
from runtime.client.sync_client import Client

__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEARTBEAT_IVL_S",
    "HEARTBEAT_TIMEOUT_S",
    "AsyncClient",
    "Client",
    "GenerateCall",
    "RequestError",
    "RequestTimeout",
    "ServerGone",
]
