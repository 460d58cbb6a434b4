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


# Each iteration's render, train, generate and IFEval are the stage rules on the iteration's folders.
use rule render as spin_render with:
    input:
        curated=marker("results/{exp}spin/iter{k}/pairs"),
        model=per_exp(L.source_input),
    output:
        marker("results/{exp}spin/iter{k}/rendered"),
    params:
        model=per_exp(L.source_ref),
        settings=per_exp(lambda n: section(n, "render")),
    log:
        "logs/{exp}spin_render_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_render_iter{k}.tsv"


use rule train as spin_train with:
    input:
        rendered=marker("results/{exp}spin/iter{k}/rendered"),
        model=per_exp(L.model_input),
        init_adapter=spin_adapter,
    output:
        marker("results/{exp}spin/iter{k}/run"),
    params:
        settings=spin_train_settings,
    log:
        "logs/{exp}spin_train_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_train_iter{k}.tsv"


use rule generate_orpo as spin_generate with:
    input:
        model=per_exp(L.model_input),
        prompts=per_exp(lambda n: L.config(n)["eval"]["prompts"]),
        run=marker("results/{exp}spin/iter{k}/run"),
    output:
        "results/{exp}spin/iter{k}/generations.jsonl",
    params:
        limit=per_exp(lambda n: L.config(n)["eval"]["limit"]),
        checkpoint="final",
        label=lambda wildcards: f"spin{wildcards.k}",
    log:
        "logs/{exp}spin_generate_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_generate_iter{k}.tsv"


use rule ifeval as spin_ifeval with:
    input:
        prompts=per_exp(lambda n: L.config(n)["eval"]["prompts"]),
        base=per_exp(lambda n: L.base_generations(n, "ifeval")),
        tuned="results/{exp}spin/iter{k}/generations.jsonl",
    output:
        summary="results/{exp}spin/iter{k}/ifeval.json",
        details=marker("results/{exp}spin/iter{k}/ifeval"),
    params:
        label=lambda wildcards: f"spin{wildcards.k}",
    log:
        "logs/{exp}spin_ifeval_iter{k}.log",
    benchmark:
        "benchmarks/{exp}spin_ifeval_iter{k}.tsv"
