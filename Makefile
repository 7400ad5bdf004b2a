# Skiff: `make test` (CPU, what CI runs) and `make serve` (lands with the service pipeline).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS ?= .models
# CPU machines take the CPU wheel; a bare `torch` would pull several GB of CUDA.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.skiff-installed

.PHONY: install models test lint pytest serve gpu-wheels clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# llama-cpp-python compiles llama.cpp (~6 min); pip keeps the wheel in its cache afterwards
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

$(MODELS)/.fetched: tools/fetch_models.py | $(STAMP)
	$(PY) -m tools.fetch_models $(MODELS)
	touch $@

models: $(MODELS)/.fetched

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

pytest: $(STAMP) models
	SKIFF_MODELS_DIR=$(MODELS) $(PY) -m pytest -q -p no:cacheprovider

test: lint pytest

serve:
	@echo "make serve arrives with the service pipeline (gateway + workers); not built yet." >&2
	@echo "For now: $(PY) -m shared.cli generate $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf 'Hi' --chat" >&2
	@exit 1

# Wheels the GPU machine lacks (Python 3.12, manylinux), carried to it in .whl/
gpu-wheels:
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 msgspec pyzmq
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0

clean:
	rm -rf $(VENV) $(MODELS)
