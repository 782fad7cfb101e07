# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv and install the project (with its pinned torch) when missing.
# Other machines (docs/install.md):
#   make test                                           the tested torch, from pip's index
#   make TORCH_INDEX=<wheel index of your CUDA / CPU build> test
#   make TORCH_INDEX=<...> TORCH_PINS="torch==X torchvision==Y" CONSTRAINTS= test
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The tested torch (a CUDA build that also runs on the CPU).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# A PyTorch wheel index for another CUDA version or a CPU-only build; empty: pip's default.
TORCH_INDEX ?=
# The tested versions of everything else; empty to let pip choose (e.g. with an older torch).
CONSTRAINTS ?= constraints.txt
STAMP := $(VENV)/.installed
# pytest-xdist worker processes for the suite: one per CPU core (auto); 0 runs in one process.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

.PHONY: venv test test-all demo benchmark lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): $(PY) setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PY) -c "import torch, torchvision" 2>/dev/null || \
		$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PINS)
	$(PY) -m pip install $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# pytest's default selection (setup.cfg): every test not marked slow or gpu
test: $(STAMP)
	$(PYTEST)

# the slow tests too (CI: .ci/run); the 30 slowest tests listed at the end
test-all: $(STAMP)
	$(PYTEST) -m "not gpu" --durations=30

demo: $(STAMP)
	$(PY) tools/demo.py

benchmark: $(STAMP)
	$(PY) tools/benchmark.py

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf outputs build *.egg-info
