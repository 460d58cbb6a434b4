# The base model and the trained adapter answer the same prompts with the same settings. {set} is the
# prompt set: ifeval (the eval prompts) or judge (the judge's questions).
wildcard_constraints:
    set="ifeval|judge",


rule generate_base:
    input:
        model=model_input(),
        prompts=lambda wc: prompt_set_file(wc.set),
    output:
        "results/generations/{set}/base.jsonl",
    params:
        model=model_ref(),
        settings=settings("generate"),
        render=prompt_rendering(),
        limit=lambda wc: prompt_set_limit(wc.set),
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/generate_base_{set}.log",
    benchmark:
        "benchmarks/generate_base_{set}.tsv"
    shell:
        "orpo generate --model {params.model} --prompts {input.prompts} --label base --limit {params.limit} "
        "--render-settings {params.render:q} --out {output} --settings {params.settings:q} > {log} 2>&1"


rule generate_orpo:
    input:
        model=model_input(),
        prompts=lambda wc: prompt_set_file(wc.set),
        run="results/train/run",
        replay="results/train/replay.json",
    output:
        "results/generations/{set}/orpo.jsonl",
    params:
        model=model_ref(),
        settings=settings("generate"),
        render=prompt_rendering(),
        limit=lambda wc: prompt_set_limit(wc.set),
        checkpoint=config["generate"]["adapter"],
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/generate_orpo_{set}.log",
    benchmark:
        "benchmarks/generate_orpo_{set}.tsv"
    shell:
        "orpo generate --model {params.model} --adapter {input.run} --checkpoint {params.checkpoint} "
        "--prompts {input.prompts} --label orpo --limit {params.limit} "
        "--render-settings {params.render:q} --out {output} --settings {params.settings:q} > {log} 2>&1"
