# Only for the embedded default: a model.path or model.hub_id in the config replaces this stage.
rule base:
    input:
        raw=shared(L.raw_input),
    output:
        directory("results/{up}base/model"),
    params:
        raw=shared(L.raw),
        settings=shared(lambda n: section(n, "base")),
        code=CODE["base"],
    threads: workflow.cores
    log:
        "logs/{up}base.log",
    benchmark:
        "benchmarks/{up}base.tsv"
    shell:
        "orpo base --raw {params.raw} --out {output} --settings {params.settings:q} > {log} 2>&1"
