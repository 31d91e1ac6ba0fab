# tfjax on a fresh machine with Python >= 3.11 and pip:
#   make test    create .venv if missing, install tfjax[test], run the suite (all but
#                the tests marked slow)
#   make test-slow  the tests marked slow (multi-process, kill -9, notebooks, the
#                largest interpret-mode kernel cases); CI runs both
#   make train   create .venv if missing, train the tiny default decoder LM on the
#                stdlib corpus (CPU, a few minutes); rerun to resume from WORKDIR
#   make docs    create .venv if missing, install tfjax[docs], build docs/ into
#                docs/_build/html with warnings as errors
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2
WORKDIR ?= workdirs/default
TRAIN_ARGS ?=

.PHONY: test test-slow train docs install clean

# Training needs the package; the tests also need pytest, libtpu (the `tpu`
# extra, with which the TPU compiler runs on this CPU to check that the Pallas
# kernels and sharded steps really compile for TPUs), torch + transformers (the
# `hf` extra: checkpoint-import parity tests) and nbclient (the `notebooks` extra:
# colab/ notebooks run top to bottom), wandb (the `tracking` extra: offline W&B runs) and
# lm_eval (the `eval` extra: the lm-eval-harness backend's parity test), fastapi + uvicorn
# (the `serve` extra: tests/serve/ start the server and talk to it with openai's client).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,tpu,hf,data,vision,cloud,notebooks,tracking,eval,serve,posttrain,interp]"
	touch $@

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" tests

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS) -m slow tests

train: $(VENV)/.installed
	$(PY) -m tfjax.train --config configs/default.py --workdir $(WORKDIR) $(TRAIN_ARGS)

# The API reference imports tfjax (autodoc); the site's pages are MyST Markdown.
docs: $(VENV)/.installed-docs
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache docs/_build
