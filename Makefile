# Skiff: `make serve` (start every role on this machine) and `make test` (CPU, what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS ?= .models
DEFAULT_MODEL := SmolLM2-135M-Instruct.Q4_1.gguf
HOST ?= 127.0.0.1
PORT ?= 8000
DEVICES ?= auto
# CPU machines take the CPU wheel; a bare `torch` would pull several GB of CUDA.
TORCH ?= torch==2.13.0
# The GPU machine's Triton; on CPU machines its interpreter runs the kernels in the tests.
TRITON ?= triton==3.6.0
# pytest's workers: one per core (pytest-xdist)
JOBS ?= auto
# Two stamps: serving needs only the runtime; the tests add the oracles (llama.cpp, openai).
RUNTIME_STAMP := $(VENV)/.skiff-runtime
STAMP := $(VENV)/.skiff-installed

.PHONY: install install-runtime models test lint pytest serve gpu-wheels gpu-payload clean browser

$(RUNTIME_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" "$(TRITON)"
	$(PY) -m pip install -q -e .
	touch $@

$(STAMP): $(RUNTIME_STAMP)
	# llama-cpp-python compiles llama.cpp (~6 min; 4.7 without its multimodal library, which
	# nothing here uses); pip keeps the wheel in its cache afterwards
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip install -q -e ".[test]"
	touch $@

install-runtime: $(RUNTIME_STAMP)

install: $(STAMP)

$(MODELS)/.fetched: tools/fetch_models.py | $(RUNTIME_STAMP)
	$(PY) -m tools.fetch_models $(MODELS)
	touch $@

models: $(MODELS)/.fetched

# Only the default model: what `make serve` needs, without the test models.
$(MODELS)/$(DEFAULT_MODEL): | $(RUNTIME_STAMP)
	$(PY) -m tools.fetch_models $(MODELS) --only smollm2

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Headless Chromium for the chat page's browser test (Debian's package, where apt and root are
# at hand; elsewhere that test skips and says why)
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium \
	  >/dev/null; }; }; } || echo "no chromium here: the chat page's browser test will skip"

pytest: $(STAMP) models browser
	# Triton kernels run on the CPU under the interpreter (small shapes); natively on a GPU
	TRITON_INTERPRET=1 SKIFF_MODELS_DIR=$(MODELS) $(PY) -m pytest -q -p no:cacheprovider \
	  -n $(JOBS) --durations=25

test: lint pytest

# The gateway and one worker per device (every CUDA device, else the CPU) until Ctrl-C.
serve: $(RUNTIME_STAMP) $(MODELS)/$(DEFAULT_MODEL)
	$(PY) -m shared.cli serve $(MODELS)/$(DEFAULT_MODEL) --host $(HOST) --port $(PORT) \
	  --devices $(DEVICES)

# Wheels the GPU machine lacks (Python 3.12, manylinux), carried to it in .whl/ (the openai SDK
# and its dependencies only for the service tests there)
gpu-wheels:
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl gguf==0.19.0 \
	  msgspec pyzmq lmdb "llguidance>=1.9,<2" \
	  openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
	  jiter distro sniffio httpx2==2.16.2 httpcore2==2.16.2 anyio truststore typing-extensions \
	  jsonschema jsonschema-specifications referencing rpds-py

# What a device call carries (`carry: [".whl", ".device", ".tcache"]`): the wheels and the
# llama.cpp-quantized synthetic models (their dequantized twins and the llama f32 stay, 40 MB
# each; test_gpu_model writes its small f32 models there); .tcache: `tools/gpu_cache.sh fetch`.
gpu-payload: gpu-wheels models
	mkdir -p .device/models/synthetic
	# files that only the exhaustive tier reads (the CPU suite never writes them)
	$(PY) -c "from pathlib import Path; from tests.test_qkv_rope_model import SPEC; \
	  from tools.synthetic_gguf import synthetic; synthetic(SPEC, 'Q4_K_M', Path('$(MODELS)/synthetic'))"
	find $(MODELS)/synthetic -name '*.gguf' ! -name '*dequant*' ! -name '*.f32.gguf' \
	  -size -20M -exec cp {} .device/models/synthetic/ \;
	du -sh .whl .device $(wildcard .tcache)

clean:
	rm -rf $(VENV) $(MODELS)
