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

# `make test` leaves out the engine connectors' tests against vLLM and SGLang
# (ctest label `engines`): their two venvs (each engine with its own CUDA torch
# build, about 10 GB together) take about 13 minutes each to download on a
# cold machine. `make test-engines` runs them; a second run reuses the venvs.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE engines

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
