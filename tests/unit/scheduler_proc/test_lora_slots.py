"""The scheduler's adapter rules (``scheduler_proc.lora_slots``, ``scheduler_proc.lora_control``).

``LoraSlots`` alone: admission with pinned adapters, each request's slot in a batch's plan, an adapter
written once until its slot is given to another, least-recently-used eviction of unpinned slots the
batch does not use (pinned ones never), load ids never reused, and the adapter a load past
``--max-loaded-loras`` gives up. Then the same rules through a real scheduler and model runner:
``--max-loras-per-batch 2`` with three adapters queued never puts more than two adapters in a batch
and every request still equals peft; ``--max-loaded-loras`` evicts the least recently used idle
adapter on a load (its name refused after), refuses a load when every adapter is pinned or in use,
and a failed load evicts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.config.lora_args import LoraRef
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import (
    BatchTokenIDOut,
    LoraControl,
    SchedControlOut,
    SchedControlReq,
    SchedErrorOut,
    TokenizedGenerateReq,
)
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.lora_slots import LoraSlots, namespace
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import hf_greedy
from tests.support.lora_adapters import peft_model
from tests.support.stub_scheduler import assert_idle_invariant
from tests.unit.scheduler_proc.test_lora_scheduler import adapters_for, lora_runner, prompts

MAX_NEW = 6


def reqs(*uids: str | None) -> list[Any]:
    """Requests as ``LoraSlots.plan`` reads them (only their adapter's load id)."""
    return [SimpleNamespace(lora_uid=uid) for uid in uids]


def slots_of(
    names: list[str], num_slots: int, pinned: tuple[str, ...] = (), max_loaded: int | None = None
) -> LoraSlots:
    return LoraSlots(num_slots, max_loaded, [LoraRef(n, f"/adapters/{n}", n in pinned) for n in names])


def uid(slots: LoraSlots, name: str) -> str:
    return slots.adapters[name].uid


# ---- LoraSlots alone ---------------------------------------------------------------------


def test_admission_counts_the_pinned_adapters() -> None:
    slots = slots_of(["p", "a", "b", "c"], num_slots=3, pinned=("p",))
    p, a, b, c = (uid(slots, n) for n in "pabc")
    assert slots.admits(None, [a, b, c])  # the base model needs no slot
    assert slots.admits(a, [b, None])  # a, b and the pinned p: three slots
    assert not slots.admits(c, [a, b])  # a fourth adapter
    assert slots.admits(a, [a, b, None, b])  # already among them
    assert slots.admits(p, [a, b])  # the pinned one has its slot anyway
    unpinned = slots_of(["a", "b", "c"], num_slots=2)
    a, b, c = (uid(unpinned, n) for n in "abc")
    assert unpinned.admits(b, [a]) and not unpinned.admits(c, [a, b])


def test_plan_writes_each_adapter_once_until_its_slot_goes_to_another() -> None:
    slots = slots_of(["a", "b", "c"], num_slots=2)
    a, b, c = (uid(slots, n) for n in "abc")
    assert slots.plan(reqs(None, None)) is None  # no adapter: no plan
    first = slots.plan(reqs(a, None, b, a))
    assert first is not None and first.slots == [0, -1, 1, 0] and first.loads == [(0, a), (1, b)]
    again = slots.plan(reqs(b))
    assert again is not None and again.slots == [1] and again.loads == []  # written already
    third = slots.plan(reqs(None, c))  # a is the least recently used: its slot goes to c
    assert third is not None and third.slots == [-1, 0] and third.loads == [(0, c)]
    back = slots.plan(reqs(b, a))  # a's slot is c's now: a is written again, into c's (b's is the batch's)
    assert back is not None and back.slots == [1, 0] and back.loads == [(0, a)]
    assert slots.plan(reqs(b, a)).loads == []  # type: ignore[union-attr]


def test_eviction_spares_the_batch_own_adapters_even_when_least_recently_used() -> None:
    slots = slots_of(["a", "b", "c"], num_slots=2)
    a, b, c = (uid(slots, n) for n in "abc")
    slots.plan(reqs(a))
    slots.plan(reqs(b))  # a is now the least recently used slot
    plan = slots.plan(reqs(a, c))  # ... but this batch uses a: b's slot goes to c
    assert plan is not None and plan.slots == [0, 1] and plan.loads == [(1, c)]
    assert slots.slot_uid == [a, c]


def test_pinned_slots_are_never_given_up() -> None:
    slots = slots_of(["p", "a", "b"], num_slots=2, pinned=("p",))
    p, a, b = (uid(slots, n) for n in "pab")
    assert slots.slot_uid == [p, None]  # a pinned adapter takes its slot when it is loaded
    for _ in range(3):  # p is the least recently used throughout, and keeps its slot
        for name in (a, b):
            plan = slots.plan(reqs(name))
            assert plan is not None and plan.slots == [1] and plan.loads == [(1, name)]
    first_use = slots.plan(reqs(p, b))
    assert first_use is not None and first_use.slots == [0, 1] and first_use.loads == [(0, p)]
    assert slots.slot_uid == [p, b]
    with pytest.raises(RuntimeError, match="admission let in more adapters than slots"):
        slots.plan(reqs(a, b))  # (what admission prevents: no unpinned slot outside the batch)


def test_load_ids_are_never_reused() -> None:
    slots = slots_of(["a"], num_slots=2)
    first = uid(slots, "a")
    plan = slots.plan(reqs(first))
    assert plan is not None and plan.loads == [(0, first)]
    seen = {first}
    for round_ in range(3):
        slots.remove("a")
        assert slots.servable("a") is None and slots.slot_uid == [None, None]
        again = slots.add(LoraRef("a", f"/adapters/a-v{round_}")).uid
        assert again not in seen and namespace(again) not in {namespace(u) for u in seen}
        seen.add(again)
        plan = slots.plan(reqs(again))  # the same slot, written again: it is another adapter
        assert plan is not None and plan.slots == [0] and plan.loads == [(0, again)]


def test_eviction_candidate_for_max_loaded_loras() -> None:
    slots = slots_of(["p", "a", "b"], num_slots=4, pinned=("p",), max_loaded=3)
    a, b = uid(slots, "a"), uid(slots, "b")
    assert slots.over_limit()
    slots.plan(reqs(a))  # b (loaded after a) is now the least recently used
    candidate = slots.eviction_candidate(in_use=set())
    assert candidate is not None and candidate.name == "b"
    in_use = slots.eviction_candidate(in_use={b})
    assert in_use is not None and in_use.name == "a"
    assert slots.eviction_candidate(in_use={a, b}) is None  # p is pinned: nothing to give up
    slots.adapters["b"].unloading_rid = "unload-b"  # (being unloaded already: not a candidate)
    unloading = slots.eviction_candidate(in_use={a})
    assert unloading is None
    assert not slots_of(["a", "b"], num_slots=2).over_limit()  # no --max-loaded-loras


# ---- through the scheduler -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_checkpoints: Any) -> Path:
    return Path(tiny_checkpoints.path("llama"))


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: Any) -> dict[str, Path]:
    """attn8, all4, mlp16: test_lora_scheduler.py's three adapters of the tiny Llama."""
    return adapters_for(tiny_checkpoints, "llama")


