"""`python -m vlgrpo.segment --config ... --end-step N --marker ...`: one training segment
(vlgrpo.trainer.main), the command `vlgrpo train` runs (under torchrun with several processes).

A module of its own, with nothing at its top: the reward's grading processes are spawned, and a
spawned process first imports the parent's main module; run as `-m vlgrpo.trainer`, each of them
imported torch, transformers and torchvision (seconds, while the first step waited for its grades).
"""

if __name__ == "__main__":
    from vlgrpo.trainer import main

    main()
