rule data:
    output:
        "results/data/raw.jsonl",
    params:
        settings=settings("data"),
        code=CODE["data"],
    log:
        "logs/data.log",
    benchmark:
        "benchmarks/data.tsv"
    shell:
        "orpo data rows --out {output} --settings {params.settings:q} > {log} 2>&1"
