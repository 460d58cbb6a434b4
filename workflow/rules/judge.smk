# Pairwise judging of the trained model against the base (MT-Bench protocol), run on request:
#   snakemake results/judge/summary.json   (set judge.model, and judge.kind/base_url for a server)
rule judge_prompts:
    input:
        questions=judge_questions(),
    output:
        "results/judge/prompts.jsonl",
    params:
        prompt_set=config["judge"]["prompt_set"],
        code=CODE["judge"],
    log:
        "logs/judge_prompts.log",
    benchmark:
        "benchmarks/judge_prompts.tsv"
    shell:
        "orpo judge prompts --prompt-set {params.prompt_set} --questions {input.questions} --out {output} > {log} 2>&1"


# The outputs are files, not the folder: a failed run must not delete the verdict cache beside them.
rule judge:
    input:
        questions=judge_questions(),
        orpo="results/generations/judge/orpo.jsonl",
        base="results/generations/judge/base.jsonl",
    output:
        summary="results/judge/summary.json",
        verdicts="results/judge/verdicts.jsonl",
    params:
        settings=settings("judge"),
        code=CODE["judge"],
    threads: workflow.cores
    log:
        "logs/judge.log",
    benchmark:
        "benchmarks/judge.tsv"
    shell:
        "orpo judge run --questions {input.questions} --a orpo={input.orpo} --b base={input.base} "
        "--out results/judge --settings {params.settings:q} > {log} 2>&1"
