"""Multi-LoRA with the scheduler's other features on, and on more model families: greedy output equals
peft + transformers (fp32) for batches that mix the base model and several adapters.

Each case is small (prompts under 40 tokens, 6-8 new tokens): tensor parallelism 2 (a thread per
rank) against TP 1; n-gram speculative decoding (drafts accepted on adapter requests); a regex
constraint on one adapter request beside a free one; chunked prefill with the prefix cache, which a
request reuses on its own adapter and never across adapters or the base model; the hierarchical
cache's host tier, whose loaded-back prefixes keep the same rule; sliding-window memory. Then the
families test_lora_scheduler.py does not cover (Mistral, Qwen3, Gemma 2; attention targets on the
mixtures of experts Qwen3-MoE, Mixtral, OLMoE, whose expert weights take no adapter: peft adapts them
as parameters, ``target_parameters``, and such a folder is refused naming them).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.config.lora_args import LoraRef
from runtime.engine.lora.adapter import LoraAdapterError
from runtime.engine.lora.manager import LoraSettings
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.lora_slots import initial_adapters
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, random_prompt
from tests.support.lora_adapters import AdapterSpec, build_adapter, peft_model
from tests.support.stub_scheduler import assert_idle_invariant, collect
from tests.unit.scheduler_proc.test_lora_scheduler import ATTENTION, adapters_for, prompts
from tests.unit.scheduler_proc.test_speculative_models import calls_for
from tests.unit.scheduler_proc.test_swa_memory import assert_both_pools_clean

MAX_NEW = 6
# Attention-only adapters for the mixtures of experts (their MLPs are experts): ranks, alphas, a pattern, rsLoRA.
MOE_SPECS = {
    "attn8": AdapterSpec(r=8, alpha=16, targets=ATTENTION, seed=31),
    "qv4": AdapterSpec(r=4, alpha=8, targets=("q_proj", "v_proj"), seed=32, alpha_pattern={"v_proj": 3}),
    "ko16": AdapterSpec(r=16, alpha=4, targets=("k_proj", "o_proj"), seed=33, rslora=True),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny forwards are too small to share, and two ranks run as threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints: Any) -> Path:
    return Path(tiny_checkpoints.path("llama"))


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: Any) -> dict[str, Path]:
    """attn8, all4, mlp16: test_lora_scheduler.py's three adapters of the tiny Llama."""
    return adapters_for(tiny_checkpoints, "llama")


def runner_for(
    path: Path, adapters: dict[str, Path], max_total_tokens: int = 2048, slots: int = 4, **kwargs: Any
) -> tuple[ModelRunner, list[str]]:
    """A CPU fp32 runner with ``adapters`` loaded at start, and the ``--lora-paths`` entries that name them."""
    refs = [LoraRef(name, str(p)) for name, p in adapters.items()]
    runner = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        max_total_tokens=max_total_tokens,
        max_running_requests=16,
        load_progress=False,
        lora=LoraSettings(slots=slots, initial=initial_adapters(refs)),
        **kwargs,
    )
    return runner, [f"{ref.name}={ref.path}" for ref in refs]


def scheduler_for(runner: ModelRunner, entries: list[str], tp_rank: int = 0, **flags: Any) -> Scheduler:
    assert runner.lora is not None
    flags.setdefault("disable_overlap_schedule", True)
    args = ServerArgs(
        max_total_tokens=runner.max_total_tokens,
        lora_paths=entries,
        max_loras_per_batch=runner.lora.pool.slots,
        **flags,
    )
    return Scheduler(args, tp_rank=tp_rank, model_runner=runner)


def submit(
    sched: Scheduler, rid: str, prompt: list[int], adapter: str | None, max_new: int = MAX_NEW, **params: Any
) -> None:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **params)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=sampling, lora_name=adapter))


def serve(sched: Scheduler, results: dict[str, dict] | None = None, timeout_s: float = 120.0) -> dict[str, dict]:
    """Step until idle (bounded by time: a grammar compiles on a thread meanwhile); each request's ids
    and cached-token count (tests.support.stub_scheduler.collect)."""
    results = {} if results is None else results
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sched.step()
        collect(sched, results)
        if sched.is_idle():
            return results
    raise AssertionError("scheduler did not go idle")


