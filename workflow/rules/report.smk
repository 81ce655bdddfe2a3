# The analysis report: figures, written analysis and summary.json from metrics.jsonl and val/.

from vlgrpo.report.plots import FIGURES


def report_inputs(wildcards):
    total = planned_total()
    return [val_file(s) for s in plan.validation_steps(CFG, total)] + [
        marker_file(plan.segment_ends(CFG, total)[-1])
    ]


def report_outputs():
    out = paths.REPORT.format(exp=EXP)
    return [f"{out}/report.html", f"{out}/summary.json"] + [f"{out}/{name}" for name in FIGURES]


rule report:
    input:
        report_inputs,
    output:
        html=report(f"{paths.REPORT.format(exp=EXP)}/report.html", caption="../report/report.rst", category="Report"),
        summary=f"{paths.REPORT.format(exp=EXP)}/summary.json",
        figures=[
            report(
                f"{paths.REPORT.format(exp=EXP)}/{name}",
                caption=f"../report/{category}.rst",
                category=category.replace("_", " ").capitalize(),
            )
            for name, (_title, category) in FIGURES.items()
        ],
    params:
        config=RESOLVED,
        exp=EXP,
        out=paths.REPORT.format(exp=EXP),
    log:
        f"{EXP}/logs/report.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo report --experiment-dir {params.exp} --out {params.out} --config {params.config} > {log} 2>&1"
