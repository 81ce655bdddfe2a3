# Filter and render each split exactly as training will see it. A checkpoint rule: the number of
# training segments follows from the filtered train split's size.


checkpoint filter_data:
    input:
        local_inputs(CFG["data"]["train"], CFG["data"]["val"], CFG["model"]["path"]),
    output:
        parquet=paths.FILTERED.format(exp=EXP, split="{split}"),
        stats=paths.STATS.format(exp=EXP, split="{split}"),
    wildcard_constraints:
        split="train|val",
    params:
        config=RESOLVED,
        key=config_key("data", "model.path", "worker.rollout.batch_size"),
        inputs=lambda w: content_key(CFG["data"]["train"], CFG["data"]["val"], CFG["model"]["path"]),
    log:
        f"{EXP}/logs/filter_{{split}}.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo filter --config {params.config} --split {wildcards.split} > {log} 2>&1"
