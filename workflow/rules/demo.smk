# The embedded default's inputs: a synthetic geometry dataset and a tiny Qwen2.5-VL made on the spot.
# They run only when the config points data/model at their outputs (config.yaml does), each into a
# folder keyed by its settings (vlgrpo/demo_folders.py): experiments that differ get their own.


rule demo_data:
    output:
        expand(f"{DEMO_DATA}/{{split}}.parquet", split=DEMO_SPLITS),
    params:
        config=RESOLVED,
        key=config_key(*demo_folders.DATA_KEYS),
    log:
        f"{DEMO}/logs/demo_data-{Path(DEMO_DATA).name}.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo make-demo-data --config {params.config} > {log} 2>&1"


if CFG["model"]["path"].startswith(DEMO):

    rule demo_model:
        output:
            directory(CFG["model"]["path"]),
        params:
            config=RESOLVED,
            key=config_key(*demo_folders.MODEL_KEYS),
        log:
            f"{DEMO}/logs/demo_model-{Path(CFG['model']['path']).name}.log",
        conda:
            CONDA_ENV
        shell:
            "vlgrpo make-demo-model --config {params.config} > {log} 2>&1"
