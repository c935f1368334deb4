# Two entry points for a fresh machine: `make run` and `make test`.
# Both create .venv, install a CPU torch when none is there, build and install
# enginecore (the C++ extension compiles from source), then do their job.
# `make run` installs what running and serving need; `make test` adds the test
# extras (transformers, peft, ray, openai, ...) without building a second time.
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.enginecore-run
STAMP := $(VENV)/.enginecore-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*) $(shell find python -name '*.py' -o -name '*.pyx')
PROMPT ?= What is the capital of France?

# Prints the test extras (tomllib from Python 3.11; pip's vendored tomli before).
define TEST_EXTRAS
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))
endef
export TEST_EXTRAS

.PHONY: install run test bench gpu-check clean

install: $(STAMP)

$(RUN_STAMP): $(SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install .
	touch $@

# The test extras, read from pyproject.toml (no second build of the package).
$(STAMP): $(RUN_STAMP) pyproject.toml
	$(PY) -c "$$TEST_EXTRAS" > $(VENV)/test-requirements.txt
	$(PY) -m pip install -r $(VENV)/test-requirements.txt
	touch $@

run: $(RUN_STAMP)
	$(VENV)/bin/enginecore generate "$(PROMPT)"

# The native kernels' tests again on the AVX2 and the baseline variants
# (ENGINECORE_CPU_ISA caps the dispatch), so an AVX-512 machine tests all three.
KERNEL_TESTS := tests/test_random_sampler.py tests/test_logprobs_kernel.py \
	tests/test_kernel_twins.py tests/test_paged_attention.py tests/test_greedy_argmax.py \
	tests/test_fused_ops.py tests/test_sampler.py

test: $(STAMP)
	$(PY) -m pytest tests
	for isa in avx2 baseline; do \
		ENGINECORE_CPU_ISA=$$isa $(PY) -m pytest -q $(KERNEL_TESTS) || exit 1; \
	done

bench: $(STAMP)
	$(PY) -m pytest bench --benchmark-group-by=group --benchmark-columns=min,median,mean,rounds

# CUDA tests + throughput vs transformers on a GPU machine (installs what it lacks;
# results in $$OUT or ./gpu-check-results). ENGINECORE_GPU_CHECK_ON_CPU=1: dry run on the CPU.
gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build dist gpu-check-results
