"""Weight updates in place (SGLang's update_weights_from_disk) through an in-process Scheduler over the
real model (tiny fp32 Llama, CPU), against transformers on each checkpoint.

* the reloaded model generates what transformers generates with the new weights, and back again;
  the prefix cache is flushed (its KV was the old weights');
* requests running when the update arrives finish on the old weights, requests arriving meanwhile
  wait and run on the new ones (or, with abort_all_requests, every request is aborted first);
* a checkpoint of another model (architecture, config shapes, a tensor's shape, a missing tensor,
  no folder, an unknown load format) is refused before any weight is written, and a load that fails
  half-way is undone: either way the old weights serve on;
* under TP=2 (a thread per rank) every rank reloads its shard at the same step, and when one rank
  fails every rank keeps the old weights.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config.args import ServerArgs
from runtime.engine.loading import weight_reload
from runtime.engine.loading.weight_loader import iterate_weights
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import (
    BatchTokenIDOut,
    SchedControlOut,
    SchedControlReq,
    TokenizedGenerateReq,
    WeightUpdate,
)
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.dp_controller import merge_control_replies
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.weight_update import ABORTED_FOR_UPDATE
from tests.support.checkpoints import copy_checkpoint, hf_greedy, load_hf_model, random_prompt
from tests.support.stub_scheduler import assert_idle_invariant
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def prompt(runner: ModelRunner) -> list[int]:
    return random_prompt(11, runner.vocab_size, seed=61)


@pytest.fixture(scope="module")
def expected(tiny_llama_path: Path, tiny_llama_other_weights: Path, prompt: list[int]) -> dict[str, list[int]]:
    """transformers' greedy tokens of ``prompt`` on each checkpoint (they differ: the test can fail)."""
    out = {
        name: hf_greedy(load_hf_model(path), prompt, NEW_TOKENS)[0]
        for name, path in (("a", tiny_llama_path), ("b", tiny_llama_other_weights))
    }
    assert out["a"] != out["b"]
    return out


def make_runner(path: Path, tp_rank: int = 0, tp_size: int = 1) -> ModelRunner:
    return ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=1024,
        load_progress=False,
        max_running_requests=8,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return make_runner(tiny_llama_path)


@pytest.fixture(params=[False], ids=["serial"])
def sched(request: pytest.FixtureRequest, runner: ModelRunner, tiny_llama_path: Path) -> Iterator[Scheduler]:
    """A fresh Scheduler over the module's runner, serving checkpoint A (serial unless a test asks
    for overlap through ``indirect`` parametrization)."""
    if runner.model_path != tiny_llama_path:
        runner.update_weights_from_disk(tiny_llama_path)
    runner.req_to_token_pool.clear()
    args = ServerArgs(max_total_tokens=1024, disable_overlap_schedule=not request.param)
    scheduler = Scheduler(args, model_runner=runner)
    yield scheduler
    scheduler.worker.close()


def submit(sched: Scheduler, rid: str, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))


def update(sched: Scheduler, path: Path, rid: str = "u", **fields: Any) -> None:
    sched.handle_message(SchedControlReq(rid=rid, kind="update_weights", weights=WeightUpdate(str(path), **fields)))


def run(sched: Scheduler, max_steps: int = 1000) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Any]]]:
    """Step until idle: per rid its ids and finish reason; and the events in order: ("first", rid)
    at a request's first output, ("finished", rid), ("control", payload)."""
    results: dict[str, dict[str, Any]] = {}
    events: list[tuple[str, Any]] = []
    for _ in range(max_steps):
        sched.step()
        for msg in sched.take_outbox():
            if isinstance(msg, SchedControlOut):
                events.append(("control", msg.payload))
                continue
            assert isinstance(msg, BatchTokenIDOut), msg
            for out in msg.outputs:
                if out.rid not in results:
                    events.append(("first", out.rid))
                entry = results.setdefault(out.rid, {"ids": []})
                entry["ids"] += out.new_output_ids
                entry["reason"], entry["cached"] = out.finish_reason, out.cached_tokens
                if out.finished:
                    events.append(("finished", out.rid))
        if sched.is_idle():
            assert_idle_invariant(sched)
            return results, events
    raise AssertionError("scheduler did not go idle")


