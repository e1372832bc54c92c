"""Every message that crosses a process boundary, as msgspec structs.

Each socket carries one tagged union, decoded with a typed
``msgspec.msgpack.Decoder``; no pickle anywhere. A frame that does not decode
is logged and dropped (or answered with an ErrorReply on the client socket).

Flows (docs/architecture.md):
  client --ClientRequest--> tokenizer --SchedulerInput--> scheduler(s)
  scheduler --DetokenizerInput--> detokenizer --TokenizerInput--> tokenizer
  tokenizer --ClientReply--> client
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from runtime.protocol.sampling_params import SamplingParams

# --------------------------------------------------------------------------- client-facing


class GenerateReq(msgspec.Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    """One generate call. Exactly one of text, input_ids, messages is set.

    ``sampling_params`` stays a plain dict here so the tokenizer can answer an
    unknown or mistyped field with an error that names it.
    """

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the tokenizer's template
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions, for the template
    chat_template_kwargs: dict[str, Any] | None = None  # chat: extra template variables (enable_thinking)
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs from this prompt position on (-1: none; SGLang's convention): with
    # return_logprob, the reply's meta has ``input_token_logprobs`` (and ``input_top_logprobs``).
    logprob_start_len: int = -1
    # SGLang's token_ids_logprob: token ids whose logprob the reply carries at every output position
    # (meta ``output_token_ids_logprobs``) and, with logprob_start_len, every prompt position from it on
    # (``input_token_ids_logprobs``); per position [[logprob, token_id], ...] in this order. With or
    # without return_logprob; at most 1024 ids, each in [0, vocab size).
    token_ids_logprob: list[int] | None = None
    # Larger runs first (SGLang's convention) with --enable-priority-scheduling; ignored without it.
    priority: int = 0
    api_key: str | None = None
    # Server-side deadline in seconds from arrival at the front door (None: --request-timeout, if
    # any): still waiting or running then, the request is aborted (finish_reason abort, "timeout").
    # Not the client's own ``timeout``, which only stops waiting for the reply.
    deadline_s: float | None = None
    # A max_new_tokens past the context's room is shortened to fit (the reply then stops for length)
    # instead of refused: Anthropic's clients (Claude Code) ask for their model's whole output budget.
    fit_max_tokens: bool = False
    # An embedding request (a server started with --is-embedding): the prompt is prefilled, never
    # decoded, and the reply's meta carries ``embedding``: the model's pooled, (normalised) hidden
    # state, or a cross-encoder's label scores. ``text_pair``: the second text of a cross-encoder's
    # pair (query, document), tokenized with ``text`` as the tokenizer joins pairs (token types 0/1).
    embed: bool = False
    text_pair: str | None = None
    # Cut a prompt longer than this many tokens to its first ones (-1: the model's positions)
    # instead of refusing it; None: refuse (vLLM's and SGLang's ``truncate_prompt_tokens``).
    truncate_prompt_tokens: int | None = None
    # The LoRA adapter to generate with, by the name it was loaded under (a server started with
    # --enable-lora / --lora-paths); None: the base model.
    lora_path: str | None = None


class AbortReq(msgspec.Struct, tag="abort", forbid_unknown_fields=True, omit_defaults=True):
    """Abort one request of this client by its rid, or with ``all`` every request on the server."""

    rid: str
    api_key: str | None = None
    all: bool = False


class FlushCacheReq(msgspec.Struct, tag="flush_cache", forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    api_key: str | None = None


class ServerInfoReq(msgspec.Struct, tag="server_info", forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    api_key: str | None = None


class HealthReq(msgspec.Struct, tag="health", forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    api_key: str | None = None


class ProfileOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a profile start asks for (SGLang's ``ProfileReq`` fields served here); the front door
    fills in the defaults, so every TP rank and DP replica profiles alike."""

    output_dir: str  # where each rank writes its Chrome trace
    profile_id: str  # the traces' file name stem (every rank's and replica's the same)
    num_steps: int | None = None  # stop by itself after this many forward steps; None: at the stop call
    activities: list[str] | None = None  # "CPU", "GPU"; None: the CPU, and the GPU where the device has one
    with_stack: bool = True
    record_shapes: bool = True


class ProfileReq(msgspec.Struct, tag="profile", forbid_unknown_fields=True, omit_defaults=True):
    """Start (``options`` given) or stop the torch profiler on every scheduler rank."""

    rid: str
    start: bool
    options: ProfileOptions | None = None  # with start
    api_key: str | None = None


