"""Reward functions: the one grader used by baseline evaluation, the training reward and validation.

A reward function maps (response, ground_truth) to a dict of floats with at least the keys
`overall` (the scalar the advantage is computed from), `format` and `accuracy`. The built-in ones
follow EasyR1's examples/reward_function/{r1v,math}.py exactly, so scores are comparable with its
runs; accuracy is mathruler's `grade_answer` in both.

Config (worker.reward): `reward_function` is "r1v", "math" or "path/to/file.py:function";
`format_weight` null means the reward's own default.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import multiprocessing
import os
import pickle
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from mathruler.grader import extract_boxed_content, grade_answer

RewardFunction = Callable[[str, str], dict[str, float]]

REWARD_KEYS = ("overall", "format", "accuracy")

_R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
# Not DOTALL, as in EasyR1: an answer spanning lines is not extracted, so the whole response is graded.
_R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_MATH_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
# EasyR1 removes this whitespace first, for models that write "< /think >" (Qwen2.5-VL-32B).
_MATH_TAG_SPACES = re.compile(r"\s*(<|>|/)\s*")

log = logging.getLogger(__name__)


def _combine(format_score: float, accuracy_score: float, format_weight: float) -> dict[str, float]:
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    return {
        "overall": (1.0 - format_weight) * accuracy_score + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }


def r1v(response: str, ground_truth: str, format_weight: float = 0.5) -> dict[str, float]:
    """R1-V reward: `<think>...</think> <answer>...</answer>` format, mathruler accuracy.

    format = 1 if the whole response fullmatches `<think>.*?</think>\\s*<answer>.*?</answer>`
    (DOTALL). accuracy = grade_answer(first `<answer>...</answer>` content on one line, stripped,
    or else the whole stripped response; stripped ground truth). A grader error scores accuracy 0.
    """
    format_score = 1.0 if _R1V_FORMAT.fullmatch(response) else 0.0
    match = _R1V_ANSWER.search(response)
    given = match.group(1).strip() if match else response.strip()
    try:
        accuracy_score = 1.0 if grade_answer(given, ground_truth.strip()) else 0.0
    except Exception:  # EasyR1 scores a grader crash (sympy on odd input) as wrong, not as an error
        accuracy_score = 0.0
    return _combine(format_score, accuracy_score, format_weight)


def math(response: str, ground_truth: str, format_weight: float = 0.1) -> dict[str, float]:
    """Math reward: `<think>...</think> ... \\boxed{...}` format, mathruler accuracy.

    Whitespace around `<`, `>` and `/` is removed first. format = 1 if the response fullmatches
    `<think>.*</think>.*\\boxed\\{.*\\}.*` (DOTALL). accuracy = grade_answer(content of the last
    brace-balanced `\\boxed{}`, ground truth); no box grades the string "None", as in EasyR1.
    """
    response = _MATH_TAG_SPACES.sub(r"\1", response)
    format_score = 1.0 if _MATH_FORMAT.fullmatch(response) else 0.0
    accuracy_score = 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0
    return _combine(format_score, accuracy_score, format_weight)


BUILTIN_REWARDS: dict[str, RewardFunction] = {"r1v": r1v, "math": math}


def _load_user_function(spec: str) -> Callable:
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name or path.suffix != ".py":
        raise ValueError(
            f"reward function {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor of the form path/to/file.py:function"
        )
    if not path.is_file():
        raise FileNotFoundError(f"reward function file not found: {path} (from {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"vlgrpo_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise AttributeError(f"{path} has no function {name!r}; functions there: {', '.join(available) or 'none'}")
    return fn


def load_reward_function(spec: str, format_weight: float | None = None) -> RewardFunction:
    """Resolve config `worker.reward` into a function (response, ground_truth) -> scores dict.

    spec: "r1v", "math", or "path/to/file.py:function" (a user function with the same contract:
    `fn(response, ground_truth[, format_weight=...]) -> {"overall", "format", "accuracy", ...}`).
    format_weight: None keeps the function's own default; a number is passed as `format_weight`
    (a user function must then accept that keyword).
    """
    fn = BUILTIN_REWARDS.get(spec) or _load_user_function(spec)
    if format_weight is None:
        return fn
    if "format_weight" not in inspect.signature(fn).parameters:
        raise TypeError(f"reward function {spec!r} takes no format_weight, but the config sets it to {format_weight}")
    return functools.partial(fn, format_weight=format_weight)


def _checked(result: object) -> dict[str, float]:
    """The scores a reward function returned, as floats; raise TypeError if they break the contract."""
    if not isinstance(result, Mapping):
        raise TypeError(f"reward function returned {type(result).__name__}, expected a dict of floats")
    missing = [k for k in REWARD_KEYS if k not in result]
    if missing:
        raise TypeError(f"reward function result lacks keys {missing}; it has {sorted(result)}")
    return {str(k): float(v) for k, v in result.items()}


def _grade(fn: RewardFunction, responses: list[str], ground_truths: list[str]):
    """(results, first_error): each response's checked scores, or None where the call failed."""
    results: list[dict[str, float] | None] = []
    first_error: Exception | None = None
    for response, ground_truth in zip(responses, ground_truths):
        try:
            results.append(_checked(fn(response, ground_truth)))
        except Exception as error:
            results.append(None)
            first_error = first_error or error
    return results, first_error


