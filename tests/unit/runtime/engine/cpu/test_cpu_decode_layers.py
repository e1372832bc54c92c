"""A decode step's decoder layers in one C call (runtime/engine/cpu/decode_layers.py,
csrc/decode_layers.c) against the same model running its layers one by one: the same logits bit for
bit, step after step (the decode-key mirror appended by either path, alternating), on every
architecture the call takes (Gemma 3's sandwich norms and windowed layers too, past the window), with
and without a shared prefix, in bf16 and in fp32; and the cases it must leave to the layers (Gemma 2's
soft-capped attention, a model whose every layer is windowed, a mirror rebuild, AMX off in bf16, a row
count the fp32 panel kernel does not take) run there untouched.

bf16 runs its linears on AMX tiles, or, on a CPU with AVX512-BF16 and no AMX, on the dot-product
kernel (oneDNN packs for it there): the bf16 tests run with whichever this process has, and once
more in a process whose oneDNN is capped as on such a CPU (the dot-product set). fp32 needs a
vector build of the kernels (AVX2 or AVX-512: the panel kernel and the fp32 attention kernels).
tests/e2e/test_cpu_one_call_e2e.py runs the real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.engine.cpu import attention_kernels_f32, decode_layers, kernel_library, prepacked
from runtime.engine.cpu.prepacked import fp32_panel_rows
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support import REPO_ROOT as ROOT
from tests.support.checkpoints import CHECKPOINT_NAMES, hf_greedy, load_hf_model, random_prompt
from tests.support.cpu_features import bf16_kernels
from tests.support.harness import Harness

BF16_KERNELS = bf16_kernels()
needs_bf16_kernels = pytest.mark.skipif(
    BF16_KERNELS is None,
    reason="needs a CPU with AVX512-BF16 (avx512_bf16; AMX where it has them): the bf16 call's linears run on them",
)
needs_avx512_bf16 = pytest.mark.skipif(
    "avx512bf16" not in kernel_library.host_levels(), reason="needs a CPU with AVX512-BF16 (avx512_bf16)"
)


needs_fp32_kernels = pytest.mark.skipif(
    not (fp32_panel_rows() and attention_kernels_f32.applies()),
    reason="needs a CPU with AVX2 and FMA (or AVX-512) and the kernels' vector build of it (TINYSERVE_CPU_ISA may "
    "select plain C): the fp32 call's linears and attention are its kernels",
)
DTYPES = [pytest.param("bfloat16", marks=needs_bf16_kernels), pytest.param("float32", marks=needs_fp32_kernels)]


def _kernels_taken(runner: ModelRunner) -> str:
    assert isinstance(runner.layer_stack, decode_layers.CpuLayerStack)
    stack = runner.layer_stack.description()
    assert stack is not None, "the one-call path does not describe this model"
    return stack.kernels


@pytest.fixture
def calls(one_call_runs: list[bool]) -> list[bool]:
    """Per forward that asked: whether ``decode_layers.run`` ran the layers (True) or declined."""
    return one_call_runs


def _runner(path: Path, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=8192, load_progress=False)


def _decode_logits(
    runner: ModelRunner, modes: list[bool], shared_prefix: int = 0, requests: int = 5, first_len: int = 2
) -> list[torch.Tensor]:
    """Prefill ``requests`` prompts (the first ``shared_prefix`` tokens common, cached once; request i's
    own ``first_len + 3 i`` tokens), then one decode step per entry of ``modes`` (True: the one-call
    path allowed); each step's logits."""
    h = Harness(runner)
    vocab = runner.vocab_size
    prefix = random_prompt(shared_prefix, vocab, seed=3) if shared_prefix else []
    prompts = [prefix + random_prompt(first_len + 3 * i, vocab, seed=30 + i) for i in range(requests)]
    reqs = h.prefill_sharing(prompts, shared_prefix)
    logits = []
    for on in modes:
        with decode_layers.use_decode_layers(on):
            logits.append(h.step(reqs, ForwardMode.DECODE).logits.clone())
    h.reset()
    return logits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
