# The two commands: `make run` and `make test`. Both install missing Debian
# packages (scripts/install-deps), configure and build first.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test test-engines run fuzz bench gpu-bundle clean

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# `make test` runs every test, the engine connectors' tests against vLLM and
# SGLang included (ctest label `engines`). Their venvs (each engine with its
# own CUDA torch build; 13 GB with the package's test venv, the files the
# three share taken once through uv's cache) take a minute or two to download
# on a cold machine, and are made while the C++ build runs (network-bound uv
# beside compile-bound ninja); ctest's venv fixtures then find them made (or
# retry one that failed, with its error in the log).
VENVS = python-venv:python/requirements-test.txt vllm-venv:python/requirements-vllm.txt \
	sglang-venv:python/requirements-sglang.txt
test: configure
	@for v in $(VENVS); do \
	  scripts/python-venv $(BUILD)/$${v%%:*} $(CURDIR)/$${v#*:} >$(BUILD)/$${v%%:*}.log 2>&1 & \
	done; \
	cmake --build $(BUILD) -j $(JOBS); rc=$$?; wait; \
	[ $$rc -eq 0 ] || exit $$rc; \
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Only the engine connectors' tests (the venvs are reused once made).
test-engines: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -L engines

# The main job on its embedded default. See README.md.
run: build
	@scripts/run-default $(BUILD)

fuzz: deps
	scripts/fuzz-decoder $(or $(FUZZ_SECONDS),300)

bench: build
	scripts/run-benchmarks $(BUILD)

# Self-contained GPU tests and benchmarks for the lent GPU machine (GPU.md).
gpu-bundle: deps
	scripts/gpu-bundle

clean:
	rm -rf $(BUILD)