def _grade_in_worker(fn: RewardFunction, responses: list[str], ground_truths: list[str]):
    results, first_error = _grade(fn, responses, ground_truths)
    if first_error is not None:
        try:
            pickle.dumps(first_error)
        except Exception:
            first_error = RuntimeError(repr(first_error))
    return results, first_error


def _assemble(results: list, first_error: Exception | None) -> tuple[list[dict[str, float]], int]:
    n_failed = sum(r is None for r in results)
    if n_failed:
        log.warning(
            "reward function failed on %d of %d responses (scored 0); first error: %r",
            n_failed, len(results), first_error, exc_info=first_error,
        )
    keys = dict.fromkeys(REWARD_KEYS)
    for r in results:
        keys.update(dict.fromkeys(r or ()))
    zeros = dict.fromkeys(keys, 0.0)
    return [r if r is not None else dict(zeros) for r in results], n_failed


def score_responses(
    fn: RewardFunction, responses: list[str], ground_truths: list[str]
) -> tuple[list[dict[str, float]], int]:
    """Score each response against its ground truth; a failing response scores 0 and is counted.

    Returns (scores, n_failed): one dict per response, all with the same keys. A call that raises
    or returns something other than a dict with the REWARD_KEYS scores 0.0 for every key, so one bad
    response never stops training; the first failure is logged once per call, with its traceback.
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    return _assemble(*_grade(fn, responses, ground_truths))


def default_workers() -> int:
    """Grading processes: one per spare CPU core, at most 8; 0 (grade in this process) on small hosts."""
    spare = min(8, (os.cpu_count() or 1) - 1)
    return spare if spare >= 2 else 0


_POOLS: dict[int, ProcessPoolExecutor] = {}


def _pool(workers: int) -> ProcessPoolExecutor:
    if workers not in _POOLS:  # spawned: no copy of this process's CUDA state or threads
        _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    return _POOLS[workers]


def _ready() -> None:
    """Nothing; a worker that unpickles it imports this module and the grader."""


def start_workers(workers: int | None = None) -> None:
    """Spawn the grading processes now, so a later Grading does not wait for them to start and
    import the grader (~1 s on a 2-core host); call it before work that grading will follow."""
    workers = default_workers() if workers is None else workers
    if workers >= 2:
        pool = _pool(workers)
        for _ in range(workers):  # each submit to a pool with no idle process spawns one
            pool.submit(_ready)


def _picklable(fn: RewardFunction) -> bool:
    """Whether `fn` can travel to a worker process (a user function loaded from a file path may not)."""
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


class Grading:
    """score_responses running in the background; result() gives exactly what score_responses gives."""

    def __init__(self, fn: RewardFunction, responses: list[str], ground_truths: list[str], workers: int | None = None):
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        self.fn, self.responses, self.ground_truths = fn, responses, ground_truths
        workers = default_workers() if workers is None else workers
        self.futures = None
        if workers >= 2 and len(responses) > 1 and _picklable(fn):
            size = -(-len(responses) // (2 * workers))  # contiguous chunks, in order
            pool = _pool(workers)
            self.futures = [
                pool.submit(_grade_in_worker, fn, responses[i : i + size], ground_truths[i : i + size])
                for i in range(0, len(responses), size)
            ]

    def result(self) -> tuple[list[dict[str, float]], int]:
        if self.futures is None:
            return score_responses(self.fn, self.responses, self.ground_truths)
        results, first_error = [], None
        for future in self.futures:
            part, error = future.result()
            results += part
            first_error = first_error or error
        return _assemble(results, first_error)
