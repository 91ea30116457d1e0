# The first two targets are the README's first two commands: both build .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt requirements-nodeps.txt | sha1sum | cut -c1-12)

.PHONY: demo test test-slow test-all test-fast lint bench clean

demo: $(STAMP)
	$(BIN)/tierckpt demo

# make test: lint and every test not marked slow (about 5 minutes on 2 cores); make test-slow: the
# scenario tests (multi-process jobs, kill -9, namespaced hosts, Slurm); CI (.ci/run) runs both.
test: $(STAMP)
	@sh tests/cluster/install.sh  # root with apt: iproute2, slurm-wlm, munge when missing
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	@sh tests/cluster/install.sh
	# two workers: the scenarios mostly wait (detection, restarts); hosts and benches each stay serial (tests/conftest.py)
	$(BIN)/python -m pytest -q -m slow -n 2 --dist loadgroup --durations=30

test-all: test test-slow

test-fast: test

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/tierckpt bench local

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU wheel of torch, pinned for this machine; the package itself asks for torch>=2.6
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	# torchtitan without its declared (nightly, unused) dependencies: see requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

clean:
	rm -rf $(VENV) demo-output .pytest_cache
