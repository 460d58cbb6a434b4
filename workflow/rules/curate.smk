# Token-length filters count with the base model's tokenizer.
rule curate:
    input:
        raw=raw_rows(),
        model=model_input(),
        eval_prompts=config["eval"]["prompts"],
    output:
        directory("results/curated"),
    params:
        model=model_ref(),
        settings=settings("curate"),
        code=CODE["curate"],
    log:
        "logs/curate.log",
    benchmark:
        "benchmarks/curate.tsv"
    shell:
        "orpo curate --inputs {input.raw} --out {output} --tokenizer-from {params.model} "
        "--eval-prompts {input.eval_prompts} --settings {params.settings:q} > {log} 2>&1"
