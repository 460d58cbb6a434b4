# Pairwise judging of the trained model against the base (MT-Bench protocol), run on request:
#   snakemake results/judge/summary.json   (set judge.model, and judge.kind/base_url for a server)
#   snakemake results/<experiment>/judge/summary.json   (with experiments)
rule judge_prompts:
    input:
        questions=shared(L.judge_questions),
    output:
        "results/{up}judge/prompts.jsonl",
    params:
        questions=lambda wildcards, input: folder(input.questions),
        prompt_set=shared(lambda n: L.config(n)["judge"]["prompt_set"]),
        code=CODE["judge"],
    log:
        "logs/{up}judge_prompts.log",
    benchmark:
        "benchmarks/{up}judge_prompts.tsv"
    shell:
        "orpo judge prompts --prompt-set {params.prompt_set} --questions {params.questions} --out {output} > {log} 2>&1"


# The outputs are files, not the folder: a failed run must not delete the verdict cache beside them.
rule judge:
    input:
        questions=per_exp(L.judge_questions),
        orpo="results/{exp}generations/judge/orpo.jsonl",
        base=per_exp(lambda n: L.base_generations(n, "judge")),
    output:
        summary="results/{exp}judge/summary.json",
        verdicts="results/{exp}judge/verdicts.jsonl",
    params:
        questions=lambda wildcards, input: folder(input.questions),
        settings=per_exp(lambda n: section(n, "judge")),
        # An mlx judge computes in model.dtype; a server's judge is not loaded here.
        dtype=per_exp(lambda n: model_dtype(n) if L.config(n)["judge"]["kind"] == "mlx" else "auto"),
        out="results/{exp}judge",
        code=CODE["judge"],
    threads: workflow.cores
    log:
        "logs/{exp}judge.log",
    benchmark:
        "benchmarks/{exp}judge.tsv"
    shell:
        "orpo judge run --questions {params.questions} --a orpo={input.orpo} --b base={input.base} "
        "--out {params.out} --dtype {params.dtype} --settings @{params.settings} > {log} 2>&1"


# judge.questions given as a dataset folder or hub id: normalised to FastChat's question.jsonl layout (see
# common.smk).
rule mt_bench_questions:
    input:
        source_input(PROMPT_SOURCES["judge"]),
    output:
        NORMALISED_PROMPTS["judge"],
    params:
        source=PROMPT_SOURCES["judge"] or "",
        code=code_version("orpo.eval.judge.questions"),
    log:
        "logs/mt_bench_questions.log",
    benchmark:
        "benchmarks/mt_bench_questions.tsv"
    shell:
        "orpo judge questions --source {params.source:q} --out {output} > {log} 2>&1"
