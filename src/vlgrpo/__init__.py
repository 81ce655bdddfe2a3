"""vlgrpo: GRPO post-training of vision-language models as a resumable Snakemake pipeline."""

__version__ = "0.1.0"
