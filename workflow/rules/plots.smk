# Figures and tables of one experiment, as PNG/HTML files in results/[<experiment>/]plots/ and, flagged with
# report(), in `snakemake --report report.html`. Benchmark files are read as they are when the rule runs
# (they are not rule outputs Snakemake can track); the stage outputs they describe are the inputs.
rule plots:
    input:
        run=marker("results/{exp}train/run"),
        ifeval="results/{exp}ifeval.json",
        details=marker("results/{exp}ifeval"),
        curated=per_exp(lambda n: marker(L.curated(n))),
        rendered=per_exp(lambda n: marker(L.rendered(n))),
    output:
        training=report("results/{exp}plots/training.png", caption="../report/training.rst",
                        category="Training", subcategory=report_group),
        accuracy=report("results/{exp}plots/preference_accuracy.png", caption="../report/accuracy.rst",
                        category="Training", subcategory=report_group),
        ifeval=report("results/{exp}plots/ifeval_by_instruction.png", caption="../report/ifeval.rst",
                      category="IFEval", subcategory=report_group),
        ifeval_table=report("results/{exp}plots/ifeval.html", caption="../report/ifeval_table.rst",
                            category="IFEval", subcategory=report_group),
        curation=report("results/{exp}plots/curation.html", caption="../report/curation.rst",
                        category="Data", subcategory=report_group),
        benchmarks=report("results/{exp}plots/benchmarks.png", caption="../report/benchmarks.rst",
                          category="Benchmarks", subcategory=report_group),
        benchmarks_table=report("results/{exp}plots/benchmarks.html", caption="../report/benchmarks_table.rst",
                                category="Benchmarks", subcategory=report_group),
    params:
        benchmarks=per_exp(lambda n: " ".join(f"{rule}={path}" for rule, path in L.benchmarks(n).items())),
        out="results/{exp}plots",
        run=lambda wildcards, input: folder(input.run),
        curated=lambda wildcards, input: folder(input.curated),
        rendered=lambda wildcards, input: folder(input.rendered),
        details=lambda wildcards, input: folder(input.details),
        code=CODE["report"],
    log:
        "logs/{exp}plots.log",
    benchmark:
        "benchmarks/{exp}plots.tsv"
    shell:
        "orpo report plots --run {params.run} --ifeval {input.ifeval} --curated {params.curated} "
        "--rendered {params.rendered} --ifeval-details {params.details} --benchmarks {params.benchmarks} "
        "--out {params.out} > {log} 2>&1"


# Judge win rates (needs judge.model; `snakemake results/[<experiment>/]plots/judge.png`).
rule judge_plot:
    input:
        summary="results/{exp}judge/summary.json",
    output:
        plot=report("results/{exp}plots/judge.png", caption="../report/judge.rst",
                    category="Judge", subcategory=report_group),
        table=report("results/{exp}plots/judge.html", caption="../report/judge_table.rst",
                     category="Judge", subcategory=report_group),
    params:
        out="results/{exp}plots",
        code=CODE["report"],
    log:
        "logs/{exp}judge_plot.log",
    benchmark:
        "benchmarks/{exp}judge_plot.tsv"
    shell:
        "orpo report judge --summary {input.summary} --out {params.out} > {log} 2>&1"
