rule train:
    input:
        rendered="results/rendered",
        model=model_input(),
        init_adapter=[config["train"]["init_adapter"]] if config["train"]["init_adapter"] else [],
    output:
        directory("results/train/run"),
    params:
        model=model_ref(),
        settings=settings("train"),
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    shell:
        "orpo train --model {params.model} --rendered {input.rendered} --out {output} "
        "--settings {params.settings:q} > {log} 2>&1"