class WeightUpdate(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A reload of the served weights in place (SGLang's ``update_weights_from_disk``)."""

    model_path: str  # the checkpoint folder (the front door resolved what the client named)
    load_format: str | None = None  # None / "auto": what the folder holds; "safetensors" or "gguf" to insist
    weight_version: str | None = None  # reported by /get_model_info and /server_info once loaded
    # Abort every request first (their replies end with abort); else running ones finish first.
    abort_all_requests: bool = False


class LoraControl(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Load or unload a LoRA adapter at run time (SGLang's ``/load_lora_adapter``, ``/unload_lora_adapter``)."""

    lora_name: str
    lora_path: str | None = None  # a load's PEFT folder
    pinned: bool = False  # a load's adapter keeps a slot for good


class LoraAdapterReq(msgspec.Struct, tag="lora_adapter", forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    load: bool  # False: unload
    adapter: LoraControl
    api_key: str | None = None


class UpdateWeightsReq(msgspec.Struct, tag="update_weights", forbid_unknown_fields=True, omit_defaults=True):
    rid: str
    update: WeightUpdate
    api_key: str | None = None


class TokenizeReq(msgspec.Struct, tag="tokenize", forbid_unknown_fields=True, omit_defaults=True):
    """A prompt's token ids as a generate request would be served them (``/tokenize``; Anthropic's
    ``count_tokens``): exactly one of ``text``, ``messages`` (rendered with the chat template, the
    generation prompt on unless ``chat_template_kwargs`` turns it off). ``add_special_tokens``: the
    tokenizer's BOS/EOS around a text (default on for a text, off for a rendered chat, whose template
    writes its own). Answered by the front door alone (``ControlReply`` kind ``tokenize``: ``tokens``,
    ``count``, ``max_model_len``)."""

    rid: str
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    api_key: str | None = None


class DetokenizeReq(msgspec.Struct, tag="detokenize", forbid_unknown_fields=True, omit_defaults=True):
    """Token ids back to text (``/detokenize``): ``ControlReply`` kind ``detokenize``, ``text``."""

    rid: str
    tokens: list[int]
    skip_special_tokens: bool = False
    api_key: str | None = None


ClientRequest = Union[
    GenerateReq,
    AbortReq,
    FlushCacheReq,
    ServerInfoReq,
    HealthReq,
    ProfileReq,
    UpdateWeightsReq,
    LoraAdapterReq,
    TokenizeReq,
    DetokenizeReq,
]


class ChunkMeta(msgspec.Struct, omit_defaults=True):
    """What an output carries beside its text and ids, from the scheduler's counts to the reply's
    logprobs; None: not part of this output (only the fields set travel). The Python client and
    SGLang's ``meta_info`` see the fields set as a dict (``as_dict``)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    index: int | None = None  # the sample's index among a request's n (only when n > 1)
    finish_reason: dict[str, Any] | None = None  # a finished sample's (as the chunk's own)
    latency: float | None = None  # a finished sample's seconds from arrival to its last output
    # A constrained request's first output: its grammar's compile time (0 when cached), and whether cached.
    grammar_compile_seconds: float | None = None
    grammar_cache_hit: bool | None = None
    # An embedding request's result: the pooled vector (or a cross-encoder's label scores), fp32.
    embedding: list[float] | None = None
    # Output logprobs: [logprob, token_id] per new id; per new id its k best [[logprob, token_id], ...];
    # token_ids_logprob: per new id [[logprob, token_id], ...] in the order of the request's ids.
    output_token_logprobs: list[list[float | int]] | None = None
    output_top_logprobs: list[list[list[float | int]]] | None = None
    output_token_ids_logprobs: list[list[list[float | int]]] | None = None
    # Prompt logprobs (a request's first output only; see ReqOutput): [logprob or None, token_id] per
    # prompt token, its k best (None for token 0), token_ids_logprob's lists (None for token 0).
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[float | int]] | None] | None = None
    input_token_ids_logprobs: list[list[list[float | int]] | None] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields set, by name."""
        return {name: value for name in self.__struct_fields__ if (value := getattr(self, name)) is not None}


class GenerateChunk(msgspec.Struct, tag="chunk", omit_defaults=True):
    """A stream delta, or the whole result when not streaming (then ``finished`` is True)."""

    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched": ...}
    meta: ChunkMeta = msgspec.field(default_factory=ChunkMeta)  # counts, latency, logprobs


class GenerateChunks(msgspec.Struct, tag="chunks"):
    """The chunks one scheduler step produced for several requests of one client, in one frame
    (a 64-request stream would otherwise cost the client 64 frames and wake-ups per token)."""

    chunks: list[GenerateChunk]


class ErrorReply(msgspec.Struct, tag="error"):
    rid: str
    code: str  # e.g. "invalid_request", "unauthorized", "too_long", "aborted", "internal"
    message: str


class ControlReply(msgspec.Struct, tag="control"):
    rid: str
    kind: str  # "flush_cache" | "server_info" | "health" | "abort" | "start_profile" | "stop_profile"
    # | "update_weights" | "load_lora" | "unload_lora" | "tokenize" | "detokenize"
    payload: dict[str, Any]


ClientReply = Union[GenerateChunk, GenerateChunks, ErrorReply, ControlReply]

# --------------------------------------------------------------------------- internal


class TokenizedGenerateReq(msgspec.Struct, tag="tokenized", omit_defaults=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position on; -1: none (checked by the tokenizer)
    token_ids_logprob: list[int] | None = None  # ids whose logprobs every position reports (checked; None: none)
    # Absolute time.monotonic() (CLOCK_MONOTONIC: system-wide, and every scheduler that receives
    # requests runs on the tokenizer's node) past which the scheduler aborts it; None: no deadline.
    deadline: float | None = None
    priority: int = 0  # larger first, with --enable-priority-scheduling (the scheduler ignores it otherwise)
    # An embedding request: prefilled, never decoded; its ReqOutput carries ``embedding``.
    embed: bool = False
    token_type_ids: list[int] | None = None  # an encoder's segment id per prompt token (None: all 0)
    lora_name: str | None = None  # the LoRA adapter it runs on (None: the base model)


class SchedAbortReq(msgspec.Struct, tag="sched_abort"):
    rid: str  # "" aborts every request (abort_all)
    # The finish message; "" is a client's abort. Under TP, rank 0's deadline expiries travel as
    # SchedAbortReq(rid, "timeout") with the inputs, so every rank aborts at the same step.
    reason: str = ""


class SchedControlReq(msgspec.Struct, tag="sched_control", omit_defaults=True):
    rid: str
    # "flush_cache" | "server_info" | "start_profile" (with ``profile``) | "stop_profile"
    # | "update_weights" (with ``weights``)
    kind: str
    profile: ProfileOptions | None = None
    weights: WeightUpdate | None = None
    lora: LoraControl | None = None  # "load_lora" / "unload_lora"


SchedulerInput = Union[TokenizedGenerateReq, SchedAbortReq, SchedControlReq]


class ReqOutput(msgspec.Struct, omit_defaults=True):
    """What one request produced since the last BatchTokenIDOut that mentioned it."""

    rid: str
    new_output_ids: list[int]
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[float] | None = None  # one per new output id, when asked
    # Pairs are [logprob, token_id]: ``float | int`` keeps the id an int through the typed decoder
    # (``float`` alone would decode it as a float).
    output_top_logprobs: list[list[list[float | int]]] | None = None  # per new id: [[logprob, token_id], ...]
    # token_ids_logprob: per new id, [[logprob, token_id], ...] in the order of the request's ids.
    output_token_ids_logprobs: list[list[list[float | int]]] | None = None
    # Prompt logprobs (in a request's first ReqOutput only): [logprob or None, token_id] per prompt
    # token from logprob_start_len on (None for token 0), and, with top_logprobs_num, per such token
    # None (token 0) or its k best [[logprob, token_id], ...] at the position before it.
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[float | int]] | None] | None = None
    # token_ids_logprob at the same prompt tokens (first ReqOutput only): None for token 0, else
    # [[logprob, token_id], ...] at the position before it, in the order of the request's ids.
    input_token_ids_logprobs: list[list[list[float | int]] | None] | None = None
    skip_special_tokens: bool = True
    stop_strs: list[str] | None = None  # the request's stop strings: the detokenizer holds back
    # any text that may be the start of one, and cuts the final text at the first match. Read
    # from a request's first ReqOutput only (the detokenizer keeps them in its state until the
    # request ends), so the scheduler need send them once, not with every chunk
    no_stop_trim: bool = False  # keep the matched stop string in the text
    # A constrained request's first ReqOutput: its grammar's compile time (0 when cached).
    grammar_compile_seconds: float | None = None
    grammar_cache_hit: bool = False
    # An embedding request's result (its only ReqOutput, finished): the pooled vector, fp32.
    embedding: list[float] | None = None


class BatchTokenIDOut(msgspec.Struct, tag="token_ids"):
    outputs: list[ReqOutput]


class SchedErrorOut(msgspec.Struct, tag="sched_error"):
    """A request the scheduler rejected or finished with an error; forwarded as ErrorReply."""

    rid: str
    code: str
    message: str


class SchedControlOut(msgspec.Struct, tag="sched_control_out"):
    rid: str
    kind: str
    payload: dict[str, Any]


DetokenizerInput = Union[BatchTokenIDOut, SchedErrorOut, SchedControlOut]


class StrOutput(msgspec.Struct, omit_defaults=True):
    rid: str
    text_delta: str
    new_output_ids: list[int]
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    meta: ChunkMeta = msgspec.field(default_factory=ChunkMeta)


class BatchStrOut(msgspec.Struct, tag="str_out"):
    outputs: list[StrOutput]


TokenizerInput = Union[BatchStrOut, SchedErrorOut, SchedControlOut]


# --------------------------------------------------------------------------- data parallelism


class KVEvent(msgspec.Struct, array_like=True):
    """A prefix-cache change on one replica (see memory.prefix_cache.KVCacheEvent)."""

    kind: str  # "stored" | "removed" | "cleared"
    token_ids: list[int]
    start: int
    extra_key: str | None = None
    tier: str = "device"  # "device" | "host" (the hierarchical cache's host tier)


class LoadReport(msgspec.Struct, tag="load"):
    """A replica's load and prefix-cache changes, sent to the DP controller after each step."""

    dp_rank: int
    num_running: int
    num_queued: int
    num_received: int = 0  # generate requests received since start (in-flight accounting)
    events: list[KVEvent] = []


ControllerInput = Union[LoadReport, SchedControlOut]
