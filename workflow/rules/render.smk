rule render:
    input:
        curated=shared(L.curated),
        model=shared(L.model_input),
    output:
        directory("results/{up}rendered"),
    params:
        model=shared(L.model_ref),
        settings=shared(lambda n: section(n, "render")),
        code=CODE["render"],
    log:
        "logs/{up}render.log",
    benchmark:
        "benchmarks/{up}render.tsv"
    shell:
        "orpo render --model {params.model} --curated {input.curated} --out {output} "
        "--settings {params.settings:q} > {log} 2>&1"
