rule render:
    input:
        curated="results/curated",
        model=model_input(),
    output:
        directory("results/rendered"),
    params:
        model=model_ref(),
        settings=settings("render"),
        code=CODE["render"],
    log:
        "logs/render.log",
    benchmark:
        "benchmarks/render.tsv"
    shell:
        "orpo render --model {params.model} --curated {input.curated} --out {output} "
        "--settings {params.settings:q} > {log} 2>&1"
