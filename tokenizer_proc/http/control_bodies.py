"""SGLang's bodies of the operational routes (``/abort_request``, ``/start_profile``,
``/update_weights_from_disk``), read the way SGLang reads them, and turned into the server's messages.

SGLang's own clients send these (its frontend language's ``RuntimeEndpoint`` sends a GET with no body
to start a profile; RL loops post weight updates), with SGLang's field names and defaults
(``sglang/srt/managers/io_struct.py``: ``AbortReq``, ``ProfileReq``, ``UpdateWeightFromDiskReqInput``).
Types are strict, so a client's mistake is a 400 naming the field. Fields this server does not serve
(SGLang's profiling by stage, an asynchronous update, ...) change nothing here: each is ignored with
one warning per name, and so is a field SGLang does not know either (routers add their own).
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

from fastapi import Request

from runtime.protocol.messages import ProfileOptions, WeightUpdate
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import read_body

PROFILER_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"  # SGLang's: where traces go when output_dir is not given
DEFAULT_PROFILER_DIR = "/tmp"  # (SGLang's default too)


class AbortBody(oai.LenientBody):
    """SGLang's ``AbortReq``: one request by its rid, or every request."""

    body_name: ClassVar[str] = "/abort_request"
    rid: str | None = None
    abort_all: bool = False
    abort_message: str | None = None  # the finish reason's message (SGLang's)


class ProfileBody(oai.LenientBody):
    """SGLang's ``ProfileReq`` (a profile start), the fields served here."""

    body_name: ClassVar[str] = "/start_profile"
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    profile_prefix: str | None = None

    def options(self) -> ProfileOptions:
        """SGLang's defaults filled in: the output folder from ``SGLANG_TORCH_PROFILER_DIR`` (else
        /tmp), stacks and shapes recorded unless the body or SGLang's environment switch says not
        (``SGLANG_PROFILE_WITH_STACK``, ``SGLANG_PROFILE_RECORD_SHAPES``), a time-stamp profile id."""
        if self.num_steps is not None and self.num_steps < 0:
            raise oai.BadRequest(f"num_steps: must be >= 0, got {self.num_steps}", "num_steps")
        profile_id = self.profile_id or str(time.time())
        return ProfileOptions(
            output_dir=self.output_dir or os.environ.get(PROFILER_DIR_ENV) or DEFAULT_PROFILER_DIR,
            profile_id=f"{self.profile_prefix}-{profile_id}" if self.profile_prefix else profile_id,
            num_steps=self.num_steps or None,  # (SGLang's: 0 is no limit)
            activities=self.activities,
            with_stack=self.with_stack is not False and _env_flag("SGLANG_PROFILE_WITH_STACK"),
            record_shapes=self.record_shapes is not False and _env_flag("SGLANG_PROFILE_RECORD_SHAPES"),
        )


class UpdateWeightsBody(oai.LenientBody):
    """SGLang's ``UpdateWeightFromDiskReqInput``, the fields served here."""

    body_name: ClassVar[str] = "/update_weights_from_disk"
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None

    def update(self) -> WeightUpdate:
        return WeightUpdate(
            model_path=self.model_path,
            load_format=self.load_format,
            weight_version=self.weight_version,
            abort_all_requests=self.abort_all_requests,
        )


async def optional_body(request: Request, model: type[ProfileBody], limit: int) -> ProfileBody:
    """The body, or the defaults when there is none (SGLang's frontend starts a profile with a GET)."""
    length = request.headers.get("content-length")
    if length in (None, "0") and "transfer-encoding" not in request.headers:
        return model()
    body: ProfileBody = await read_body(request, model, limit)
    return body


def _env_flag(name: str) -> bool:
    """SGLang's boolean switch ``name``: on unless set to false, 0 or no."""
    return os.environ.get(name, "true").strip().lower() not in ("false", "0", "no")