def test_one_call_equals_the_layers_bit_for_bit(name: str, dtype: str, tiny_checkpoints, calls: list[bool]) -> None:
    runner = _runner(tiny_checkpoints.path(name), dtype)
    steps = 6
    layered = _decode_logits(runner, [False] * steps)
    calls.clear()
    one_call = _decode_logits(runner, [True] * steps)
    # Gemma 2's soft-capped attention and Qwen2-MoE's shared expert are the layers' own path: their declared
    # descriptions ask for what the C layer lacks (Gemma 3 is taken: its 5 requests' 2..14-token prompts and
    # 6 steps cross its window of 16; the routed experts of the other sparse families run in the call:
    # csrc/moe_mlp.c). The dot-product kernel reads weights in 64-column blocks, which mistral's qkv (96
    # columns) and Mixtral's experts' gate/up (96) are not, and the fused AMX gate/up takes 32-column
    # halves, which Mixtral's intermediate 48 is not: oneDNN's call runs them there
    assert isinstance(runner.layer_stack, decode_layers.CpuLayerStack)
    one_by_one = runner.layer_stack.declined is not None
    taken_families = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_moe", "mixtral", "olmoe")
    assert not one_by_one or name not in taken_families, runner.layer_stack.declined
    unpacked = (BF16_KERNELS == "dp" and name == "mistral") or name == "mixtral"
    taken = not one_by_one and not (dtype == "bfloat16" and unpacked)
    # the first decode step builds the mirror (the layers' path), the rest append to it
    assert calls == [False] * 2 + [False] + [taken] * (steps - 1), calls
    if taken:
        assert _kernels_taken(runner) == (BF16_KERNELS if dtype == "bfloat16" else "f32")
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"{name}: decode step {step} differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared_prefix", [0, 40])
def test_one_call_with_a_shared_prefix_and_alternating_paths(
    shared_prefix: int, dtype: str, tiny_checkpoints, calls: list[bool]
) -> None:
    """head_dim 64: the shared prefix goes through the packed prefix kernel inside the call (bf16:
    the pair-packed one). Steps alternate between the two paths, each appending to the mirror the
    other one reads."""
    runner = _runner(tiny_checkpoints.path("llama_hd64"), dtype)
    layered = _decode_logits(runner, [False] * 7, shared_prefix)
    calls.clear()
    mixed = _decode_logits(runner, [True, True, False, True, False, False, True], shared_prefix)
    assert calls[-7:] == [False, True, False, True, False, False, True], calls
    backend = runner.attn_backend
    if shared_prefix:
        assert backend.mirror.prefix_slots is not None and backend.mirror.prefix_slots.numel() == shared_prefix
    for step, (a, b) in enumerate(zip(layered, mixed)):
        assert torch.equal(a, b), f"decode step {step} differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dropped_plan_is_never_read_and_a_new_plan_is_taken_up(
    dtype: str, tiny_checkpoints, calls: list[bool]
) -> None:
    """A weight reload drops a layer's plan with its packed copy (its address is stale) and plans again
    after: meanwhile the layers run one by one; after ``prepare_model`` the one call is back, same bits."""
    runner = _runner(tiny_checkpoints.path("llama"), dtype)
    reference = _decode_logits(runner, [False] * 3)
    runner.model.model.layers[0].self_attn.qkv_proj.drop_plan()  # as its weight_loader does
    calls.clear()
    _decode_logits(runner, [True] * 3)
    assert not any(calls), calls
    runner.ops.prepare_model(runner.model)
    calls.clear()
    repacked = _decode_logits(runner, [True] * 3)
    assert calls == [False, False, False, True, True], calls  # two prefills, the rebuild, two appends
    assert all(torch.equal(a, b) for a, b in zip(reference, repacked))


