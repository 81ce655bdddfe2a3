# Validation of one step: 0 is the base model (the baseline, run once and cached), any other step is
# the checkpoint its segment wrote. It depends on that segment only, so it runs beside the next one.


rule evaluate:
    input:
        evaluated_model,
    output:
        paths.VAL.format(exp=EXP, step="{step}"),
        paths.GENERATIONS.format(exp=EXP, step="{step}"),
    wildcard_constraints:
        step=STEP,
    params:
        config=RESOLVED,
        # Step 0 depends on the base model and the validation settings; a checkpoint on training too.
        key=lambda w: config_key(*EVAL_KEYS, *(config_lib.TRAIN_KEYS if step_of(w) else ())),
    resources:
        # Adopting a segment's in-process validation is a rename: no GPU (read when the job starts).
        gpu=lambda w: 0 if val_results.in_process_result(CFG, step_of(w)) else EVAL_GPUS,
    log:
        f"{EXP}/logs/evaluate_{{step}}.log",
    conda:
        CONDA_ENV
    shell:
        # fd 3: the console, for a kept result put back (vlgrpo.console)
        "VLGRPO_CONSOLE_FD=3 vlgrpo evaluate --config {params.config} --step {wildcards.step} 3>&2 > {log} 2>&1"
