"""`vlgrpo check`: what would fail every job, checked once before any job runs.

The workflow's onstart runs it (once per workflow run, never for a dry run: parsing has no side
effects), so a mistake stops the run at once with one line instead of failing the filter, the
baseline and every retry of a segment:
- the reward function: imported and called on real answers (the train split's where its file is
  local, else stand-ins; the trainer checks again on the filtered answers);
- `worker.rollout.engine: vllm`: vLLM importable here (skipped with --use-conda: jobs run elsewhere);
- `trainer.device: cuda`: a GPU visible here (skipped when an executor places jobs on other nodes);
- a hub model id: served by the hub or held in this machine's cache (data.sources.check_hub_model).
It also tells, without stopping, when a reward file changed since results were made with it: the
segment markers and validation results record the file's SHA-256 (rewards.reward_file_digest);
they are kept, not redone.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from vlgrpo import config as config_lib
from vlgrpo import paths
from vlgrpo.config import ConfigError
from vlgrpo.rewards import reward_file_digest, reward_from_config

# Where the answers of the data are not at hand yet (a hub dataset, the demo's data not made yet).
STAND_IN_ANSWERS = ["3", "12", "\\frac{1}{2}", "2\\sqrt{3}"]


def _answers(cfg: dict) -> list[str]:
    """Up to 8 answers of the train split: its filtered file, or its local parquet source; else stand-ins."""
    import pyarrow.parquet as pq

    key = cfg["data"]["answer_key"]
    filtered = paths.path(paths.FILTERED, config_lib.experiment_dir(cfg), split="train")
    source = Path(cfg["data"]["train"]).expanduser()
    files = [filtered] if filtered.is_file() else sorted(source.glob("*.parquet")) if source.is_dir() else [source]
    for file in files:
        if file.suffix == ".parquet" and file.is_file():
            try:
                rows = pq.ParquetFile(file).read_row_group(0, columns=["answer" if file == filtered else key])
                answers = [str(a) for a in rows.column(0).to_pylist()[:8]]
            except Exception:  # an unreadable file is the filter's to report, with its own message
                continue
            if answers:
                return answers
    return STAND_IN_ANSWERS


def check(cfg: dict, device: bool = True, engine: bool = True) -> list[str]:
    """Raise a VlgrpoError (one line first) for a mistake that every job would hit; return notes to show."""
    reward_from_config(cfg, _answers(cfg))
    if engine and cfg["worker"]["rollout"]["engine"] == "vllm" and importlib.util.find_spec("vllm") is None:
        from vlgrpo.rollout import VLLM_INSTALL

        raise ConfigError(f"worker.rollout.engine is vllm, but vLLM is not installed in this environment; {VLLM_INSTALL}")
    if device and cfg["trainer"]["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(config_lib.NO_CUDA)
    model = cfg["model"]["path"]
    from vlgrpo.data.sources import _looks_local, check_hub_model

    if not (_looks_local(model) or Path(model).expanduser().exists() or model.startswith(cfg["demo"]["out_dir"])):
        check_hub_model(model)
    return reward_changes(cfg)


def reward_changes(cfg: dict) -> list[str]:
    """A note naming the results made with another version of the reward file, if any."""
    now = reward_file_digest(cfg["worker"]["reward"]["reward_function"])
    if now is None:
        return []
    exp = config_lib.experiment_dir(cfg)
    other = []
    for path in sorted(exp.glob("segments/step_*.json")) + sorted(exp.glob("val/step_*.json")):
        try:
            recorded = json.loads(path.read_text()).get("reward_sha256")
        except (OSError, ValueError):
            continue
        if recorded is not None and recorded != now:
            other.append(str(path.relative_to(exp)))
    if not other:
        return []
    spec = cfg["worker"]["reward"]["reward_function"]
    return [
        f"note: the reward file of {spec} changed since these results of {exp} were made with it: {', '.join(other)}. "
        "They are kept and not redone (steps still to come use the file as it is now); to redo them with the new "
        "reward, run under a new experiment name"
    ]
