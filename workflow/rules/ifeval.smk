rule ifeval:
    input:
        prompts=config["eval"]["prompts"],
        base="results/generations/ifeval/base.jsonl",
        orpo="results/generations/ifeval/orpo.jsonl",
    output:
        summary="results/ifeval.json",
        details=directory("results/ifeval"),
    params:
        limit=config["eval"]["limit"],
        code=CODE["ifeval"],
    log:
        "logs/ifeval.log",
    benchmark:
        "benchmarks/ifeval.tsv"
    shell:
        "orpo ifeval compare --inputs {input.prompts} --generations base={input.base} orpo={input.orpo} "
        "--limit {params.limit} --out {output.summary} --details {output.details} > {log} 2>&1"
