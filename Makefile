# Flightdeck: every target installs what it needs into .venv first; re-running is fast.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: constraints install demo test test-unit test-integration lint chaos soak explore clean chromium bench-peers
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[dev,trainer,examples]"
	@touch $(STAMP)

# A new release of a dependency (msgspec 0.23 changed two messages) must not reach CI untested: install takes
# constraints.txt; this rewrites it from a clean venv with the newest releases, to test and commit.
constraints:
	rm -rf /tmp/flightdeck-constraints && $(PY) -m venv /tmp/flightdeck-constraints
	/tmp/flightdeck-constraints/bin/python -m pip install -q --upgrade pip
	/tmp/flightdeck-constraints/bin/python -m pip install -q "torch==2.13.0" -e ".[dev,trainer,examples]"
	(head -2 constraints.txt; /tmp/flightdeck-constraints/bin/pip freeze --exclude-editable | grep -v "^torch==") \
		> constraints.new && mv constraints.new constraints.txt

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flightdeck.services.tools.console.demo

# Whole files go to one of 4 workers (--dist loadfile): a file's tests may share a module-scoped platform. The suite
# mostly waits on processes: on a 2-core box 4 workers took 12m05s where 3 took 13m44s (fresh clones, 2026-11-30).
TEST_WORKERS ?= 4
# Bytecode caches on for the suite (some boxes, ours included, export PYTHONDONTWRITEBYTECODE=1): without them each
# worker rewrote the asserts of every test file it collected again, 14 instead of 9 CPU-s per worker.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# The dashboard's browser test drives Debian's chromium through Playwright (Playwright's own browser download needs
# the internet); installed once, from apt, when missing.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "installing chromium (apt) for the dashboard's browser test"; \
	  $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium >/dev/null; }; }

test: $(STAMP) chromium
	$(PYTEST) -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test-unit: $(STAMP)
	$(PYTEST) -q tests/unit tests/contract

test-integration: $(STAMP)
	$(PYTEST) -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests/integration

lint: $(STAMP)
	$(BIN)/ruff check events services trainer flightdeck tests bench examples
	$(BIN)/mypy -p flightdeck

chaos: $(STAMP)
	$(PYTEST) -q tests/chaos

# The fault explorer (services/tools/explore) beyond the suite's thousand seeds: SOAK_S seconds of seeds from 100000
# on, on both cores (an hour by default), then the real-process nemesis's longer schedules. A failing seed prints the
# command that replays it.
SOAK_S ?= 3600
NEMESIS_SCHEDULES ?= 10
soak: $(STAMP)
	$(BIN)/python -m flightdeck.services.tools.explore --from 100000 --seeds 100000000 --budget-s $(SOAK_S) --jobs 2
	FLIGHTDECK_NEMESIS_SCHEDULES=$(NEMESIS_SCHEDULES) $(PYTEST) -q -p no:cacheprovider tests/nemesis

explore: $(STAMP)
	$(BIN)/python -m flightdeck.services.tools.explore --seeds 1000

# bench/vs_peers.py: Flightdeck against torchrun, DLRover and torchft on the same script and faults, in a venv of
# its own (the peers' dependencies stay out of the tested install). About 40 minutes on 2 cores.
PEERS := .venv-peers
PEERS_RUNS ?= 5

$(PEERS)/.installed: pyproject.toml
	@test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS) || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q --upgrade pip
	$(PEERS)/bin/python -m pip install -q "torch==2.13.0" -e ".[dev,trainer,peers]"
	@touch $@

bench-peers: $(PEERS)/.installed
	$(PEERS)/bin/python bench/vs_peers.py --runs $(PEERS_RUNS) --out bench/results/cpu-vs-peers.json

clean:
	rm -rf $(VENV) $(PEERS) .flightdeck
