# Only with quantize.bits set: the base model's weights quantized once; train, replay, generate and spin load
# this folder (L.model_ref), curate and render keep reading the source's tokenizer.
rule quantize:
    input:
        model=shared(L.source_input),
    output:
        marker("results/{up}quantized/model"),
    params:
        model=shared(L.source_ref),
        out=lambda wildcards, output: folder(output[0]),
        settings=shared(lambda n: section(n, "quantize")),
        code=CODE["quantize"],
    log:
        "logs/{up}quantize.log",
    benchmark:
        "benchmarks/{up}quantize.tsv"
    shell:
        "orpo quantize --model {params.model} --out {params.out} --settings @{params.settings} > {log} 2>&1 && "
        + CONSOLE_NOTES
