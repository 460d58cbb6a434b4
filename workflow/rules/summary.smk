# The run's summary across every experiment of the config: results/summary.md (IFEval of base and trained
# model with 95% intervals and the paired difference, validation preference accuracy, replay) and its figure.
rule summary_table:
    input:
        ifeval=experiment_targets("ifeval.json"),
        replay=experiment_targets("train/replay.json"),
        runs=[marker(L.path(n, "train/run")) for n in L.configs],
    output:
        table="results/summary.md",
        plot=report("results/summary.png", caption="../report/summary.rst", category="Summary"),
    params:
        experiments=lambda wildcards: settings_file("summary", {
            n: {"folder": L.path(n, ""), "adapter": L.config(n)["generate"]["adapter"]} for n in L.configs}),
        code=CODE["summary"],
    log:
        "logs/summary.log",
    benchmark:
        "benchmarks/summary.tsv"
    shell:
        "orpo report summary --experiments @{params.experiments} --out {output.table} --plot {output.plot} "
        "> {log} 2>&1"


# What `make run` asks for: every experiment's figures and the summary, then the summary printed to the
# console. No output file, so it runs (prints) every time it is asked for, even when all else is done.
localrules:
    summary,


rule summary:
    input:
        table="results/summary.md",
        plots=experiment_targets("plots/training.png"),
    shell:
        "orpo report show {input.table}"


# The objectives comparison across every experiment of the config (config/experiments/objectives.yaml):
# `snakemake results/objectives/table.md` (validation margins, IFEval prompt-strict, margin and λ over steps).
rule objectives_table:
    input:
        ifeval=experiment_targets("ifeval.json"),
        replay=experiment_targets("train/replay.json"),
        runs=[marker(L.path(n, "train/run")) for n in L.configs],
    output:
        table="results/objectives/table.md",
        plot="results/objectives/margin_lambda.png",
    params:
        experiments=lambda wildcards: settings_file("objectives", {
            n: {"folder": L.path(n, ""), "adapter": L.config(n)["generate"]["adapter"]} for n in L.configs}),
        code=CODE["objectives"],
    log:
        "logs/objectives.log",
    benchmark:
        "benchmarks/objectives.tsv"
    shell:
        "orpo report objectives --experiments @{params.experiments} --out {output.table} --plot {output.plot} "
        "> {log} 2>&1"
