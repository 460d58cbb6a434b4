# A published table beside ours (config `paper`; config/paper/*.yaml):
#   snakemake results/paper/<name>/table.md   IFEval, the paper's layout: published, ours, difference
#   snakemake results/paper/<name>/judge.md   judge win rates of each model's adapter against the base
PAPER = config["paper"]
for _i, _model in enumerate(PAPER["models"]):
    if _model["experiment"] not in L.configs or not L.grid:
        raise WorkflowError(f"config error: paper.models.{_i}.experiment: {_model['experiment']!r} is not an experiment "
                            f"of this config (experiments: {', '.join(L.configs) or 'none'})")


def paper_inputs(rel):
    """Experiment -> results/<experiment>/<rel> for each paper model; the paper's name must be the config's."""

    def inputs(wildcards):
        if wildcards.name != PAPER["name"]:
            raise WorkflowError(f"results/paper/{wildcards.name}: the config's paper.name is {PAPER['name']!r}")
        return {m["experiment"]: L.path(m["experiment"], rel) for m in PAPER["models"]}

    return inputs


def labelled(input):
    """experiment=path arguments of `orpo report`."""
    return " ".join(f"{k}={v}" for k, v in input.items())


rule paper_table:
    input:
        unpack(paper_inputs("ifeval.json")),
    output:
        "results/paper/{name}/table.md",
    params:
        spec=lambda wildcards: settings_file("paper", PAPER),
        results=lambda wildcards, input: labelled(input),
        code=CODE["report"],
    log:
        "logs/paper/{name}/table.log",
    benchmark:
        "benchmarks/paper/{name}/table.tsv"
    shell:
        "orpo report paper-table --spec @{params.spec} --results {params.results} --out {output} > {log} 2>&1"


rule paper_judge:
    input:
        unpack(paper_inputs("judge/summary.json")),
    output:
        "results/paper/{name}/judge.md",
    params:
        spec=lambda wildcards: settings_file("paper", PAPER),
        results=lambda wildcards, input: labelled(input),
        code=CODE["report"],
    log:
        "logs/paper/{name}/judge.log",
    benchmark:
        "benchmarks/paper/{name}/judge.tsv"
    shell:
        "orpo report paper-judge --spec @{params.spec} --results {params.results} --out {output} > {log} 2>&1"
