# Quick start: `make demo` runs the main job, `make test` runs the tests. Both set up what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: the demo needs the package alone; the tests add the `test` and `light` extras on top.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check

.PHONY: demo test install clean system

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

test: $(TEST_STAMP) system
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# What the tests need from the system: Debian's Chromium for the health page's browser test (never a
# downloaded browser), iproute2 and nftables for the internet in a box (hosts in network namespaces). As
# root, install what is missing; otherwise the browser test stops here with the command to run, and the box's
# tests say what they miss.
CHROMIUM := /usr/bin/chromium
system:
	@missing=""; [ -x $(CHROMIUM) ] || missing="$$missing chromium"; \
	command -v nft >/dev/null || missing="$$missing nftables"; command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi
	@test -x $(CHROMIUM) || { echo "make test: Chromium is missing; the health page's browser test needs it." \
		"Install it with: sudo apt-get install -y chromium" >&2; exit 1; }

clean:
	rm -rf $(VENV) build *.egg-info
