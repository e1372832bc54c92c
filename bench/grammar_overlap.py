"""Constrained decoding under overlap scheduling, next to the serial loop.

With overlap, step N+1 is launched before step N's tokens reach the host, but a constrained
row's bitmask depends on the state after step N's token. The scheduler therefore completes the
step in flight before planning the next one while a constrained request runs (``wait``, as for
penalties). The other way, ``deferred``: launch N+1 at once and let the model worker fill the
mask after computing N+1's logits, once the scheduler has processed step N. It was built and
measured with this script (commit b96125e, the variant "overlap, deferred mask"; figures in
docs/benchmarks.md), lost on the CPU, and was removed.

Both variants here run the ``json-schema`` workload's requests (greedy, jump-forward off so
the mask handling is all that differs) on the real ``Scheduler`` in this process; time is
wall time from submission until every request finished.

    python -m bench.grammar_overlap --model smollm2 --num-requests 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, pin_threads, print_table, write_json


def run_variant(
    model_path: str, prompts: list[list[int]], schemas: list[str], overlap: bool, max_new_tokens: int
) -> dict[str, Any]:
    from runtime.config.args import ServerArgs
    from runtime.protocol.messages import TokenizedGenerateReq
    from runtime.protocol.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    args = ServerArgs(
        model_path=model_path,
        device="cpu",
        dtype="float32",
        disable_overlap_schedule=not overlap,
        disable_jump_forward=True,
    )
    sched = Scheduler(args)

    def submit(rid: str, ids: list[int], schema: str) -> None:
        params = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": schema})
        sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=params))

    def drain() -> int:
        produced = 0
        while not sched.is_idle():
            sched.step()
            for msg in sched.take_outbox():
                produced += sum(len(o.new_output_ids) for o in getattr(msg, "outputs", []))
        return produced

    for i, schema in enumerate(dict.fromkeys(schemas)):  # warm-up: compiles each grammar once
        submit(f"warm{i}", prompts[0], schema)
    drain()
    decode_before = sched.stats["num_decode_batches"]
    start = time.perf_counter()
    for i, (ids, schema) in enumerate(zip(prompts, schemas)):
        submit(f"r{i}", ids, schema)
    out_tokens = drain()
    seconds = time.perf_counter() - start
    sched.worker.close()
    return {
        "seconds": seconds,
        "out_tokens": out_tokens,
        "tok_s": out_tokens / seconds,
        "decode_steps": sched.stats["num_decode_batches"] - decode_before,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (the default model) or a checkpoint folder")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    pinning = pin_threads(args.threads)

    from bench.workloads import json_schema
    from runtime.checkpoints.model_source import DEFAULT_MODEL, checkpoint_folder
    from runtime.text.tokenizer import load_tokenizer

    model_path = str(checkpoint_folder(DEFAULT_MODEL if args.model == "smollm2" else args.model, None, True))
    tokenizer = load_tokenizer(model_path)
    workload = json_schema(num_requests=args.num_requests, max_new_tokens=args.max_new_tokens)
    prompts = [
        list(
            tokenizer.encode(
                tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
        )
        for r in workload.requests
    ]
    schemas = [str(r.json_schema) for r in workload.requests]
    rows = []
    for name, overlap in (("serial", False), ("overlap, mask waits", True)):
        rows.append({"variant": name, **run_variant(model_path, prompts, schemas, overlap, args.max_new_tokens)})
        print(f"{name}: {rows[-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    for row in rows:
        row["vs_serial"] = row["tok_s"] / rows[0]["tok_s"]
    print_table(
        rows,
        [
            ("variant", "variant"),
            ("out_tokens", "out tokens"),
            ("decode_steps", "decode steps"),
            ("seconds", "time s"),
            ("tok_s", "out tok/s"),
            ("vs_serial", "x serial"),
        ],
        title=f"json-schema, {args.num_requests} requests, in-process scheduler, {pinning.num_threads} threads",
    )
    write_json(
        args.output or default_output_path("grammar_overlap", args.model),
        {"machine": machine_info(pinning), "args": vars(args), "rows": rows},
    )


if __name__ == "__main__":
    main()
