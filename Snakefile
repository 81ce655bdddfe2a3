"""vlgrpo: GRPO post-training of a vision-language model, as one resumable workflow.

    snakemake --cores all                                        # the embedded CPU demo (config.yaml)
    snakemake --cores all --configfile configs/qwen2_5_vl_3b_geo3k.yaml   # the 3B recipe

filter data -> baseline evaluation (step 0) -> training segments of save_freq steps, each resuming
from the checkpoint store -> validation of each checkpoint -> report.
"""

import os

from snakemake.utils import min_version

min_version("8.20")

# For envs/vlgrpo.post-deploy.sh, which installs this checkout into the rules' conda environment.
os.environ["VLGRPO_SOURCE"] = workflow.basedir


envvars:
    "VLGRPO_SOURCE",


# The embedded demo applies only when no --configfile is given: a recipe stands on the schema's
# defaults alone, never on the demo's values.
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config.yaml"


include: "workflow/rules/common.smk"  # validates the config against the schema
include: "workflow/rules/demo.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


rule all:
    input:
        report_outputs(),
