# tfjax: two commands on a fresh machine with Python >= 3.11 and pip.
#   make test    create .venv if missing, install tfjax[test], run the suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) .pytest_cache
