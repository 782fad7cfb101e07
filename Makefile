# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv and install the project (with its pinned torch) when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CUDA build of torch that also runs on the CPU; pip finds these on the local disk here.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.installed

.PHONY: venv test test-all demo benchmark lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install $(TORCH_PINS)
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

demo: $(STAMP)
	$(PY) tools/demo.py

benchmark: $(STAMP)
	$(PY) tools/benchmark.py

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf outputs build *.egg-info
