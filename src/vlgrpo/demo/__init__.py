"""The embedded default's inputs: a synthetic geometry task and a tiny Qwen2.5-VL that learns it on a CPU.

make_dataset writes the task as Geometry3K-style parquet splits; make_model writes a model folder
that loads like Qwen/Qwen2.5-VL-3B-Instruct, after a supervised warm-up that teaches the format but
not the answer.
"""

from vlgrpo.demo.build import make_model
from vlgrpo.demo.task import make_dataset

__all__ = ["make_dataset", "make_model"]
