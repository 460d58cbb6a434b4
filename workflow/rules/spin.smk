# SPIN (Chen et al. 2024) with ORPO: iteration k pairs SFT gold answers (chosen) with the answers of
# iteration k-1's adapter (rejected; iteration 1: the base model or spin.adapter), renders and trains them.
#   snakemake spin                          (spin.iterations iterations, every experiment)
#   snakemake results/spin/iter1/ifeval.json  (IFEval of one iteration's adapter; results/<experiment>/spin/...)
wildcard_constraints:
    k=r"[1-9][0-9]*",


rule spin:
    input:
        [L.path(n, f"spin/iter{L.config(n)['spin']['iterations']}/ifeval.json") for n in L.configs],


rule spin_pairs:
    input:
        sft=per_exp(spin_sft_input),
        model=per_exp(L.model_input),
        adapter=spin_adapter,
    output:
        marker("results/{exp}spin/iter{k}/pairs"),
    params:
        out=lambda wildcards, output: folder(output[0]),
        sft=per_exp(spin_sft_arg),
        model=per_exp(L.model_ref),
        adapter=lambda wildcards, input: f"--adapter {folder(input.adapter[0])}" if input.adapter else "",
        render=per_exp(rendering),
        settings=per_exp(spin_settings),
        dtype=per_exp(model_dtype),
        code=CODE["spin"],
    threads: workflow.cores
    log:
        "logs/{exp}spin_pairs_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_pairs_iter{k}.tsv"
    shell:
        "orpo spin --sft {params.sft} --model {params.model} {params.adapter} --render-settings @{params.render} "
        "--iteration {wildcards.k} --out {params.out} --dtype {params.dtype} --settings @{params.settings} > {log} 2>&1"


rule spin_render:
    input:
        pairs=marker("results/{exp}spin/iter{k}/pairs"),
        model=per_exp(L.model_input),
    output:
        marker("results/{exp}spin/iter{k}/rendered"),
    params:
        pairs=lambda wildcards, input: folder(input.pairs),
        out=lambda wildcards, output: folder(output[0]),
        model=per_exp(L.model_ref),
        settings=per_exp(lambda n: section(n, "render")),
        code=CODE["render"],
    log:
        "logs/{exp}spin_render_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_render_iter{k}.tsv"
    shell:
        "orpo render --model {params.model} --curated {params.pairs} --out {params.out} "
        "--settings @{params.settings} > {log} 2>&1 && " + CONSOLE_NOTES


rule spin_train:
    input:
        rendered=marker("results/{exp}spin/iter{k}/rendered"),
        model=per_exp(L.model_input),
        previous=spin_adapter,
    output:
        marker("results/{exp}spin/iter{k}/run"),
    params:
        rendered=lambda wildcards, input: folder(input.rendered),
        out=lambda wildcards, output: folder(output[0]),
        model=per_exp(L.model_ref),
        settings=spin_train_settings,
        dtype=per_exp(model_dtype),
        code=CODE["train"],
    threads: workflow.cores
    log:
        "logs/{exp}spin_train_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_train_iter{k}.tsv"
    shell:
        "orpo train --model {params.model} --rendered {params.rendered} --out {params.out} --dtype {params.dtype} "
        "--settings @{params.settings} > {log} 2>&1"


rule spin_generate:
    input:
        model=per_exp(L.model_input),
        prompts=per_exp(lambda n: L.config(n)["eval"]["prompts"]),
        run=marker("results/{exp}spin/iter{k}/run"),
    output:
        "results/{exp}spin/iter{k}/generations.jsonl",
    params:
        run=lambda wildcards, input: folder(input.run),
        model=per_exp(L.model_ref),
        settings=per_exp(lambda n: section(n, "generate")),
        render=per_exp(rendering),
        dtype=per_exp(model_dtype),
        limit=per_exp(lambda n: L.config(n)["eval"]["limit"]),
        code=CODE["generate"],
    threads: workflow.cores
    log:
        "logs/{exp}spin_generate_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_generate_iter{k}.tsv"
    shell:
        "orpo generate --model {params.model} --adapter {params.run} --prompts {input.prompts} --label spin{wildcards.k} "
        "--limit {params.limit} --dtype {params.dtype} --render-settings @{params.render} --out {output} "
        "--settings @{params.settings} > {log} 2>&1"


rule spin_ifeval:
    input:
        prompts=per_exp(lambda n: L.config(n)["eval"]["prompts"]),
        base=per_exp(lambda n: L.base_generations(n, "ifeval")),
        spin="results/{exp}spin/iter{k}/generations.jsonl",
    output:
        summary="results/{exp}spin/iter{k}/ifeval.json",
        details=marker("results/{exp}spin/iter{k}/ifeval"),
    params:
        details=lambda wildcards, output: folder(output.details),
        limit=per_exp(lambda n: L.config(n)["eval"]["limit"]),
        code=CODE["ifeval"],
    log:
        "logs/{exp}spin_ifeval_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_ifeval_iter{k}.tsv"
    shell:
        "orpo ifeval compare --inputs {input.prompts} --generations base={input.base} spin{wildcards.k}={input.spin} "
        "--limit {params.limit} --out {output.summary} --details {params.details} > {log} 2>&1"
