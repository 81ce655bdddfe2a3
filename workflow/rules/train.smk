# One job per training segment, named by its end step. The trainer keeps resumable state in its own
# checkpoint store (Snakemake deletes a failed job's outputs); the declared output is a small marker
# written last. A failed segment is retried and resumes from the latest checkpoint.


rule train_segment:
    input:
        previous_segment,
    output:
        paths.MARKER.format(exp=EXP, step="{step}"),
    wildcard_constraints:
        step=STEP,
    params:
        config=RESOLVED,
        key=config_key(*config_lib.TRAIN_KEYS),
    retries: failures.RetriesUnlessUserError(CFG["trainer"]["retries"], EXP, "train_")  # none after a user error
    resources:
        gpu=TRAIN_GPUS,
    log:
        f"{EXP}/logs/train_{{step}}.log",
    conda:
        CONDA_ENV
    shell:
        # fd 3: the console, for the recoveries the user must see (vlgrpo.console)
        "VLGRPO_CONSOLE_FD=3 vlgrpo train --config {params.config} --end-step {wildcards.step} 3>&2 >> {log} 2>&1"
