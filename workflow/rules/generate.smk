# The base model and the trained adapter answer the same prompts with the same settings. {set} is the
# prompt set: ifeval (the eval prompts) or judge (the judge's questions). The base model's answers are shared
# by every experiment with the same model, generation settings and prompts.
wildcard_constraints:
    set="ifeval|judge",


rule generate_base:
    input:
        model=shared(L.model_input),
        prompts=lambda wc: L.prompt_set(L.owner(wc.up), wc.set)[0],
    output:
        "results/{up}generations/{set}/base.jsonl",
    params:
        model=shared(L.model_ref),
        settings=shared(lambda n: section(n, "generate")),
        render=shared(rendering),
        dtype=shared(model_dtype),
        limit=lambda wc: L.prompt_set(L.owner(wc.up), wc.set)[1],
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/{up}generate_base_{set}.log",
    benchmark:
        "benchmarks/{up}generate_base_{set}.tsv"
    shell:
        "orpo generate --model {params.model} --prompts {input.prompts} --label base --limit {params.limit} "
        "--dtype {params.dtype} --render-settings @{params.render} --out {output} --settings @{params.settings} "
        "> {log} 2>&1"


rule generate_orpo:
    input:
        model=per_exp(L.model_input),
        prompts=lambda wc: L.prompt_set(L.name(wc.exp), wc.set)[0],
        run=marker("results/{exp}train/run"),
        replay="results/{exp}train/replay.json",
    output:
        "results/{exp}generations/{set}/orpo.jsonl",
    params:
        model=per_exp(L.model_ref),
        settings=per_exp(lambda n: section(n, "generate")),
        render=per_exp(rendering),
        dtype=per_exp(model_dtype),
        limit=lambda wc: L.prompt_set(L.name(wc.exp), wc.set)[1],
        checkpoint=per_exp(lambda n: L.config(n)["generate"]["adapter"]),
        run=lambda wildcards, input: folder(input.run),
        label="orpo",
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/{exp}generate_orpo_{set}.log",
    benchmark:
        "benchmarks/{exp}generate_orpo_{set}.tsv"
    shell:
        "orpo generate --model {params.model} --adapter {params.run} --checkpoint {params.checkpoint} "
        "--prompts {input.prompts} --label {params.label} --limit {params.limit} --dtype {params.dtype} "
        "--render-settings @{params.render} --out {output} --settings @{params.settings} > {log} 2>&1"
