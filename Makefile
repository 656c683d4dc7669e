# gpuwatch developer entry points. `make demo` and `make test` are the two commands README.md opens with.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install install-test demo lint test proto bench

install:
	$(PIP) install -q -e .

install-test:
	$(PIP) install -q -e ".[test,torch]"

demo: install
	gpuwatch demo

# The checks CI runs before the tests: layer contracts, types ([tool.mypy]) and style ([tool.ruff]).
lint: install-test
	lint-imports
	$(PYTHON) -m mypy
	$(PYTHON) -m ruff check .

test: install-test
	$(PYTHON) -m pytest -q

# Regenerate the checked-in gRPC stubs after editing proto/ (tests/test_proto_stubs.py fails when they are stale).
proto:
	$(PYTHON) -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. proto/gpuwatch/v1/*.proto

bench: install
	$(PYTHON) bench/ingest.py
	$(PYTHON) bench/analyze.py
	$(PYTHON) bench/probe_overhead.py
	$(PYTHON) bench/predict.py
