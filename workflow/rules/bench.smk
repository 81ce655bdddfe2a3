# The GRPO step benchmark (issue 7): the production step, optimized and plain, in one process.
#   snakemake bench --cores all --configfile configs/bench_h200.yaml --forcerun bench
# (configs/bench_cpu.yaml: the tiny demo model on a CPU). The JSON goes to benchmarks/results/;
# the plain path is the config with configs/plain.yaml on top.


rule bench:
    input:
        paths.path(paths.FILTERED, EXP, split="train"),
        paths.path(paths.FILTERED, EXP, split="val"),
        local_inputs(CFG["model"]["path"]),
    output:
        f"benchmarks/results/{CFG['experiment']}.json",
    params:
        config=RESOLVED,
        plain=f"{workflow.basedir}/configs/plain.yaml",
        key=config_key(*config_lib.TRAIN_KEYS, "trainer.device"),
    resources:
        gpu=EVAL_GPUS,
    log:
        f"{EXP}/logs/bench.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo bench --config {params.config} --plain {params.plain} --out {output} > {log} 2>&1"
