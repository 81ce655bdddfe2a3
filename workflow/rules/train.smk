# One job per training segment, named by its end step. The trainer keeps resumable state in its own
# checkpoint store (Snakemake deletes a failed job's outputs); the declared output is a small marker
# written last. A failed segment is retried and resumes from the latest checkpoint.


def previous_segment(wildcards):
    """The previous segment's marker; the first segment needs the filtered data and the base model."""
    ends = plan.segment_ends(CFG, planned_total())
    end = step_of(wildcards)
    if end not in ends:
        raise WorkflowError(f"step {end} is not a segment end of this run ({ends[:3]}...)")
    i = ends.index(end)
    if i:
        return [marker_file(ends[i - 1])]
    return [paths.path(paths.FILTERED, EXP, split="train")] + local_inputs(CFG["model"]["path"])


rule train_segment:
    input:
        previous_segment,
    output:
        paths.MARKER.format(exp=EXP, step="{step}"),
    wildcard_constraints:
        step=STEP,
    params:
        config=RESOLVED,
        key=config_key(*TRAIN_KEYS),
    retries: CFG["trainer"]["retries"]
    resources:
        gpu=TRAIN_GPUS,
    log:
        f"{EXP}/logs/train_{{step}}.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo train --config {params.config} --end-step {wildcards.step} >> {log} 2>&1"
