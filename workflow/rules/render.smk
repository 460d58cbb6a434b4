rule render:
    input:
        curated=shared(lambda n: marker(L.curated(n))),
        model=shared(L.source_input),
    output:
        marker("results/{up}rendered"),
    params:
        curated=lambda wildcards, input: folder(input.curated),
        out=lambda wildcards, output: folder(output[0]),
        model=shared(L.source_ref),
        settings=shared(lambda n: section(n, "render")),
        code=CODE["render"],
    log:
        "logs/{up}render.log",
    benchmark:
        "benchmarks/{up}render.tsv"
    shell:
        "orpo render --model {params.model} --curated {params.curated} --out {params.out} "
        "--settings @{params.settings} > {log} 2>&1 && " + CONSOLE_NOTES
