# Token-length filters count with the base model's tokenizer. data.raw may be a hub id (no file input then).
rule curate:
    input:
        raw=shared(L.raw_input),
        model=shared(L.source_input),
        eval_prompts=shared(lambda n: L.config(n)["eval"]["prompts"]),
    output:
        marker("results/{up}curated"),
    params:
        out=lambda wildcards, output: folder(output[0]),
        raw=shared(L.raw),
        model=shared(L.source_ref),
        settings=shared(lambda n: section(n, "curate")),
        code=CODE["curate"],
    log:
        "logs/{up}curate.log",
    benchmark:
        "benchmarks/{up}curate.tsv"
    shell:
        "orpo curate --inputs {params.raw} --out {params.out} --tokenizer-from {params.model} "
        "--eval-prompts {input.eval_prompts} --settings @{params.settings} > {log} 2>&1"
