# Only for the embedded default: a model.path or model.hub_id in the config replaces this stage.
rule base:
    input:
        raw=raw_rows(),
    output:
        directory("results/base/model"),
    params:
        settings=settings("base"),
        code=CODE["base"],
    threads: workflow.cores
    log:
        "logs/base.log",
    benchmark:
        "benchmarks/base.tsv"
    shell:
        "orpo base --raw {input.raw} --out {output} --settings {params.settings:q} > {log} 2>&1"
