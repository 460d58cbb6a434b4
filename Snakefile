# orpo-pipeline: raw rows -> curated pairs -> rendered tokens -> ORPO adapter -> replay -> generations -> IFEval.
# Thin on purpose: the config, its validation, the rules. All logic lives in the `orpo` package.
from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config", "config.yaml")


include: "workflow/rules/common.smk"


rule all:
    input:
        "results/ifeval.json",


include: "workflow/rules/data.smk"
include: "workflow/rules/curate.smk"
include: "workflow/rules/base.smk"
include: "workflow/rules/render.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/replay.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/ifeval.smk"
include: "workflow/rules/judge.smk"
include: "workflow/rules/spin.smk"
