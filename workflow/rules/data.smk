# Synthetic raw rows (only when data.raw is null); shared by every experiment with the same data settings.
rule data:
    output:
        "results/{up}data/raw.jsonl",
    params:
        settings=shared(lambda n: section(n, "data")),
        code=CODE["data"],
    log:
        "logs/{up}data.log",
    benchmark:
        "benchmarks/{up}data.tsv"
    shell:
        "orpo data rows --out {output} --settings @{params.settings} > {log} 2>&1"
