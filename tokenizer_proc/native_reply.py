"""SGLang's native ``/generate`` reply, as SGLang's own server answers: per sample ``text``,
``output_ids`` and ``meta_info`` with SGLang's keys (``id``, ``finish_reason``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``e2e_latency``, ``weight_version`` and, when asked, the
logprob lists), whole or as a stream whose every event holds everything so far (SGLang's default,
non-incremental streaming: its frontend cuts each event's new text off by length).

Logprob entries are SGLang's triples ``[logprob, token_id, text]``: the text of the one token
when the request set ``return_text_in_logprobs``, else null; ids are integers. A position with
no logprob (the first prompt token) has a null logprob; a position with no top-k list (the same
token) is null in the top lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.protocol.messages import GenerateChunk, GenerateReq

# (ChunkMeta field, which is SGLang's meta_info key too; whether its entries are top-k lists): the
# logprob lists a chunk's meta may carry, output ones accumulated over a stream's chunks, input ones sent once.
OUTPUT_LISTS = (("output_token_logprobs", False), ("output_top_logprobs", True), ("output_token_ids_logprobs", True))
INPUT_LISTS = (("input_token_logprobs", False), ("input_top_logprobs", True), ("input_token_ids_logprobs", True))
# Our meta keys that SGLang names otherwise or that are not a sample's (``index`` is the event's).
_NOT_META = {key for key, _ in OUTPUT_LISTS + INPUT_LISTS} | {"index", "latency"}


@dataclass
class SampleSoFar:
    """One sample's reply so far: the text, output ids and output logprob lists of all its chunks."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    lists: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, chunk: GenerateChunk) -> None:
        self.text += chunk.text
        self.output_ids.extend(chunk.output_ids)
        for key, _ in OUTPUT_LISTS:
            got = getattr(chunk.meta, key)
            if got is not None:
                self.lists.setdefault(key, []).extend(got)
        for key, _ in INPUT_LISTS:
            got = getattr(chunk.meta, key)
            if got is not None:
                self.lists[key] = list(got)


class NativeReplies:
    """Builds SGLang's reply objects for the requests of one ``/generate`` call."""

    def __init__(
        self,
        reqs: list[GenerateReq],
        token_text: Callable[[int], str],
        with_text: bool,
        weight_version: str,
    ) -> None:
        self.reqs = {req.rid: req for req in reqs}
        self.token_text = token_text
        self.with_text = with_text
        self.weight_version = weight_version

    def result(self, chunk: GenerateChunk, sample: SampleSoFar) -> dict[str, Any]:
        """``sample``'s reply after ``chunk`` (its latest, already added)."""
        return {"text": sample.text, "output_ids": list(sample.output_ids), "meta_info": self.meta_info(chunk, sample)}

    def meta_info(self, chunk: GenerateChunk, sample: SampleSoFar) -> dict[str, Any]:
        meta = {key: value for key, value in chunk.meta.as_dict().items() if key not in _NOT_META}
        meta["id"] = chunk.rid
        meta["finish_reason"] = chunk.finish_reason if chunk.finished else None
        meta["weight_version"] = self.weight_version
        if chunk.finished and chunk.meta.latency is not None:
            meta["e2e_latency"] = chunk.meta.latency
        req = self.reqs.get(chunk.rid)
        if req is not None and req.return_logprob:  # SGLang always has both plain lists then
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
        for key, top in INPUT_LISTS + OUTPUT_LISTS:
            if key in sample.lists:
                convert = self.top_entries if top else self.entry
                meta[key] = [convert(item) for item in sample.lists[key]]
        return meta

    def entry(self, pair: list[Any]) -> list[Any]:
        """``[logprob, id]`` -> SGLang's ``[logprob, id, text|null]`` (a null logprob stays null)."""
        logprob, token_id = pair[0], int(pair[1])
        return [
            None if logprob is None else float(logprob),
            token_id,
            self.token_text(token_id) if self.with_text else None,
        ]

    def top_entries(self, pairs: list[list[Any]] | None) -> list[list[Any]] | None:
        return None if pairs is None else [self.entry(pair) for pair in pairs]
