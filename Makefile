# Two user-facing commands: `make test` and `make demo`. Both call `make install`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Pinned CPU wheel (on disk on the CPU machines). On a GPU machine the system torch is kept.
CPU_TORCH ?= torch==2.13.0
# Upper bounds: the versions the suite last passed with (README, Set-up); every pip install below keeps to them.
CONSTRAINTS := requirements/constraints.txt

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/assets.txt $(CONSTRAINTS)
	@if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "GPU torch found: keeping it (venv with system site-packages)"; \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PIP) install -q -c $(CONSTRAINTS) $(CPU_TORCH); \
	fi
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev,gguf]"
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps -r requirements/assets.txt
	touch $(STAMP)

# Two pytest processes (pytest-xdist), each test file in one of them, one torch thread each: the suite's
# multi-process tests (torchrun, gloo) leave a core idle most of their time. TEST_WORKERS=0 runs in one process.
# Files go out in tests/conftest.py's order (the minutes-long ones first), not xdist's (most tests first).
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install
	$(PYTEST) tests

# The quick lane (under 3 minutes on 2 cores): every test but those tests/slow.txt lists.
test-fast: install
	$(PYTEST) -m "not slow" tests

demo: install
	$(PY) -m nemo_dflash.recipes.pipeline --config smollm2_demo.yaml

bench: install
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