def controls(events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [payload for kind, payload in events if kind == "control"]


def test_reload_generates_what_transformers_does_with_the_new_weights_and_flushes_the_cache(
    sched: Scheduler,
    tiny_llama_path: Path,
    tiny_llama_other_weights: Path,
    prompt: list[int],
    expected: dict[str, list[int]],
) -> None:
    submit(sched, "a1", prompt)
    results, _ = run(sched)
    assert results["a1"]["ids"] == expected["a"]
    assert sched.tree_cache.evictable_size() > 0  # the prompt is cached...
    update(sched, tiny_llama_other_weights, weight_version="step-1")
    _, events = run(sched)
    (reply,) = controls(events)
    assert reply["success"] and reply["num_paused_requests"] == 0, reply
    assert (reply["model_path"], reply["weight_version"]) == (str(tiny_llama_other_weights), "step-1")
    assert sched.tree_cache.evictable_size() == 0  # ...and gone with the old weights
    assert sched.server_info()["served_weights"] == {
        "model_path": str(tiny_llama_other_weights),
        "weight_version": "step-1",
    }
    submit(sched, "b1", prompt)
    results, _ = run(sched)
    assert results["b1"]["ids"] == expected["b"] and results["b1"]["cached"] == 0
    update(sched, tiny_llama_path)  # back: no version given, the last one stays
    _, events = run(sched)
    assert controls(events)[0]["success"] and controls(events)[0]["weight_version"] == "step-1"
    submit(sched, "a2", prompt)
    assert run(sched)[0]["a2"]["ids"] == expected["a"]


@pytest.mark.parametrize("sched", [False, True], ids=["serial", "overlap"], indirect=True)
def test_running_requests_finish_on_the_old_weights_and_new_ones_wait(
    sched: Scheduler, tiny_llama_other_weights: Path, prompt: list[int], expected: dict[str, list[int]]
) -> None:
    assert sched.worker.overlap == (sched.args.disable_overlap_schedule is False)
    submit(sched, "old", prompt)
    sched.step()  # prefilled, decoding
    sched.step()
    update(sched, tiny_llama_other_weights)
    submit(sched, "new", prompt)
    results, events = run(sched)
    assert results["old"]["ids"] == expected["a"]
    assert results["new"]["ids"] == expected["b"]
    order = [(kind, None if kind == "control" else rid) for kind, rid in events]
    assert order.index(("finished", "old")) < order.index(("control", None)) < order.index(("first", "new"))
    assert controls(events)[0]["num_paused_requests"] == 1  # "new" waited for it


def test_abort_all_requests_aborts_them_first(
    sched: Scheduler, tiny_llama_other_weights: Path, prompt: list[int], expected: dict[str, list[int]]
) -> None:
    submit(sched, "long", prompt, max_new_tokens=200)
    sched.step()
    sched.step()
    submit(sched, "queued", prompt)  # (admitted next step; aborted before)
    update(sched, tiny_llama_other_weights, abort_all_requests=True)
    results, events = run(sched)
    for rid in ("long", "queued"):
        assert results[rid]["reason"] == {"type": "abort", "message": ABORTED_FOR_UPDATE}
    assert len(results["long"]["ids"]) < 200
    assert controls(events)[0]["success"]
    submit(sched, "after", prompt)
    assert run(sched)[0]["after"]["ids"] == expected["b"]


def test_a_second_update_while_one_waits_is_refused(
    sched: Scheduler, tiny_llama_path: Path, tiny_llama_other_weights: Path, prompt: list[int]
) -> None:
    submit(sched, "r", prompt, max_new_tokens=30)
    sched.step()
    update(sched, tiny_llama_other_weights, rid="first")
    update(sched, tiny_llama_path, rid="second")
    second = sched.take_outbox()[-1]  # answered at once
    assert isinstance(second, SchedControlOut) and second.rid == "second"
    assert not second.payload["success"] and "already in progress" in second.payload["message"]
    _, events = run(sched)
    assert controls(events)[0]["success"] and controls(events)[0]["model_path"] == str(tiny_llama_other_weights)


def _rewrite(folder: Path, change: Any) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _other_config(folder: Path, **fields: Any) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


REFUSED = {
    "other architecture": (lambda a, tmp, ck: ck.path("qwen3"), None, "architecture is 'Qwen3ForCausalLM'"),
    "other config shape": (
        lambda a, tmp, ck: _other_config(copy_checkpoint(a, tmp / "c"), intermediate_size=256),
        None,
        "intermediate_size is 256",
    ),
    "other tensor shape": (
        lambda a, tmp, ck: _rewrite(
            copy_checkpoint(a, tmp / "t"),
            lambda t: t.update({"model.norm.weight": torch.ones(65)}),
        ),
        None,
        "model.norm.weight has shape [65]",
    ),
    "missing tensor": (
        lambda a, tmp, ck: _rewrite(copy_checkpoint(a, tmp / "m"), lambda t: t.pop("lm_head.weight")),
        None,
        "no tensor lm_head.weight",
    ),
    "no folder": (lambda a, tmp, ck: tmp / "nothing-here", None, "not a checkpoint folder"),
    "unknown load format": (lambda a, tmp, ck: a, "pt", "load_format 'pt' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_another_model_is_refused_and_the_old_weights_serve_on(
    sched: Scheduler,
    tiny_llama_path: Path,
    tmp_path: Path,
    tiny_checkpoints: Any,
    prompt: list[int],
    expected: dict[str, list[int]],
    case: str,
) -> None:
    make, load_format, message = REFUSED[case]
    update(sched, make(tiny_llama_path, tmp_path, tiny_checkpoints), load_format=load_format)
    _, events = run(sched)
    (reply,) = controls(events)
    assert not reply["success"] and message in reply["message"], reply
    assert reply["model_path"] == str(tiny_llama_path)
    submit(sched, "still-a", prompt)
    assert run(sched)[0]["still-a"]["ids"] == expected["a"]


def test_a_load_that_fails_half_way_is_undone(
    sched: Scheduler,
    tiny_llama_other_weights: Path,
    prompt: list[int],
    expected: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = weight_reload.load_model_weights

    def fails_half_way(model: Any, folder: Path, **kwargs: Any) -> None:
        if Path(folder) != tiny_llama_other_weights:
            return real(model, folder, **kwargs)
        model.load_weights(islice(iterate_weights(folder, progress=False), 6))  # some of B's tensors...
        raise OSError("the disk went away")  # ...then the rest cannot be read

    monkeypatch.setattr(weight_reload, "load_model_weights", fails_half_way)
    update(sched, tiny_llama_other_weights)
    _, events = run(sched)
    (reply,) = controls(events)
    assert not reply["success"] and "the disk went away" in reply["message"]
    submit(sched, "a", prompt)
    assert run(sched)[0]["a"]["ids"] == expected["a"]


def test_control_replies_of_dp_replicas_merge() -> None:
    ok = {"success": True, "message": "done", "num_paused_requests": 1, "trace_files": ["r0"]}
    bad = {"success": False, "message": "refused", "num_paused_requests": 2, "trace_files": ["r1"]}
    merged = merge_control_replies("update_weights", [ok, bad])
    assert (merged["success"], merged["message"], merged["num_paused_requests"]) == (False, "refused", 3)
    assert merge_control_replies("stop_profile", [ok, ok])["trace_files"] == ["r0", "r0"]


# ---- tensor parallelism (a thread per rank) --------------------------------------------------


def _tp_update(
    tiny_llama_path: Path, tiny_llama_other_weights: Path, prompt: list[int], group: ThreadTPGroup
) -> list[tuple[dict[str, Any], list[int]]]:
    """Each TP rank: the update's reply and the greedy tokens of ``prompt`` afterwards."""
    runners = [make_runner(tiny_llama_path, tp_rank=r, tp_size=2) for r in range(2)]

    def work(rank: int) -> tuple[dict[str, Any], list[int]]:
        args = ServerArgs(max_total_tokens=1024, disable_overlap_schedule=True, tp_size=2)
        sched = Scheduler(args, tp_rank=rank, model_runner=runners[rank])
        update(sched, tiny_llama_other_weights)  # (every rank receives the same inputs: the broadcast)
        submit(sched, "after", prompt)
        results, events = run(sched)
        return controls(events)[0], results["after"]["ids"]

    return run_on_ranks(group, work)


def test_every_tp_rank_reloads_its_shard(
    tiny_llama_path: Path,
    tiny_llama_other_weights: Path,
    prompt: list[int],
    expected: dict[str, list[int]],
    thread_tp_group: ThreadTPGroup,
) -> None:
    for reply, ids in _tp_update(tiny_llama_path, tiny_llama_other_weights, prompt, thread_tp_group):
        assert reply["success"], reply
        assert ids == expected["b"]


def test_when_one_tp_rank_fails_every_rank_keeps_the_old_weights(
    tiny_llama_path: Path,
    tiny_llama_other_weights: Path,
    prompt: list[int],
    expected: dict[str, list[int]],
    thread_tp_group: ThreadTPGroup,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = weight_reload.load_model_weights

    def rank1_fails(model: Any, folder: Path, **kwargs: Any) -> None:
        if thread_tp_group.local.rank == 1 and Path(folder) == tiny_llama_other_weights:
            raise OSError("rank 1 cannot read the shard")
        real(model, folder, **kwargs)

    monkeypatch.setattr(weight_reload, "load_model_weights", rank1_fails)
    (reply0, ids0), (reply1, ids1) = _tp_update(tiny_llama_path, tiny_llama_other_weights, prompt, thread_tp_group)
    assert not reply0["success"] and "1 other TP rank(s) could not load" in reply0["message"]
    assert not reply1["success"] and "rank 1 cannot read the shard" in reply1["message"]
    assert ids0 == ids1 == expected["a"]
