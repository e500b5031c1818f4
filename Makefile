# Two entry points, both self-installing on a fresh machine (see README):
#   make demo   - installs, then runs the main job (`hyperdcp demo`, then `hyperdcp demo --recovery`)
#   make test   - installs, then runs the whole test suite
#   make bench  - installs with the bench extra (matplotlib), then runs every benchmark
#   make lint   - installs with the lint extra (pinned ruff and mypy), then runs both
#
# Where: the active virtual environment's python3; outside one, the virtual environment
# .venv, made here once with --system-site-packages (what python3 already has, pip included,
# is reused, not downloaded again), since distributions that mark their Python as externally
# managed refuse pip installs into it. PY=... names another interpreter.
ifndef PY
ifeq ($(shell python3 -c 'import sys; print(sys.prefix != sys.base_prefix)'),True)
PY = python3
else
VENV = .venv
PY = $(VENV)/bin/python
endif
endif
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: venv install install-base demo test bench lint

venv: $(if $(VENV),$(VENV)/bin/python)

ifdef VENV
$(VENV)/bin/python:
	if python3 -m pip --version >/dev/null 2>&1; then \
		python3 -m venv --system-site-packages --without-pip $(VENV); \
	else python3 -m venv --system-site-packages $(VENV); fi || { echo "make: python3 -m venv \
	failed: install python3-venv, or activate a virtual environment" >&2; exit 1; }
endif

# what the demo needs: torch and hyperdcp with its own dependencies only
install-base: venv
	$(PIP) torch==2.13.0
	$(PIP) -e .

# what the tests need besides: the test, mindspore and integrations extras, torchtitan (without
# its training-only dependencies, see setup.cfg) and the example (sqlite) plugin
install: install-base
	$(PIP) -e '.[test,mindspore,integrations]'
	$(PIP) --no-deps torchtitan==0.3.0
	$(PIP) -e tests/plugin_pkg

demo: install-base
	$(PY) -m dcp demo
	$(PY) -m dcp demo --recovery

test: install
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup tests

lint: install
	$(PIP) -e '.[lint]'
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: install
	$(PIP) -e '.[bench]'
	$(PY) -m benchmarks
