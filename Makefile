# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint fmt clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --disable-pip-version-check -q --upgrade pip
	$(BIN)/pip install --disable-pip-version-check -q -e '.[dev]'
	@# xds-protos (the epp extra) carries an old copy of opentelemetry/proto/*_pb2.py that can land over
	@# opentelemetry-proto's own: put the real ones back (the simulator's OTLP exporter, the tests' receiver)
	$(BIN)/pip install --disable-pip-version-check -q --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

## Start the gateway on :8080 with two simulated vLLM pools (no GPU, no Redis).
run: $(STAMP)
	$(BIN)/specgate demo

## Set up and run the whole test suite (the console's browser tests need Debian's chromium: installed here
## when run as root with apt, else they skip and say so).
test: $(STAMP)
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || \
		echo "note: no /usr/bin/chromium: the console's browser tests skip (apt-get install chromium)"
	$(BIN)/pytest -q

## ruff + mypy strict on the package.
lint: $(STAMP)
	$(BIN)/ruff check gateway tests
	$(BIN)/ruff format --check gateway
	$(BIN)/mypy gateway

fmt: $(STAMP)
	$(BIN)/ruff format gateway tests
	$(BIN)/ruff check --fix gateway tests

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
