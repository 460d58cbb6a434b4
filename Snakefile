# orpo-pipeline: raw rows -> curated pairs -> rendered tokens -> ORPO adapter -> replay -> generations -> IFEval
# -> figures, for one experiment or a grid of them (docs/reproducibility.md).
# Thin on purpose: the config, its validation, the rules. All logic lives in the `orpo` package.
from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


# Every experiment's IFEval scores and figures, the summary across them; judge figures where a judge is
# configured; the paper table.
rule all:
    input:
        experiment_targets("ifeval.json"),
        experiment_targets("plots/training.png"),
        "results/summary.md",
        [L.path(n, "plots/judge.png") for n in L.configs if L.judged(n)],
        [f"results/paper/{config['paper']['name']}/table.md"] if config["paper"]["name"] else [],


include: "workflow/rules/data.smk"
include: "workflow/rules/curate.smk"
include: "workflow/rules/base.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/render.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/replay.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/ifeval.smk"
include: "workflow/rules/judge.smk"
include: "workflow/rules/spin.smk"
include: "workflow/rules/plots.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/paper.smk"
