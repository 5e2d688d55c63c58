# fsdp-sentinel: two commands for users (make demo, make test); the rest help.
VENV   := .venv
PY     := $(VENV)/bin/python
OUT    ?= out

.PHONY: setup demo test lint typecheck pytest clean lab-down

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m fsdp_sentinel demo --out $(OUT)/demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

pytest: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

lab-down: setup
	$(PY) -m fsdp_sentinel lab down

clean:
	rm -rf $(OUT) .mypy_cache .ruff_cache .pytest_cache
