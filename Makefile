# Two commands do everything on a fresh machine: `make run` (the main job) and `make test`.
VENV ?= .venv
TARGET ?= results/ifeval.json
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
PY := $(VENV)/bin/python

.PHONY: run test setup clean
setup:
	@workflow/scripts/bootstrap.sh $(VENV)

run: setup
	@$(PY) -m orpo.blas --announce
	$(VENV)/bin/snakemake $(TARGET) --profile workflow/profiles/default $(SNAKEMAKE_ARGS)

# In-process MLX in the tests gets the same BLAS as the `orpo` CLI gives itself.
test: setup
	@$(PY) -m orpo.blas --announce
	LD_PRELOAD="$$($(PY) -m orpo.blas --preload)" $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf results logs .snakemake
