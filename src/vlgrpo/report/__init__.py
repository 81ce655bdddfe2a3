"""The analysis report of a GRPO run: read metric records, analyse them, write HTML + summary.json.

Public API:
- read_experiment(exp_dir), read_easyr1(paths): records from our results/<exp>/ or EasyR1 logs.
- merge_records(records): one row per step (later records override earlier ones key by key).
- summarize(frame, ...): the summary.json dict; the rules behind it are analysis.RULES.
- build_report(records, out_dir, *, title, ...): write report.html, summary.json and figures.
- main(argv): the `vlgrpo report` command line.
"""

from vlgrpo.report.analysis import RULES, summarize
from vlgrpo.report.build import build_report
from vlgrpo.report.cli import main
from vlgrpo.report.plots import FIGURES
from vlgrpo.report.records import RecordError, merge_records, read_easyr1, read_experiment

__all__ = [
    "FIGURES",
    "RULES",
    "RecordError",
    "build_report",
    "main",
    "merge_records",
    "read_easyr1",
    "read_experiment",
    "summarize",
]
