# Two commands on a fresh machine: `make demo` and `make test`. Both build (or reuse) a virtual
# environment cached outside the clone, keyed by a hash of the dependency pins, then run.
PYTHON      ?= python3
TORCH_SPEC  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CACHE_DIR   ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvoffload
PYTEST_ARGS ?=
# pytest-xdist workers (auto: one per core); tests are spread one by one (`--dist load`); the 25 slowest are
# listed at the end (where the suite's time goes)
TEST_WORKERS ?= auto

# tomllib (below) and the project need Python >= 3.11: say so before anything else fails
ifneq ($(shell $(PYTHON) -c 'import sys; print(sys.version_info >= (3, 11))' 2>/dev/null),True)
$(error kvoffload needs Python >= 3.11: $(PYTHON) is "$(shell $(PYTHON) -V 2>&1)"; choose one with make PYTHON=python3.12 ...)
endif

# The key covers what the environment is built from: the dependency pins (not the rest of pyproject.toml).
ENV_KEY := $(shell { $(PYTHON) -c 'import json, sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
             print(json.dumps([p["dependencies"], p["optional-dependencies"]], sort_keys=True)); print(sys.version)'; \
             cat requirements/cpu-lock.txt scripts/setup-env.sh; echo "$(TORCH_SPEC)"; } | sha256sum | cut -c1-16)
VENV    := $(CACHE_DIR)/venv-$(ENV_KEY)
export PATH := $(VENV)/bin:$(PATH)

.PHONY: demo test lint env clean-env
demo: env
	kvoffload demo

test: env lint
	python -m pytest -n $(TEST_WORKERS) --dist load --durations=25 $(PYTEST_ARGS)

# ruff (lint, format) and mypy over the package and the runner (their settings: pyproject.toml)
lint: env
	python -m ruff check kvoffload glm_integration
	python -m ruff format --check kvoffload glm_integration
	python -m mypy

env: $(VENV)/.complete
	@# the environment is shared by clones: point its editable install at this one, every time
	@python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
		>$(VENV).install.log 2>&1 || { tail -n 20 $(VENV).install.log; exit 1; }
	@# .venv: the environment's usual name in a clone (`. .venv/bin/activate`)
	@ln -sfn $(VENV) .venv

$(VENV)/.complete:
	PYTHON=$(PYTHON) TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' scripts/setup-env.sh $(VENV)

clean-env:
	rm -rf $(VENV) $(VENV).log $(VENV).lock $(VENV).install.log
