"""Session-wide fixtures and the suite's kinds.

Tiny checkpoints are built once per test session, on first use. Tests are sorted by kind into
folders (``unit/<package>/``, ``e2e/``, ``gpu/``); each test gets the marker of its folder
(``e2e``, ``gpu``), so ``pytest -m "not e2e"`` runs the fast part. ``requires_cuda`` (every test
under ``gpu/`` has it) is the one place that skips a test on a machine without a CUDA GPU.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

# Make the repository root importable however pytest was started: the product packages and
# ``tests.support`` (the helpers every kind of test shares) are imported from there.
_TESTS = Path(__file__).resolve().parent
if str(_TESTS.parent) not in sys.path:
    sys.path.insert(0, str(_TESTS.parent))

# Test modules import helpers from tests.support before pytest would rewrite their asserts.
pytest.register_assert_rewrite("tests.support")

from tests.support.checkpoints import CHECKPOINT_NAMES, ENCODER_CHECKPOINT_NAMES, TinyCheckpoints  # noqa: E402

if TYPE_CHECKING:
    from tests.support.tp_threads import ThreadTPGroup


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Lazy builder: ``tiny_checkpoints.path(name)`` / ``.sharded(name)``, each built once."""
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny_checkpoints"))


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_checkpoints: TinyCheckpoints) -> Path:
    """The tiny Llama checkpoint folder (tokenizer included): the default for other tests."""
    return tiny_checkpoints.path("llama")


@pytest.fixture(scope="session")
def tiny_llama_other_weights(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with every tensor moved by a little noise: the same model with other weights (an
    RL step's), for weight updates in place."""
    from tests.support.checkpoints import perturbed_copy

    return perturbed_copy(tiny_llama_path, tmp_path_factory.mktemp("weights") / "llama_other", seed=7)


@pytest.fixture(scope="session", params=CHECKPOINT_NAMES)
def tiny_checkpoint(request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints) -> Iterator[tuple[str, Path]]:
    """``(name, folder)`` for each tiny architecture: llama, mistral, qwen2, qwen3, llama_tied_llama3."""
    yield request.param, tiny_checkpoints.path(request.param)


@pytest.fixture(scope="session", params=ENCODER_CHECKPOINT_NAMES)
def tiny_encoder_checkpoint(
    request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints
) -> Iterator[tuple[str, Path]]:
    """``(name, folder)`` for each tiny encoder: bert, bert_classifier, xlm_roberta, xlm_roberta_classifier."""
    yield request.param, tiny_checkpoints.path(request.param)


@pytest.fixture
def thread_tp_group() -> Iterator["ThreadTPGroup"]:
    """A TP group of two threads (tests/support/tp_threads.py), registered as the process's TP
    group for the test: TP=2 shards checked against TP=1 without spawning processes."""
    from runtime.engine import distributed
    from tests.support.tp_threads import ThreadTPGroup

    group = ThreadTPGroup(2)
    distributed.set_tp_group(group)
    yield group
    distributed.set_tp_group(None)


def _kernel_levels() -> tuple[str, ...]:
    from runtime.engine.cpu import kernel_library

    return kernel_library.host_levels()


@pytest.fixture(params=_kernel_levels())
def kernel_level(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU kernels' build of each instruction-set level this CPU runs (AVX-512 + BF16, AVX-512,
    AVX2, plain C): a test that uses it runs once per level (``pytest.mark.usefixtures``)."""
    from runtime.engine.cpu import kernel_library

    with kernel_library.use_level(request.param):
        yield request.param


@pytest.fixture(params=[True, False], ids=["amx", "no-amx"])
def amx(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The kernels that have an AMX path on AMX tiles (where the CPU has them and the build is
    avx512bf16) and without them; yields whether AMX is in use."""
    from runtime.engine.cpu import kernel_library

    with kernel_library.use_amx(request.param) as used:
        assert used == (request.param and kernel_library.amx_available() and kernel_library.level() == "avx512bf16")
        yield used


@pytest.fixture
def one_call_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Per forward that asked the CPU's one-call decode stack (``runtime.engine.cpu.decode_layers.run``):
    whether it ran the layers (True) or declined."""
    from runtime.engine.cpu import decode_layers

    seen: list[bool] = []
    real = decode_layers.run

    def run(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(decode_layers, "run", run)
    yield seen


_FOLDER_MARKERS = {"e2e": "e2e", "gpu": "gpu"}
OPT_IN_MARKERS = ("real_1p5b",)
"""Tests too costly for the suite's budget (a 1.5B model's start): run only with ``-m real_1p5b``."""


@cache
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    """The plugins that run slow work beside the tests: the type check, real models' references."""
    from tests.support import background_reference, background_typecheck

    for plugin in (background_typecheck, background_reference):
        if not config.pluginmanager.is_registered(plugin):
            config.pluginmanager.register(plugin)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its folder's kind; a GPU test also requires CUDA. Tests marked with an
    opt-in marker (``OPT_IN_MARKERS``) are deselected unless ``-m`` names that marker."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(_TESTS).parts
        marker = _FOLDER_MARKERS.get(parts[0]) if len(parts) > 1 else None
        if marker is not None:
            item.add_marker(marker)
        if marker == "gpu":
            item.add_marker("requires_cuda")
    markexpr = config.getoption("markexpr") or ""
    opted_out = [name for name in OPT_IN_MARKERS if name not in markexpr]
    dropped = {id(item) for item in items if any(item.get_closest_marker(name) for name in opted_out)}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_cuda") is not None and not cuda_available():
        pytest.skip("needs a CUDA GPU")
