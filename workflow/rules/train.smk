# Per experiment: results/[<experiment>/]train/run, from the (possibly shared) rendered pairs.
rule train:
    input:
        rendered=per_exp(lambda n: marker(L.rendered(n))),
        model=per_exp(L.model_input),
        init_adapter=per_exp(lambda n: [L.config(n)["train"]["init_adapter"]] if L.config(n)["train"]["init_adapter"] else []),
    output:
        marker("results/{exp}train/run"),
    params:
        rendered=lambda wildcards, input: folder(input.rendered),
        out=lambda wildcards, output: folder(output[0]),
        model=per_exp(L.model_ref),
        settings=per_exp(lambda n: section(n, "train")),
        dtype=per_exp(model_dtype),
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/{exp}train.log",
    benchmark:
        "benchmarks/{exp}train.tsv"
    shell:
        "orpo train --model {params.model} --rendered {params.rendered} --out {params.out} --dtype {params.dtype} "
        "--settings @{params.settings} > {log} 2>&1"
