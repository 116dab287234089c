# Two entry points on a fresh machine: `make run` and `make test`.
# torch is pinned to the CPU build that lies on this disk; a wider range would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Once upon a time

.PHONY: install run test lint bench clean

$(VENV)/.installed: pyproject.toml
	@echo "==> creating $(VENV) with $(PYTHON)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH_SPEC) (the CPU build)"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	@echo "==> installing Strata and its test tools"
	$(PY) -m pip install --progress-bar on -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	@echo "==> telling a story with the bundled model (the first run builds Strata's CPU kernels once)"
	$(VENV)/bin/strata generate --prompt "$(PROMPT)" --max-tokens 200 --temperature 0.8 --seed 0

# Strata's C++ kernels are built for this CPU. Where it has AVX-512, their tests run a second time on kernels
# built for x86-64-v3 (AVX2 and FMA, no AVX-512), so the paths of CPUs without AVX-512 are tested here too.
KERNEL_TESTS := tests/platforms/cpu

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
