#!/usr/bin/env bash
# Installs vlgrpo (editable, with its pip dependencies) into the environment of envs/vlgrpo.yaml.
# Snakemake runs this once after creating the environment, inside it, from the working directory and
# from a copy under .snakemake/conda/, so neither tells where the checkout is: the Snakefile exports
# VLGRPO_SOURCE, its own folder.
set -euo pipefail
pip install -e "${VLGRPO_SOURCE:?not set: the Snakefile exports the vlgrpo checkout as VLGRPO_SOURCE}"