def lora_scheduler(
    llama: Path, adapters: dict[str, Path], entries: list[str], slots: int, **flags: Any
) -> tuple[Scheduler, ModelRunner]:
    """A serial scheduler over a fresh runner with ``--lora-paths entries`` (``adapters``: the order
    the runner loads them, as the entries name them), ``slots`` adapter slots and rank up to 16 (the
    largest of the adapters, some loaded at run time)."""
    runner, _ = lora_runner(llama, adapters, slots=slots, max_rank=16)
    args = ServerArgs(
        max_total_tokens=runner.max_total_tokens,
        disable_overlap_schedule=True,
        lora_paths=entries,
        max_loras_per_batch=slots,
        max_lora_rank=16,
        **flags,
    )
    return Scheduler(args, model_runner=runner), runner


def submit(sched: Scheduler, rid: str, prompt: list[int], adapter: str | None) -> None:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params, lora_name=adapter))


def control(sched: Scheduler, rid: str, kind: str, name: str, path: Path | None = None) -> None:
    spec = LoraControl(lora_name=name, lora_path=str(path) if path is not None else None)
    sched.handle_message(SchedControlReq(rid=rid, kind=kind, lora=spec))


class Outcomes:
    """What a scheduler answered: each request's tokens (or error) and each control reply."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.errors: dict[str, str] = {}
        self.replies: dict[str, dict[str, Any]] = {}

    def take(self, sched: Scheduler) -> None:
        for msg in sched.take_outbox():
            if isinstance(msg, SchedControlOut):
                self.replies[msg.rid] = msg.payload
            elif isinstance(msg, SchedErrorOut):
                self.errors[msg.rid] = msg.message
            else:
                assert isinstance(msg, BatchTokenIDOut)
                for out in msg.outputs:
                    self.ids.setdefault(out.rid, []).extend(out.new_output_ids)
                    if out.finished:
                        self.finished.add(out.rid)

    def run(self, sched: Scheduler) -> "Outcomes":
        self.take(sched)
        for _ in range(10_000):
            if sched.is_idle():
                return self
            sched.step()
            self.take(sched)
        raise AssertionError("scheduler did not go idle")


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    return hf_greedy(peft_model(base, adapter), prompt, MAX_NEW)[0]


def loaded(reply: dict[str, Any]) -> list[str]:
    return sorted(str(entry["name"]) for entry in reply["loaded_adapters"])


def test_three_adapters_queued_over_two_slots(
    llama: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No forward carries more than two adapters; the third adapter's requests wait and all equal peft."""
    entries = [f"{name}={path}" for name, path in adapters.items()]
    sched, runner = lora_scheduler(llama, adapters, entries, slots=2)
    table: dict[int, str] = {}  # slot -> adapter, as the loads the forwards carried wrote them
    per_batch: list[set[str]] = []
    writes = 0
    real_forward = runner.forward

    def forward(batch: ForwardBatch, *args: Any, **kwargs: Any) -> Any:
        nonlocal writes
        if batch.lora is not None:
            for slot, load_uid in batch.lora.loads:
                table[slot] = load_uid
                writes += 1
            per_batch.append({table[slot] for slot in batch.lora.slots if slot >= 0})
        return real_forward(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", forward)
    names: list[str | None] = [*adapters, None]
    batch = prompts(9, seed=21, vocab=runner.vocab_size)
    for i, prompt in enumerate(batch):
        submit(sched, f"r{i}", prompt, names[i % len(names)])
    out = Outcomes().run(sched)
    assert max(len(used) for used in per_batch) == 2  # (two at once did happen: the test means something)
    assert set().union(*per_batch) == {sched.lora.adapters[n].uid for n in adapters}  # type: ignore[union-attr]
    assert writes >= 3  # three adapters through two slots: a slot was written again
    for i, prompt in enumerate(batch):
        name = names[i % len(names)]
        assert out.ids[f"r{i}"] == peft_greedy(llama, adapters[name] if name else None, prompt), (i, name)
    assert_idle_invariant(sched)


def test_a_load_past_max_loaded_loras_evicts_the_least_recently_used_idle_adapter(
    llama: Path, adapters: dict[str, Path]
) -> None:
    first = {name: adapters[name] for name in ("attn8", "all4")}
    sched, runner = lora_scheduler(llama, first, [f"{n}={p}" for n, p in first.items()], slots=2, max_loaded_loras=2)
    assert runner.lora is not None
    prompt = prompts(1, seed=22, vocab=runner.vocab_size)[0]
    out = Outcomes()
    submit(sched, "warm", prompt, "attn8")  # all4, loaded after attn8, is now the least recently used
    out.run(sched)
    evicted_uid = sched.lora.adapters["all4"].uid  # type: ignore[union-attr]
    control(sched, "load", "load_lora", "mlp16", adapters["mlp16"])
    out.run(sched)
    reply = out.replies["load"]
    assert reply["success"] and reply["evicted"] == "all4", reply
    assert loaded(reply) == ["attn8", "mlp16"]
    assert evicted_uid not in runner.lora.adapters and len(runner.lora.adapters) == 2
    submit(sched, "gone", prompt, "all4")
    submit(sched, "new", prompt, "mlp16")
    submit(sched, "kept", prompt, "attn8")
    out.run(sched)
    assert "all4" in out.errors["gone"] and "is not loaded" in out.errors["gone"]
    assert out.ids["new"] == peft_greedy(llama, adapters["mlp16"], prompt)
    assert out.ids["kept"] == out.ids["warm"] == peft_greedy(llama, adapters["attn8"], prompt)
    assert_idle_invariant(sched)


def test_a_load_fails_when_every_adapter_is_pinned_or_in_use_and_a_failed_load_evicts_nothing(
    llama: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    first = {name: adapters[name] for name in ("attn8", "all4")}
    entries = [json.dumps({"lora_name": "attn8", "lora_path": str(first["attn8"]), "pinned": True})]
    entries.append(f"all4={first['all4']}")
    sched, runner = lora_scheduler(llama, first, entries, slots=2, max_loaded_loras=2)
    assert runner.lora is not None and sched.lora is not None
    loaded_uids = set(runner.lora.adapters)
    prompt = prompts(1, seed=23, vocab=runner.vocab_size)[0]
    out = Outcomes()
    submit(sched, "busy", prompt, "all4")
    sched.step()  # all4's request runs: nothing may be given up for a load
    out.take(sched)
    assert "busy" not in out.finished
    control(sched, "full", "load_lora", "mlp16", adapters["mlp16"])
    out.take(sched)
    reply = out.replies["full"]
    assert not reply["success"] and "every one is pinned or in use" in reply["message"], reply
    assert loaded(reply) == ["all4", "attn8"] and set(runner.lora.adapters) == loaded_uids
    out.run(sched)
    assert out.ids["busy"] == peft_greedy(llama, adapters["all4"], prompt)
    # all4 is idle now, but a load that fails gives up nothing.
    broken = tmp_path / "broken"
    broken.mkdir()
    control(sched, "broken", "load_lora", "broken", broken)
    out.run(sched)
    reply = out.replies["broken"]
    assert not reply["success"] and "no adapter_config.json" in reply["message"], reply
    assert loaded(reply) == ["all4", "attn8"] and set(runner.lora.adapters) == loaded_uids
    # A load that works gives up the unpinned one, never the pinned.
    control(sched, "works", "load_lora", "mlp16", adapters["mlp16"])
    submit(sched, "after", prompt, "attn8")
    out.run(sched)
    assert out.replies["works"]["success"] and out.replies["works"]["evicted"] == "all4"
    assert loaded(out.replies["works"]) == ["attn8", "mlp16"]
    assert out.ids["after"] == peft_greedy(llama, adapters["attn8"], prompt)
    assert_idle_invariant(sched)
