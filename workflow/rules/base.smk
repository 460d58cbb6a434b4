# Only for the embedded default: a model.path or model.hub_id in the config replaces this stage.
rule base:
    input:
        raw=shared(L.raw_input),
    output:
        marker("results/{up}base/model"),
    params:
        out=lambda wildcards, output: folder(output[0]),
        raw=shared(L.raw),
        settings=shared(lambda n: section(n, "base")),
        on_error=shared(lambda n: L.config(n)["curate"]["on_error"]),  # the rows curate reads, the same way
        code=CODE["base"],
    threads: workflow.cores
    log:
        "logs/{up}base.log",
    benchmark:
        "benchmarks/{up}base.tsv"
    shell:
        "orpo base --raw {params.raw} --on-error {params.on_error} --out {params.out} --settings @{params.settings} "
        "> {log} 2>&1"
