# Two entry points, both self-installing on a fresh machine (see README):
#   make demo   - installs, then runs the main job (`hyperdcp demo`)
#   make test   - installs, then runs the whole test suite
#   make bench  - installs with the bench extra (matplotlib), then runs every benchmark
#   make lint   - installs with the lint extra (pinned ruff and mypy), then runs both
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install install-base demo test bench lint

# what the demo needs: torch and hyperdcp with its own dependencies only
install-base:
	$(PIP) torch==2.13.0
	$(PIP) -e .

# what the tests need besides: the test and mindspore extras and the example (sqlite) plugin
install: install-base
	$(PIP) -e '.[test,mindspore,integrations]'
	$(PIP) -e tests/plugin_pkg

demo: install-base
	$(PY) -m dcp demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: install
	$(PIP) -e '.[lint]'
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: install
	$(PIP) -e '.[bench]'
	$(PY) -m benchmarks
