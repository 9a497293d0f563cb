# The two commands: `make run` and `make test`. Both install missing Debian
# packages (scripts/install-deps), configure and build first.
BUILD ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test run fuzz bench gpu-bundle clean

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

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
