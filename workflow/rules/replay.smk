# Re-run training to the chosen checkpoint and fail unless the adapter's sha256 matches the index.
rule replay:
    input:
        run="results/train/run",
        rendered="results/rendered",
        model=model_input(),
    output:
        "results/train/replay.json",
    params:
        model=model_ref(),
        checkpoint=config["replay"]["checkpoint"],
        start=config["replay"]["from"],
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/replay.log",
    benchmark:
        "benchmarks/replay.tsv"
    shell:
        "orpo replay --run {input.run} --model {params.model} --rendered {input.rendered} "
        "--checkpoint {params.checkpoint} --from {params.start} --out {output} > {log} 2>&1"
