# megatron-repro: `make demo` and `make test` are all a new user needs.
VENV ?= .venv
PY := $(VENV)/bin/python
REPRO := $(VENV)/bin/repro
# The read-only data mirror on this project's machines; unset elsewhere -> public downloads.
REPRO_DATA_MIRROR ?= $(abspath $(firstword $(wildcard ../shared/data /work/shared/data)))
export REPRO_DATA_MIRROR
export REPRO_DATA_DIR ?= $(CURDIR)/data
export OMP_NUM_THREADS ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true
export DS_ACCELERATOR ?= cpu
# Where pip finds torch==2.13.0. Empty: pip's configured sources (a local CPU wheel on this project's
# machines; plain PyPI serves the multi-GB CUDA build). `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# takes the CPU build from PyTorch's own index.
TORCH_INDEX ?=

.PHONY: setup test demo data clean slurm-deps results

setup: $(VENV)/.installed

# Idempotent: the stamp is rebuilt only when pyproject.toml changes. A CUDA torch already in the
# venv is kept; otherwise the pinned torch==2.13.0 is installed first, in its own pip call.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[test]"
	touch $@

data: setup
	$(REPRO) data fetch

# Without a mirror the tests read the data `make data` just downloaded and checked (same layout).
# pytest-xdist runs the modules on TEST_WORKERS processes (default: the CPU count, at most 4), one
# module per worker at a time, so a module's fixtures are built once (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
test: setup data slurm-deps
	REPRO_DATA_MIRROR="$${REPRO_DATA_MIRROR:-$(REPRO_DATA_DIR)}" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=30

# The Slurm tests start a real single-node cluster (tests/slurm_cluster.py) and a two-node one whose
# nodes live in network namespaces (tests/slurm_multinode.py, iproute2's `ip`): Debian packages, root.
SLURM_DEPS := slurmctld slurmd slurm-client munge shellcheck iproute2
slurm-deps:
	@missing=; for b in slurmctld slurmd sbatch munged shellcheck ip; do \
	  PATH="$$PATH:/usr/sbin" command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_DEPS) >/dev/null; \
	else echo "make slurm-deps: missing$$missing; install $(SLURM_DEPS) (Debian: sudo apt-get install --no-install-recommends $(SLURM_DEPS)); the Slurm tests skip without them (and fail in CI)"; fi

demo: setup
	$(REPRO) demo

# Rebuild results/ from reduced-size CPU runs in a fresh store (runs/cpu_results; about 17 minutes on 2 cores).
results: setup
	bash scripts/cpu_results.sh

clean:
	rm -rf $(VENV) mlruns runs checkpoints .pytest_cache
