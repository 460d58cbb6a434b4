# The base model and the trained adapter answer the same eval prompts with the same settings.
rule generate_base:
    input:
        model=model_input(),
        prompts=config["eval"]["prompts"],
    output:
        "results/generations/base.jsonl",
    params:
        model=model_ref(),
        settings=settings("generate"),
        render=prompt_rendering(),
        limit=config["eval"]["limit"],
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/generate_base.log",
    shell:
        "orpo generate --model {params.model} --prompts {input.prompts} --label base --limit {params.limit} "
        "--render-settings {params.render:q} --out {output} --settings {params.settings:q} > {log} 2>&1"


rule generate_orpo:
    input:
        model=model_input(),
        prompts=config["eval"]["prompts"],
        run="results/train/run",
        replay="results/train/replay.json",
    output:
        "results/generations/orpo.jsonl",
    params:
        model=model_ref(),
        settings=settings("generate"),
        render=prompt_rendering(),
        limit=config["eval"]["limit"],
        checkpoint=config["generate"]["adapter"],
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/generate_orpo.log",
    shell:
        "orpo generate --model {params.model} --adapter {input.run} --checkpoint {params.checkpoint} "
        "--prompts {input.prompts} --label orpo --limit {params.limit} "
        "--render-settings {params.render:q} --out {output} --settings {params.settings:q} > {log} 2>&1"
