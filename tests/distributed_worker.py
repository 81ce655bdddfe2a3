"""One GRPO step of an experiment, its gradients saved per mini-batch: run alone (1 process) or under
torchrun (each rank its share), by tests/test_distributed.py.

    python tests/distributed_worker.py CONFIG OUT.pt
    python -m torch.distributed.run --nproc-per-node 2 tests/distributed_worker.py CONFIG OUT.pt
"""

import sys

import torch

from vlgrpo import config, distributed
from vlgrpo.trainer import GRPOTrainer


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) one: a collective, every rank calls it."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def main(config_path: str, out: str) -> None:
    trainer = GRPOTrainer(config.read_resolved(config_path))
    trainer.load(0)
    grads = []  # per optimizer step (mini-batch): {parameter name: gradient}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({n: full(p.grad) for n, p in trainer.policy.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    record = trainer.step(1)
    if distributed.is_rank0():
        torch.save({"grads": grads, "record": record}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
