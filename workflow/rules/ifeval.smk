rule ifeval:
    input:
        prompts=per_exp(lambda n: L.config(n)["eval"]["prompts"]),
        base=per_exp(lambda n: L.base_generations(n, "ifeval")),
        tuned="results/{exp}generations/ifeval/orpo.jsonl",
    output:
        summary="results/{exp}ifeval.json",
        details=marker("results/{exp}ifeval"),
    params:
        details=lambda wildcards, output: folder(output.details),
        limit=per_exp(lambda n: L.config(n)["eval"]["limit"]),
        label="orpo",
        code=CODE["ifeval"],
    log:
        "logs/{exp}ifeval.log",
    benchmark:
        "benchmarks/{exp}ifeval.tsv"
    shell:
        "orpo ifeval compare --inputs {input.prompts} --generations base={input.base} {params.label}={input.tuned} "
        "--limit {params.limit} --out {output.summary} --details {params.details} > {log} 2>&1"


# eval.prompts given as a dataset folder or hub id: normalised to IFEval's input format (see common.smk).
rule eval_prompts:
    input:
        source_input(PROMPT_SOURCES["eval"]),
    output:
        NORMALISED_PROMPTS["eval"],
    params:
        source=PROMPT_SOURCES["eval"],
        code=code_version("orpo.eval.ifeval.source"),
    log:
        "logs/eval_prompts.log",
    benchmark:
        "benchmarks/eval_prompts.tsv"
    shell:
        "orpo ifeval prompts --source {params.source:q} --out {output} > {log} 2>&1"
