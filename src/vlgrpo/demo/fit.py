"""The training loop both demo warm-ups share (perception.py, warmup.py)."""

from __future__ import annotations

import time

import numpy as np
import torch

LOSS_WINDOW = 10  # steps averaged for the reported final loss


def fit(optimizer: torch.optim.Optimizer, steps: int, next_loss) -> dict:
    """`steps` optimizer steps on next_loss() with the lr decaying linearly to 0; the loss summary.

    The decay lets the last steps average over many batches, so what the model settles on reflects
    the whole target distribution instead of echoing the last few batches.
    """
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        loss = next_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return {"loss_first": losses[0], "loss_final": float(np.mean(losses[-LOSS_WINDOW:])), "seconds": round(time.perf_counter() - start, 3)}
