rule data:
    output:
        "results/data/raw.jsonl",
    params:
        settings=settings("data"),
        code=CODE["data"],
    log:
        "logs/data.log",
    shell:
        "orpo data rows --out {output} --settings {params.settings:q} > {log} 2>&1"
