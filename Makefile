# Two commands do everything on a fresh machine: `make run` (the main job) and `make test`; `make report`
# adds the HTML report of a run.
VENV ?= .venv
TARGET ?= summary
WORKDIR ?= .
REPORT ?= results/report.html
SNAKEMAKE_ARGS ?=
# one worker per core; the workflow tests share their Snakemake runs on one of them
PYTEST_ARGS ?= -n auto --dist loadgroup
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake --profile workflow/profiles/default --directory $(WORKDIR)

.PHONY: run report test setup clean
setup:
	@workflow/scripts/bootstrap.sh $(VENV)

# Rule `summary`: every experiment's scores and figures, then the summary table printed last.
run: setup
	@$(PY) -m orpo.blas --announce
	$(SNAKEMAKE) $(TARGET) $(SNAKEMAKE_ARGS)

# Everything rule `all` builds (figures, summary; judge and paper tables where configured), then Snakemake's
# HTML report of it, written beside and renamed into place so a failed build never leaves half a report.
report: setup
	@$(PY) -m orpo.blas --announce
	$(SNAKEMAKE) all $(SNAKEMAKE_ARGS)
	$(SNAKEMAKE) all --report $(dir $(REPORT)).report.tmp.html $(SNAKEMAKE_ARGS)
	@mv -f $(WORKDIR)/$(dir $(REPORT)).report.tmp.html $(WORKDIR)/$(REPORT)
	@echo "report: $(WORKDIR)/$(REPORT)"

# In-process MLX in the tests gets the same BLAS as the `orpo` CLI gives itself; the report's browser test
# needs a headless Chromium.
test: setup
	@workflow/scripts/browser.sh
	@$(PY) -m orpo.blas --announce
	LD_PRELOAD="$$($(PY) -m orpo.blas --preload)" $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf results logs .snakemake