@needs_avx512_bf16
def test_bf16_without_amx_takes_the_dot_product_kernels(tiny_checkpoints) -> None:
    """This file's bf16 tests once more in a process whose oneDNN may use AVX512-BF16 but not AMX
    (ONEDNN_MAX_CPU_ISA is read when oneDNN starts): it packs the layout of a CPU without AMX, and
    the call runs ``dp_linear_bf16`` and silu*mul where the AMX set has its fused gate/up. Without AMX
    tiles, and on the avx512bf16 build, this file's own bf16 tests above already ran that way."""
    if not kernel_library.amx_available() and kernel_library.level() == "avx512bf16":
        pytest.skip(
            "needs AMX tiles (amx_tile, amx_bf16): without them this file's bf16 tests ran on the dot-product kernels"
        )
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "TINYSERVE_CPU_AMX": "0",
        "TINYSERVE_CPU_ISA": "avx512bf16",
    }  # (whatever build this run selected: the kernels are in that one)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "bfloat16",
            str(Path(__file__).relative_to(ROOT)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "skipped" not in summary and "passed" in summary, done.stdout[-3000:]


@needs_fp32_kernels
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fp32_one_call_greedy_equals_transformers(name: str, tiny_checkpoints, calls: list[bool]) -> None:
    """The oracle itself: a batch decoded through the fp32 call gives transformers' greedy tokens."""
    path = tiny_checkpoints.path(name)
    runner = _runner(path, "float32")
    prompts = [random_prompt(4 + 7 * i, runner.vocab_size, seed=700 + i) for i in range(6)]
    steps = 12
    h = Harness(runner)
    reqs = h.generate(prompts, steps)
    h.reset()
    assert calls.count(True) == steps - 2, calls  # every decode step but the mirror's first (a rebuild)
    reference = load_hf_model(path)
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == hf_greedy(reference, prompt, steps)[0], f"prompt of length {len(prompt)}"


@needs_fp32_kernels
@pytest.mark.skipif(
    1 not in fp32_panel_rows(),
    reason="this build's panel kernel leaves one row to F.linear (the one-row path needs AVX2 or AVX-512)",
)
def test_fp32_one_request_takes_the_call_and_equals_transformers(tiny_checkpoints, calls: list[bool]) -> None:
    """One request alone (the kernel's matrix-vector path for every linear): its decode steps run
    through the call and give transformers' greedy tokens."""
    path = tiny_checkpoints.path("llama")
    runner = _runner(path, "float32")
    prompt = random_prompt(9, runner.vocab_size, seed=710)
    steps = 8
    h = Harness(runner)
    (req,) = h.generate([prompt], steps)
    h.reset()
    assert calls.count(True) == steps - 2, calls  # every decode step but the mirror's first (a rebuild)
    assert req.output_ids == hf_greedy(load_hf_model(path), prompt, steps)[0]


@needs_fp32_kernels
def test_fp32_rows_below_the_panel_kernel_stay_with_the_layers(
    tiny_checkpoints, calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fewer rows than the panel kernel takes (its band made to start at two rows, wherever it
    starts on this host): the stack's linears are F.linear's, so the call (whose linears are the
    panel kernel's) must decline, and the two modes give the same bits."""
    monkeypatch.setattr(prepacked, "FP32_PANEL_MIN_ROWS", dict.fromkeys(prepacked.FP32_PANEL_MIN_ROWS, 2))
    runner = _runner(tiny_checkpoints.path("llama"), "float32")
    requests = min(fp32_panel_rows()) - 1
    layered = _decode_logits(runner, [False] * 3, requests=requests)
    calls.clear()
    asked = _decode_logits(runner, [True] * 3, requests=requests)
    assert len(calls) >= 3 and not any(calls), calls  # (the prefills, then three decode steps, all declined)
    assert all(torch.equal(a, b) for a, b in zip(layered, asked))


@needs_bf16_kernels
def test_windowed_layers_in_the_call_past_the_window(tiny_checkpoints, calls: list[bool]) -> None:
    """qwen2_swa: two full layers (the mirror), two windowed ones (W = 24, their own pool's slots): the
    call writes and gathers the windowed layers' keys as the backend does, bit for bit, while the
    requests' keys pass the window."""
    runner = _runner(tiny_checkpoints.path("qwen2_swa"))
    layered = _decode_logits(runner, [False] * 5, requests=3, first_len=20)
    calls.clear()
    one_call = _decode_logits(runner, [True] * 5, requests=3, first_len=20)
    assert calls == [False] * 3 + [True] * 4, calls  # two prefills, the mirror's rebuild, then the call
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"decode step {step} differs"


def test_a_model_of_windowed_layers_only_stays_with_the_layers(tiny_checkpoints, calls: list[bool]) -> None:
    """mistral_swa: every layer windowed, so no layer keeps a decode mirror for the call to append to."""
    runner = _runner(tiny_checkpoints.path("mistral_swa"))
    logits = _decode_logits(runner, [True] * 3)
    assert not any(calls) and all(torch.isfinite(x).all() for x in logits)


def test_declines_without_amx_or_when_turned_off(tiny_checkpoints, calls: list[bool]) -> None:
    """Copies in the AMX layout with AMX off: the stack's linears are oneDNN's, so the call must
    decline (copies in the dot-product layout, a CPU without AMX, never needed AMX)."""
    runner = _runner(tiny_checkpoints.path("llama"))
    with kernel_library.use_amx(False):
        without_amx = _decode_logits(runner, [True] * 3)
    assert calls == [False] * 3 + [BF16_KERNELS == "dp"] * 2, calls  # two prefills, the rebuild, two appends
    calls.clear()
    turned_off = _decode_logits(runner, [False] * 3)
    assert not any(calls)
    with kernel_library.use_amx(False):  # the same path both times: the same bits
        assert all(torch.equal(a, b) for a, b in zip(without_amx, _decode_logits(runner, [False] * 3)))
    assert all(torch.isfinite(x).all() for x in turned_off)
