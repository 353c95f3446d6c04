# make run   : set up, generate the debug synthetic dataset, train the debug DLRM, print metrics
# make test  : set up, lint (ruff check, ruff format --check) and run the test suite, then its
#              numeric tests again under ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 (another host's arithmetic)
# make bench : the embedding benchmark, into the published bench/results/ (recaccel-bench
#              writes under runs/bench/ unless --out names another place)
# make gpu-check : on a GPU machine (no venv there: PYTHONPATH=. make gpu-check OUT=dir) the GPU
#              tests, every benchmark at GPU sizes and the targets' summary, in two parts of
#              under 7 minutes each: PART=checks (default: tests and kernel benchmarks) and
#              PART=steps (training and io benchmarks); make gpu-check DEVICE=cpu runs the
#              same steps at tiny sizes in the venv
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
CUDA   := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/base.txt requirements/dev.txt requirements/cpu-extras.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/base.txt -r requirements/dev.txt
ifeq ($(CUDA),1)
	$(PIP) install fbgemm-gpu==1.8.0 torchrec==1.8.0 || echo "torchrec/fbgemm-gpu not installed: hybrid mode and the fbgemm backend are unavailable"
else
	$(PIP) install -r requirements/cpu-extras.txt
	$(PIP) install --no-deps torchrec==1.8.0
endif
	$(PIP) install --no-deps -e .
	touch $(STAMP)

run: setup
	$(VENV)/bin/recaccel-data synth --config configs/debug.toml
	$(VENV)/bin/recaccel-train --config configs/debug.toml --overwrite

# The numeric tests run twice: ATEN_CPU_CAPABILITY and OMP_NUM_THREADS change the SIMD kernels and
# the summation order, as another host would, so a test that holds only on this host fails here.
test: setup lint
	$(PY) -m pytest -q -x --durations=15
	ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -m numeric

lint: setup
	$(VENV)/bin/ruff check recaccel tests
	$(VENV)/bin/ruff format --check recaccel tests

bench: setup
	$(VENV)/bin/recaccel-bench embedding --out bench/results/embedding.md --json bench/results/embedding.json

DEVICE ?= cuda
OUT    ?= runs/gpu-check
PART   ?= checks
# On CPU the venv's python (after setup); on a GPU machine the system's, which holds torch.
gpu-check: $(if $(filter cpu,$(DEVICE)),setup)
	$(if $(filter cpu,$(DEVICE)),$(PY),$(PYTHON)) -m recaccel.bench.gpu_check --device $(DEVICE) --part $(PART) --out $(OUT)

clean:
	rm -rf $(VENV) runs data .pytest_cache
