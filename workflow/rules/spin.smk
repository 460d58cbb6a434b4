# SPIN (Chen et al. 2024) with ORPO: iteration k pairs SFT gold answers (chosen) with the answers of
# iteration k-1's adapter (rejected; iteration 1: the base model or spin.adapter), renders and trains them.
#   snakemake spin                          (spin.iterations iterations)
#   snakemake results/spin/iter1/ifeval.json  (IFEval of one iteration's adapter)
wildcard_constraints:
    k=r"[1-9][0-9]*",


rule spin:
    input:
        f"results/spin/iter{config['spin']['iterations']}/ifeval.json",


rule spin_pairs:
    input:
        sft=spin_sft_input(),
        model=model_input(),
        adapter=spin_adapter,
    output:
        directory("results/spin/iter{k}/pairs"),
    params:
        sft=spin_sft_arg(),
        model=model_ref(),
        adapter=lambda wildcards, input: f"--adapter {input.adapter}" if input.adapter else "",
        render=prompt_rendering(),
        settings=spin_settings(),
        code=CODE["spin"],
    threads: workflow.cores
    log:
        "logs/spin_pairs_iter{k}.log",
    benchmark:
        "benchmarks/spin_pairs_iter{k}.tsv"
    shell:
        "orpo spin --sft {params.sft} --model {params.model} {params.adapter} --render-settings {params.render:q} "
        "--iteration {wildcards.k} --out {output} --settings {params.settings:q} > {log} 2>&1"


rule spin_render:
    input:
        pairs="results/spin/iter{k}/pairs",
        model=model_input(),
    output:
        directory("results/spin/iter{k}/rendered"),
    params:
        model=model_ref(),
        settings=settings("render"),
        code=CODE["render"],
    log:
        "logs/spin_render_iter{k}.log",
    benchmark:
        "benchmarks/spin_render_iter{k}.tsv"
    shell:
        "orpo render --model {params.model} --curated {input.pairs} --out {output} "
        "--settings {params.settings:q} > {log} 2>&1"


rule spin_train:
    input:
        rendered="results/spin/iter{k}/rendered",
        model=model_input(),
        previous=spin_adapter,
    output:
        directory("results/spin/iter{k}/run"),
    params:
        model=model_ref(),
        settings=spin_train_settings,
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/spin_train_iter{k}.log",
    benchmark:
        "benchmarks/spin_train_iter{k}.tsv"
    shell:
        "orpo train --model {params.model} --rendered {input.rendered} --out {output} "
        "--settings {params.settings:q} > {log} 2>&1"


rule spin_generate:
    input:
        model=model_input(),
        prompts=config["eval"]["prompts"],
        run="results/spin/iter{k}/run",
    output:
        "results/spin/iter{k}/generations.jsonl",
    params:
        model=model_ref(),
        settings=settings("generate"),
        render=prompt_rendering(),
        limit=config["eval"]["limit"],
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/spin_generate_iter{k}.log",
    benchmark:
        "benchmarks/spin_generate_iter{k}.tsv"
    shell:
        "orpo generate --model {params.model} --adapter {input.run} --prompts {input.prompts} --label spin{wildcards.k} "
        "--limit {params.limit} --render-settings {params.render:q} --out {output} --settings {params.settings:q} > {log} 2>&1"


rule spin_ifeval:
    input:
        prompts=config["eval"]["prompts"],
        base="results/generations/ifeval/base.jsonl",
        spin="results/spin/iter{k}/generations.jsonl",
    output:
        summary="results/spin/iter{k}/ifeval.json",
        details=directory("results/spin/iter{k}/ifeval"),
    params:
        limit=config["eval"]["limit"],
        code=CODE["ifeval"],
    log:
        "logs/spin_ifeval_iter{k}.log",
    benchmark:
        "benchmarks/spin_ifeval_iter{k}.tsv"
    shell:
        "orpo ifeval compare --inputs {input.prompts} --generations base={input.base} spin{wildcards.k}={input.spin} "
        "--limit {params.limit} --out {output.summary} --details {output.details} > {log} 2>&1"