def expected(base: Path, adapter: Path | None, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """peft's greedy tokens (the base: transformers alone)."""
    return hf_greedy(peft_model(base, adapter), prompt, max_new)[0]


def mixed(sched: Scheduler, names: list[str | None], batch: list[list[int]], max_new: int = MAX_NEW) -> None:
    for i, prompt in enumerate(batch):
        submit(sched, f"r{i}", prompt, names[i % len(names)], max_new)


def assert_equal_peft(
    results: dict[str, dict],
    base: Path,
    adapters: dict[str, Path],
    names: list[str | None],
    batch: list[list[int]],
    max_new: int = MAX_NEW,
) -> None:
    for i, prompt in enumerate(batch):
        name = names[i % len(names)]
        assert results[f"r{i}"]["ids"] == expected(base, adapters[name] if name else None, prompt, max_new), (i, name)


# ---- (a) tensor parallelism ----------------------------------------------------------------


def test_tensor_parallel_2_equals_tp_1_and_peft(llama: Path, adapters: dict[str, Path], thread_tp_group: Any) -> None:
    """Every adapted linear cuts its adapter as it cuts its weight (column: B's rows, row: A's columns)."""
    from tests.support.tp_threads import run_on_ranks

    names: list[str | None] = [None, *adapters]
    tp1, entries = runner_for(llama, adapters, max_total_tokens=1024)
    batch = prompts(6, seed=41, vocab=tp1.vocab_size)
    runners = [
        runner_for(llama, adapters, 1024, tp_rank=r, tp_size=2, attention_backend="torch_native")[0] for r in range(2)
    ]

    def work(rank: int) -> dict[str, list[int]]:
        sched = scheduler_for(runners[rank], entries, tp_rank=rank, tp_size=2)
        mixed(sched, names, batch)
        results = serve(sched)
        assert_idle_invariant(sched)
        return {rid: r["ids"] for rid, r in results.items()}

    ranks = run_on_ranks(thread_tp_group, work)
    single = scheduler_for(tp1, entries)
    mixed(single, names, batch)
    one = serve(single)
    assert ranks[0] == ranks[1] == {rid: r["ids"] for rid, r in one.items()}
    assert_equal_peft(one, llama, adapters, names, batch)
    assert_idle_invariant(single)


# ---- (b) speculative decoding ----------------------------------------------------------------


def test_ngram_speculation_on_adapter_requests(llama: Path, adapters: dict[str, Path]) -> None:
    """A verify step is an extend of each request's last token and drafts, on the request's adapter."""
    runner, entries = runner_for(llama, adapters)
    sched = scheduler_for(runner, entries, speculative_algorithm="ngram", speculative_max_step_tokens=1 << 20)
    names: list[str | None] = [*adapters, None]
    batch = [p[:36] for p in calls_for(runner.vocab_size, 8, seed=42)]  # (even ones repeat a passage)
    mixed(sched, names, batch, max_new=8)
    results = serve(sched)
    assert_equal_peft(results, llama, adapters, names, batch, max_new=8)
    assert sched.stats["spec_draft_tokens"] > 0 and sched.stats["spec_accepted_drafts"] > 0, dict(sched.stats)
    assert_idle_invariant(sched)


# ---- (c) structured outputs ----------------------------------------------------------------


def test_a_regex_on_one_adapter_request_beside_a_free_one(llama: Path, adapters: dict[str, Path]) -> None:
    from runtime.text.tokenizer import load_tokenizer

    pattern = r"(yes|no), [0-9]{1,2}"
    runner, entries = runner_for(llama, adapters)
    sched = scheduler_for(runner, entries, model_path=str(llama))  # (the grammar's tokenizer)
    batch = prompts(2, seed=43, vocab=runner.vocab_size)
    try:
        submit(sched, "constrained", batch[0], "attn8", max_new=16, regex=pattern)
        submit(sched, "free", batch[1], "all4")
        results = serve(sched)
    finally:
        sched.grammars.close()
        sched.worker.close()
    text = load_tokenizer(str(llama)).decode(results["constrained"]["ids"], skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    assert results["free"]["ids"] == expected(llama, adapters["all4"], batch[1])
    assert sched.grammars.stats.constrained_requests == 1
    assert_idle_invariant(sched)


# ---- (d) chunked prefill and the prefix cache -------------------------------------------------


def test_chunked_prefill_and_the_prefix_cache_stay_within_an_adapter(llama: Path, adapters: dict[str, Path]) -> None:
    runner, entries = runner_for(llama, adapters)
    sched = scheduler_for(runner, entries, chunked_prefill_size=8)
    prompt = random_prompt(34, runner.vocab_size, seed=44)
    other = random_prompt(27, runner.vocab_size, seed=45)
    submit(sched, "first", prompt, "attn8")  # chunked beside another adapter's chunks
    submit(sched, "beside", other, "mlp16")
    results = serve(sched)
    assert sched.stats["num_prefill_batches"] >= 5  # (34 + 27 tokens in chunks of 8)
    for rid, adapter in (("again", "attn8"), ("other", "all4"), ("base", None), ("third", "mlp16")):
        submit(sched, rid, prompt, adapter)
    serve(sched, results)
    assert results["first"]["cached"] == 0
    assert results["again"]["cached"] >= len(prompt) - 1  # its own adapter's KV
    assert results["other"]["cached"] == results["base"]["cached"] == results["third"]["cached"] == 0
    assert results["first"]["ids"] == results["again"]["ids"] == expected(llama, adapters["attn8"], prompt)
    assert results["beside"]["ids"] == expected(llama, adapters["mlp16"], other)
    assert results["other"]["ids"] == expected(llama, adapters["all4"], prompt)
    assert results["base"]["ids"] == expected(llama, None, prompt)
    assert results["third"]["ids"] == expected(llama, adapters["mlp16"], prompt)
    assert_idle_invariant(sched)


# ---- (e) the hierarchical cache's host tier -----------------------------------------------------


def test_the_host_tier_keeps_adapters_apart(llama: Path, adapters: dict[str, Path]) -> None:
    """A 96-token pool: a third request pushes the first one's prefix to the host; it comes back for a
    request on the same adapter, never for another adapter or the base model."""
    runner, entries = runner_for(llama, adapters, max_total_tokens=96)
    sched = scheduler_for(runner, entries, enable_hierarchical_cache=True)
    prompt = random_prompt(36, runner.vocab_size, seed=46)
    fillers = [random_prompt(36, runner.vocab_size, seed=47 + i) for i in range(2)]
    results: dict[str, dict] = {}
    for rid, p, adapter in (("first", prompt, "attn8"), ("fill0", fillers[0], None), ("fill1", fillers[1], "all4")):
        submit(sched, rid, p, adapter)
        serve(sched, results)
    assert sched.server_info()["device_evicted_tokens"] > 0
    submit(sched, "again", prompt, "attn8")
    serve(sched, results)
    host_hits = sched.server_info()["host_hit_tokens"]
    assert host_hits > 0 and results["again"]["cached"] >= len(prompt) - 1
    for rid, adapter in (("other", "all4"), ("base", None)):
        submit(sched, rid, prompt, adapter)
        serve(sched, results)
        assert results[rid]["cached"] == 0, rid
    assert sched.server_info()["host_hit_tokens"] == host_hits
    assert results["first"]["ids"] == results["again"]["ids"] == expected(llama, adapters["attn8"], prompt)
    assert results["other"]["ids"] == expected(llama, adapters["all4"], prompt)
    assert results["base"]["ids"] == expected(llama, None, prompt)
    assert_idle_invariant(sched)


# ---- (f) sliding-window memory --------------------------------------------------------------------


def test_sliding_window_memory(tiny_checkpoints: Any) -> None:
    """Mistral with every layer windowed (W = 16) under the paired SWA pools: prompts past the window,
    then one prompt again on its adapter (cached) and on another (not)."""
    path = Path(tiny_checkpoints.path("mistral_swa"))
    swa_adapters = adapters_for(tiny_checkpoints, "mistral_swa")
    runner, entries = runner_for(path, swa_adapters, swa_full_tokens_ratio=0.5, attention_backend="torch_native")
    sched = scheduler_for(runner, entries, swa_full_tokens_ratio=0.5, chunked_prefill_size=16)
    assert sched.check_memory().swa is not None  # the SWA memory is what serves it
    names: list[str | None] = [None, *swa_adapters]
    batch = [random_prompt(SWA_WINDOWS["mistral_swa"] + 4 + 5 * i, runner.vocab_size, seed=50 + i) for i in range(4)]
    mixed(sched, names, batch, max_new=8)
    results = serve(sched)
    assert_equal_peft(results, path, swa_adapters, names, batch, max_new=8)
    # The conversation goes on (its history is cached, the last window's SWA KV live): on its adapter
    # the history is reused, on another adapter it is not.
    history = batch[1] + results["r1"]["ids"] + [5, 6, 7]
    submit(sched, "same", history, names[1])
    submit(sched, "other", history, names[2])
    serve(sched, results)
    assert results["same"]["cached"] >= len(batch[1]) and results["other"]["cached"] == 0
    assert results["same"]["ids"] == expected(path, swa_adapters[str(names[1])], history)
    assert results["other"]["ids"] == expected(path, swa_adapters[str(names[2])], history)
    assert_both_pools_clean(sched)


# ---- more families ------------------------------------------------------------------------------


def family_adapters(tiny_checkpoints: Any, family: str) -> dict[str, Path]:
    if family not in MOE_FAMILIES:
        return adapters_for(tiny_checkpoints, family)  # attention and dense MLP targets
    base = tiny_checkpoints.path(family)
    return {
        name: build_adapter(base, tiny_checkpoints.root / f"{family}-lora-{name}", spec)
        for name, spec in MOE_SPECS.items()
    }


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", *MOE_FAMILIES])
def test_mixed_batch_on_more_families(tiny_checkpoints: Any, family: str) -> None:
    path = Path(tiny_checkpoints.path(family))
    family_set = family_adapters(tiny_checkpoints, family)
    runner, entries = runner_for(path, family_set)
    sched = scheduler_for(runner, entries, chunked_prefill_size=16)
    names: list[str | None] = [None, *family_set]
    batch = prompts(8, seed=60, vocab=runner.vocab_size)
    mixed(sched, names, batch)
    results = serve(sched)
    assert_equal_peft(results, path, family_set, names, batch)
    differs = sum(
        expected(path, None, prompt) != results[f"r{i}"]["ids"]
        for i, prompt in enumerate(batch)
        if names[i % len(names)]
    )
    assert differs >= 2, "the adapters must change the model's output for the test to mean anything"
    assert_idle_invariant(sched)
    if family in MOE_FAMILIES:
        expert_adapter_is_refused(runner, path, tiny_checkpoints.root / f"{family}-lora-experts")


def expert_adapter_is_refused(runner: ModelRunner, path: Path, out: Path) -> None:
    """peft (with transformers 5's fused experts) adapts expert weights as parameters; such a folder is
    refused naming them, and the adapters loaded stay as they were."""
    from peft import LoraConfig, get_peft_model

    from tests.support.checkpoints import load_hf_model

    if not (out / "adapter_config.json").is_file():
        torch.manual_seed(0)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            init_lora_weights=False,
        )
        get_peft_model(load_hf_model(path), config).save_pretrained(str(out))
    assert runner.lora is not None
    before = dict(runner.lora.adapters)
    with pytest.raises(LoraAdapterError) as info:
        runner.load_lora_adapter("experts#9", str(out))
    message = str(info.value)
    assert "target_parameters" in message and "mlp.experts.gate_up_proj" in message, message
    assert "only attention and dense MLP projections take adapters" in message
    assert runner.lora.adapters == before
