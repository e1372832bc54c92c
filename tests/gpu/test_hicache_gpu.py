"""The hierarchical cache on a GPU: pinned host pool, copies on the copy stream ordered by events,
and a scheduler on cuda (overlap on and off) whose greedy tokens equal a big pool's."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from memory.host_pool import HostKVPool
from memory.kv_pool import MHATokenToKVPool
from memory.kv_transfer import CudaKVTransfer, make_kv_transfer
from runtime.config.args import ServerArgs
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import assert_idle_invariant, collect
from tests.support.triton_interp import run_compiled_when_interpreting


def test_cuda_copies_round_trip_on_the_copy_stream() -> None:
    pool = MHATokenToKVPool(64, 1, torch.bfloat16, 2, 2, 8, "cuda")
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, device="cuda").to(torch.bfloat16))
    host = HostKVPool(pool, 64)
    assert host.pinned and host.k_buffer[0].is_pinned()
    transfer = make_kv_transfer(pool, host)
    assert isinstance(transfer, CudaKVTransfer) and transfer.asynchronous
    src = torch.arange(1, 33, device="cuda")
    original = torch.stack([b[src] for b in pool.k_buffer + pool.v_buffer]).cpu()
    op = transfer.to_host(src, torch.arange(33, 65))
    op.wait()
    assert torch.equal(torch.stack([b[33:65] for b in host.k_buffer + host.v_buffer]), original)
    dst = torch.arange(33, 65, device="cuda")
    op = transfer.to_device(torch.arange(33, 65), dst)
    loaded = torch.stack([b[dst] for b in pool.k_buffer + pool.v_buffer]).cpu()  # ordered after the copy
    op.wait()
    assert torch.equal(loaded, original) and op.nbytes == 32 * pool.bytes_per_token() and op.seconds > 0


def _conversations(sched: Scheduler, sessions: int = 8, turns: int = 3) -> dict[str, list[int]]:
    rng = random.Random(0)
    users = [
        [[rng.randrange(3, 300) for _ in range((100 if t == 0 else 0) + 12)] for t in range(turns)]
        for _ in range(sessions)
    ]
    history = {s: list(users[s][0]) for s in range(sessions)}
    turn = dict.fromkeys(range(sessions), 0)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    results: dict[str, dict] = {}
    for s in range(sessions):
        sched.handle_message(TokenizedGenerateReq(rid=f"s{s}t0", input_ids=history[s], sampling_params=params))
    while not (sched.is_idle() and all(t == turns for t in turn.values())):
        sched.step()
        collect(sched, results)
        for s in range(sessions):
            rid = f"s{s}t{turn[s]}"
            if turn[s] < turns and results.get(rid, {}).get("finished"):
                turn[s] += 1
                if turn[s] < turns:
                    history[s] = history[s] + results[rid]["ids"] + users[s][turn[s]]
                    sched.handle_message(
                        TokenizedGenerateReq(rid=f"s{s}t{turn[s]}", input_ids=history[s], sampling_params=params)
                    )
    return {rid: r["ids"] for rid, r in results.items()}


def test_tier_on_cuda_gives_the_big_pools_tokens(tiny_llama_path: Path) -> None:
    outputs = {}
    for name, pool, extra in (
        ("big", 8192, {}),
        ("tier", 256, {"enable_hierarchical_cache": True, "hicache_ratio": 16.0}),
        (
            "tier-overlap",
            256,
            {"enable_hierarchical_cache": True, "hicache_ratio": 16.0, "hicache_write_policy": "write_back"},
        ),
    ):
        args = ServerArgs(
            model_path=str(tiny_llama_path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=pool,
            disable_overlap_schedule=name != "tier-overlap",
            **extra,
        )
        sched = Scheduler(args)
        outputs[name] = _conversations(sched)
        assert_idle_invariant(sched)
        if extra:
            assert sched.server_info()["host_hit_tokens"] > 0
        sched.worker.close()
    assert outputs["tier"] == outputs["big"] and outputs["tier-overlap"] == outputs["big"]


run_compiled_when_interpreting(globals(), __file__)
