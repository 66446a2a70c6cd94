# Quick start: `make demo` runs the main job, `make test` runs the tests. Both set up what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: the demo needs the package alone; the tests add the `test` and `light` extras on top.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: demo test install clean browser

install: $(TEST_STAMP)

# torch is pinned and installed first: a CPU build of 2.13.0 lies on these machines' disks, while an
# unpinned torch would pull a multi-gigabyte CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) -e '.[test,light]'
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/swarm demo

test: $(TEST_STAMP) browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The health page's browser test drives Debian's Chromium (never a downloaded browser). As root, install
# it when missing; otherwise stop here with the command to run.
CHROMIUM := /usr/bin/chromium
browser:
	@if [ ! -x $(CHROMIUM) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; fi
	@test -x $(CHROMIUM) || { echo "make test: Chromium is missing; the health page's browser test needs it." \
		"Install it with: sudo apt-get install -y chromium" >&2; exit 1; }

clean:
	rm -rf $(VENV) build *.egg-info
