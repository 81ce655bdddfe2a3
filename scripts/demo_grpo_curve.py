"""GRPO learning curve of a demo experiment, in one process: greedy validation every N steps.

For tuning the embedded default without Snakemake's per-segment process starts. Needs the
experiment's resolved config and filtered splits (the demo workflow's first jobs, or
`vlgrpo resolve/make-demo-data/make-demo-model/filter`). Writes validations as steps 10000+N so the
experiment's own files are untouched.

    python scripts/demo_grpo_curve.py results/demo/config.resolved.yaml --steps 150 --every 25 \
        --set model.freeze_vision_tower=true --set worker.actor.optim.lr=1.0e-3
"""

import argparse
import time

from vlgrpo import config
from vlgrpo.evaluate import evaluate
from vlgrpo.trainer import GRPOTrainer

STEP_OFFSET = 10_000  # validation files of this script never collide with the pipeline's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--set", action="append", default=[], help="key.sub=value (YAML value)")
    args = parser.parse_args()
    cfg = config.validate(config.deep_merge(config.read_resolved(args.config), config.parse_assignments(args.set)))
    trainer = GRPOTrainer(cfg)
    trainer.load(0)
    start = time.perf_counter()

    def validate(step: int) -> None:
        r = evaluate(cfg, STEP_OFFSET + step, model=trainer.policy)
        print(f"VAL step {step} format {r['val/format_reward']:.3f} accuracy {r['val/accuracy_reward']:.3f} "
              f"at {time.perf_counter() - start:.0f}s", flush=True)

    validate(0)
    for step in range(1, args.steps + 1):
        r = trainer.step(step)
        print(f"step {step} reward {r['reward/overall']:.3f} format {r['reward/format']:.3f} accuracy {r['reward/accuracy']:.3f} "
              f"kl {r.get('actor/kl_loss', 0.0):.4f} entropy {r['actor/entropy_loss']:.3f} step_s {r['timing_s/step']:.2f}", flush=True)
        if step % args.every == 0:
            validate(step)


if __name__ == "__main__":
    main()
