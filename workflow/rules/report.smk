# The analysis report: figures, written analysis and summary.json from metrics.jsonl and val/.


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
        exp=lambda w, output: Path(output.summary).parent.parent,
        out=lambda w, output: Path(output.summary).parent,
    log:
        f"{EXP}/logs/report.log",
    conda:
        CONDA_ENV
    shell:
        "vlgrpo report --experiment-dir {params.exp} --out {params.out} --config {params.config} > {log} 2>&1"
