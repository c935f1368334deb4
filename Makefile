# Two entry points for a fresh machine: `make run` and `make test`.
# Both create .venv, install a CPU torch when none is there, build and install
# enginecore (the C++ extension compiles from source), then do their job.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.enginecore-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*) $(shell find python -name '*.py')
PROMPT ?= What is the capital of France?

.PHONY: install run test bench gpu-check clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install '.[test]'
	touch $@

run: $(STAMP)
	$(VENV)/bin/enginecore generate "$(PROMPT)"

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m pytest bench --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds

# CUDA tests + throughput vs transformers on a GPU machine (installs what it lacks;
# results in $$OUT or ./gpu-check-results). ENGINECORE_GPU_CHECK_ON_CPU=1: dry run on the CPU.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build dist gpu-check-results
