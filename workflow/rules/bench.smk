# The GRPO step benchmark (issue 7): the production step, optimized and plain, in one process.
#   snakemake bench --cores all --configfile configs/bench_h200.yaml --forcerun bench
# (configs/bench_cpu.yaml: the tiny demo model on a CPU). The JSON goes to benchmarks/results/.


rule bench:
    input:
        paths.path(paths.FILTERED, EXP, split="train"),
        paths.path(paths.FILTERED, EXP, split="val"),
        local_inputs(CFG["model"]["path"]),
    output:
        f"benchmarks/results/{CFG['experiment']}.json",
    params:
        config=RESOLVED,
        key=config_key(*TRAIN_KEYS, "trainer.device"),
    resources:
        gpu=EVAL_GPUS,
    log:
        f"{EXP}/logs/bench.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo bench --config {params.config} --out {output} > {log} 2>&1"
