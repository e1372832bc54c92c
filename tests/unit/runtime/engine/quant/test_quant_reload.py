"""A weight update of a server that keeps a GGUF file's blocks (``--quantization gguf``, what ``auto``
picks on CPUs without native bf16): the new file's blocks are written into the served ones in place
(every tensor keeps its storage) and serve what a fresh load of the new file serves; a file whose
weights come in another format, or a safetensors folder, is refused with the served weights intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.engine.loading.weight_reload import WeightReloadError, reload_weights
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.weight import QuantizedWeight
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import _decode_logits
from tests.unit.runtime.engine.quant.test_quant_model import _weights


@pytest.fixture(scope="module")
def files(
    tiny_checkpoints: TinyCheckpoints, tiny_llama_other_weights: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    with gguf_test_folder(tmp_path_factory, "quant-reload") as folder:
        # the real model's mix: Q4_1 linears and a Q8_0 token embedding tied to the LM head
        mix: dict[str, Any] = {"tokenizer": False, "tie": True, "types": {"token_embd.weight": "Q8_0"}}
        yield {
            "served": write_checkpoint_gguf(
                tiny_checkpoints.path("llama"), folder / "served-Q4_1.gguf", weight_type="Q4_1", **mix
            ),
            "other": write_checkpoint_gguf(
                tiny_llama_other_weights, folder / "other-Q4_1.gguf", weight_type="Q4_1", **mix
            ),
            "q8": write_checkpoint_gguf(
                tiny_llama_other_weights, folder / "other-Q8_0.gguf", weight_type="Q8_0", **mix
            ),
        }


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(
        path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False, quantization="gguf"
    )


def _values(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {name: w.dequantize() for name, w in _weights(runner).items() if isinstance(w, QuantizedWeight)}


def test_the_new_files_blocks_fill_the_served_ones_in_place(files: dict[str, Path]) -> None:
    runner = _runner(files["served"])
    served = _weights(runner)
    storage = {name: w.qs.data_ptr() for name, w in served.items() if isinstance(w, QuantizedWeight)}
    assert storage, "the gguf load keeps blocks"
    reload_weights(runner, _runner(files["other"]).model_path)
    fresh = _runner(files["other"])
    after = _weights(runner)
    for name, data_ptr in storage.items():
        assert after[name] is served[name] and after[name].qs.data_ptr() == data_ptr, name  # the same tensors
    fresh_values = _values(fresh)
    for name, values in _values(runner).items():
        assert torch.equal(values, fresh_values[name]), name
    for a, b in zip(_decode_logits(runner, [True] * 3, requests=2), _decode_logits(fresh, [True] * 3, requests=2)):
        assert torch.equal(a, b)


def test_other_formats_are_refused_and_the_served_weights_stay(files: dict[str, Path], tiny_llama_path: Path) -> None:
    runner = _runner(files["served"])
    before = _values(runner)
    with pytest.raises(WeightReloadError, match="reloads only in the same format"):
        reload_weights(runner, _runner(files["q8"]).model_path)
    with pytest.raises(WeightReloadError, match="reloads only GGUF files"):
        reload_weights(runner, tiny_llama_path)
    after = _values(runner)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(isinstance(w, QuantizedWeight) for w in _weights(runner).values() if w is not None)
