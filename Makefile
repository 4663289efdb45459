# Two commands do all setup: `make demo` and `make test`. Each creates .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check "$(TORCH)"
	$(PIP) install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/remat demo

# The suite, and every shipped rule property-tested on both backends by remat's pytest plugin
# (engine.testing.plugin), derandomized; a file per worker, one worker per core (pytest-xdist),
# the longest files first (tests/conftest.py LONGEST_FIRST).
test: $(STAMP)
	$(PY) -m pytest --remat-rules rules --remat-profile ci -n auto --dist loadfile --no-loadscope-reorder

check: $(STAMP)
	$(VENV)/bin/remat check rules/

bench: $(STAMP)
	$(PY) bench/match_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
