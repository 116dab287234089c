# Two entry points on a fresh machine: `make run` and `make test`.
# torch is pinned to the CPU build that lies on this disk; a wider range would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Once upon a time

.PHONY: install run test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/strata generate --prompt "$(PROMPT)" --max-tokens 200 --temperature 0.8 --seed 0

# Strata's C++ kernels are built for this CPU. Where it has AVX-512, their tests run a second time on kernels
# built for x86-64-v3 (AVX2 and FMA, no AVX-512), so the paths of CPUs without AVX-512 are tested here too.
KERNEL_TESTS := tests/layers tests/attention tests/sample

test: install
	$(PY) -m pytest -q
	if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		STRATA_CPU_KERNEL_TARGET=x86-64-v3 $(PY) -m pytest -q $(KERNEL_TESTS); fi
	$(VENV)/bin/ruff check .

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
