# Flightdeck: every target installs what it needs into .venv first; re-running is fast.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-unit test-integration lint chaos clean chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0" -e ".[dev,trainer,examples]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m services.tools.console.demo

# Whole files go to one of 3 workers (--dist loadfile): a file's tests may share a module-scoped platform.
TEST_WORKERS ?= 3

# The dashboard's browser test drives Debian's chromium through Playwright (Playwright's own browser download needs
# the internet); installed once, from apt, when missing.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "installing chromium (apt) for the dashboard's browser test"; \
	  $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium >/dev/null; }; }

test: $(STAMP) chromium
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/contract

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests/integration

lint: $(STAMP)
	$(BIN)/ruff check events services trainer flightdeck tests bench examples
	$(BIN)/mypy events services trainer flightdeck

chaos: $(STAMP)
	$(BIN)/python -m pytest -q tests/chaos

clean:
	rm -rf $(VENV) .flightdeck
