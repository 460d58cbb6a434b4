# Re-run training to the chosen checkpoint and fail unless the adapter's sha256 matches the index.
rule replay:
    input:
        run=marker("results/{exp}train/run"),
        rendered=per_exp(lambda n: marker(L.rendered(n))),
        model=per_exp(L.model_input),
    output:
        "results/{exp}train/replay.json",
    params:
        run=lambda wildcards, input: folder(input.run),
        rendered=lambda wildcards, input: folder(input.rendered),
        model=per_exp(L.model_ref),
        checkpoint=per_exp(lambda n: L.config(n)["replay"]["checkpoint"]),
        start=per_exp(lambda n: L.config(n)["replay"]["from"]),
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/{exp}replay.log",
    benchmark:
        "benchmarks/{exp}replay.tsv"
    shell:
        "orpo replay --run {params.run} --model {params.model} --rendered {params.rendered} "
        "--checkpoint {params.checkpoint} --from {params.start} --out {output} > {log} 2>&1"
