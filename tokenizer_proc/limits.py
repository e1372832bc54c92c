"""The front door's size and fairness limits, in one place.

Why: one client must not be able to make the server slow for everyone else (issue 17).
Every cost a request can impose on the tokenizer's event loop, on the scheduler's input
queue or on the tokenizer's memory is bounded here before any work is done for it:

* frame size (``ZMQ_MAXMSGSIZE`` / the HTTP body): libzmq drops a connection whose frame
  header announces more than ``--max-request-bytes``, before reading it;
* prompt bytes: a text longer than the longest prompt could possibly be in bytes is
  ``too_long`` before it is tokenized; texts that are merely big are tokenized on a worker
  thread (``OFFLOAD_BYTES``), so no single request holds the event loop for long;
* stop strings: a bounded count and length (the scheduler checks each of them after
  every token);
* per client: requests in flight and control round trips waiting for the scheduler
  (counted by the RequestTable and ControlCalls), and the replies queued for it (the ROUTER's send high-water mark:
  a client that stops reading loses its own replies, nobody else's service).
"""

from __future__ import annotations

from pathlib import Path

from runtime.protocol.messages import GenerateReq

# A token of any tokenizer we serve spans far fewer bytes than this, so a text with more
# bytes than PROMPT_BYTES_PER_TOKEN * (the longest prompt in tokens) cannot fit.
PROMPT_BYTES_PER_TOKEN = 32
# Room in a frame for everything but the prompt (sampling params, rid, key, msgpack framing).
FRAME_OVERHEAD_BYTES = 1 << 20
# Texts at least this long are tokenized on the worker thread (about 3 ms of tokenizing).
OFFLOAD_BYTES = 4096
MAX_STOP_STRS = 64
MAX_STOP_STR_CHARS = 256
# Replies queued for one client beyond what its in-flight limits can produce in one burst.
SNDHWM_SLACK = 256


def default_max_request_bytes(model_path: str, context_length: int | None) -> int:
    """The default ``--max-request-bytes``: room for the longest prompt the model admits.

    Read from config.json before the scheduler reports its figures (the socket is bound
    first, so that a port conflict is reported at once)."""
    from runtime.engine.model_config import ModelConfig

    try:
        context_len = ModelConfig.from_pretrained(Path(model_path), context_length).context_len
    except Exception:  # an unreadable config fails later, in the scheduler, with its reason
        context_len = context_length or 131072
    return context_len * PROMPT_BYTES_PER_TOKEN + FRAME_OVERHEAD_BYTES


def max_prompt_bytes(max_req_input_len: int) -> int:
    """Longest text (UTF-8 bytes) worth tokenizing for a prompt of at most ``max_req_input_len`` tokens."""
    return max_req_input_len * PROMPT_BYTES_PER_TOKEN


def send_hwm(max_requests_per_client: int, max_controls_per_client: int) -> int:
    """Replies the ROUTER queues for one client: a step's worth for everything it may have
    in flight fits; past it the client is not reading, and its replies are dropped."""
    return max_requests_per_client + max_controls_per_client + SNDHWM_SLACK


def prompt_chars(req: GenerateReq) -> int:
    """Characters to tokenize for ``req`` (0 for token ids): how long it would hold the loop."""
    if req.text is not None:
        return len(req.text) + len(req.text_pair or "")
    if req.messages is not None:
        return sum(len(m["content"]) for m in req.messages if isinstance(m.get("content"), str))
    return 0
