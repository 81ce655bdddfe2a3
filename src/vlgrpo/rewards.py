"""Reward functions: the one grader used by baseline evaluation, the training reward and validation.

A reward function scores each response against its ground truth with a dict of floats holding at
least `overall` (the scalar the advantage is computed from); every other key (the built-ins' `format`
and `accuracy`, EasyR1's dapo.py's `overlong`) is logged as reward/<key> and val/<key>_reward, as
EasyR1 logs them. The built-in ones follow EasyR1's examples/reward_function/{r1v,math}.py exactly, so scores are comparable with
its runs; accuracy is mathruler's `grade_answer` in both.

A user's file may take any of the FORMS below: vlgrpo's own, or either of EasyR1's (its reward
files declare REWARD_TYPE "sequential" or "batch"). The form is worker.reward.reward_type where set,
else the file's REWARD_TYPE, else read from the signature. Every run calls the function once on
responses built from real answers before it starts (RewardFunction.check), so a function that breaks
the contract stops the run at once; during a run, a step whose responses fail beyond
worker.reward.max_error_fraction stops with the first error's traceback.

Config (worker.reward): `reward_function` is "r1v", "math" or "path/to/file.py:function" (a file alone
means its function `main`, as in EasyR1); `reward_function_kwargs`, keywords bound to the function as
EasyR1 binds them; `format_weight` null means the reward's own default; `reward_type`;
`max_error_fraction`. (`skip_special_tokens` is applied where responses are decoded: rollout.hf.)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import logging
import multiprocessing
import os
import pickle
import re
import traceback
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mathruler.grader import extract_boxed_content, grade_answer

from vlgrpo.errors import VlgrpoError

REWARD_KEYS = ("overall",)  # required of a result; more keys are kept and logged
FORMS = {
    "vlgrpo": "fn(response: str, ground_truth: str[, format_weight=...]) -> dict",
    "sequential": 'compute_score(reward_input: dict[, format_weight=...]) -> dict  (EasyR1, REWARD_TYPE = "sequential")',
    "batch": 'compute_score(reward_inputs: list[dict][, format_weight=...]) -> list[dict]  (EasyR1, REWARD_TYPE = "batch")',
}
CONTRACT = (
    "A reward function takes one of these forms:\n  " + "\n  ".join(FORMS.values()) + "\n"
    "EasyR1's input dicts hold response, response_length (tokens) and ground_truth. Each result is a dict of floats "
    f"with at least the keys {', '.join(REWARD_KEYS)}. The form is worker.reward.reward_type where set, else the "
    "file's REWARD_TYPE, else read from the signature."
)

_R1V_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
# Not DOTALL, as in EasyR1: an answer spanning lines is not extracted, so the whole response is graded.
_R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_MATH_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
# EasyR1 removes this whitespace first, for models that write "< /think >" (Qwen2.5-VL-32B).
_MATH_TAG_SPACES = re.compile(r"\s*(<|>|/)\s*")

log = logging.getLogger(__name__)


class RewardContractError(VlgrpoError, TypeError):
    """A reward function that cannot be called as its form says, or returns something else."""


class RewardFailure(VlgrpoError, RuntimeError):
    """More of a step's responses failed in the reward function than worker.reward.max_error_fraction."""


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
    brace-balanced `\\boxed{}`, ground truth); no box grades the string "None", as in EasyR1. A grader
    crash (sympy on odd input) scores accuracy 0 and keeps the format score (EasyR1's run would stop).
    """
    response = _MATH_TAG_SPACES.sub(r"\1", response)
    format_score = 1.0 if _MATH_FORMAT.fullmatch(response) else 0.0
    try:
        accuracy_score = 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0
    except Exception:
        accuracy_score = 0.0
    return _combine(format_score, accuracy_score, format_weight)


BUILTIN_REWARDS: dict[str, Callable[..., dict[str, float]]] = {"r1v": r1v, "math": math}


def _checked(result: object) -> dict[str, float]:
    """The scores a reward function returned, as floats; raise RewardContractError if they break the contract."""
    if not isinstance(result, Mapping):
        raise RewardContractError(f"reward function returned {type(result).__name__}, expected a dict of floats")
    missing = [k for k in REWARD_KEYS if k not in result]
    if missing:
        raise RewardContractError(f"reward function result lacks keys {missing}; it has {sorted(result)}")
    try:
        return {str(k): float(v) for k, v in result.items()}
    except (TypeError, ValueError) as error:
        raise RewardContractError(f"reward function result {dict(result)!r} is not all floats: {error}") from None


@dataclass(frozen=True)
class RewardFunction:
    """A reward function with its form; grade() calls it as that form, one response or one batch at a time.

    fn: the function, format_weight bound. form: a key of FORMS. name: "r1v" or "path/file.py:function".
    chosen_by: what said the form (for messages). max_error_fraction: see score_responses.
    """

    fn: Callable
    form: str
    name: str
    chosen_by: str = "built-in"
    max_error_fraction: float = 1.0

    def grade(self, responses: list[str], ground_truths: list[str], lengths: list[int] | None):
        """(results, first_error): each response's checked scores, or None where the call failed;
        first_error is the first failure's traceback text (it travels between processes)."""
        if self.form != "vlgrpo" and lengths is None:
            raise ValueError(f"the reward function {self.name} is in EasyR1's {self.form} form: it needs response lengths")
        inputs = ([{"response": r, "response_length": n, "ground_truth": g} for r, n, g in zip(responses, lengths, ground_truths)]
                  if self.form != "vlgrpo" else None)
        batch_out = None
        if self.form == "batch":  # one call for all; if it fails, every response has failed
            try:
                batch_out = self.fn(inputs)
                if not isinstance(batch_out, (list, tuple)) or len(batch_out) != len(inputs):
                    got = f"{type(batch_out).__name__}" + (f" of {len(batch_out)}" if isinstance(batch_out, (list, tuple)) else "")
                    raise RewardContractError(f"a batch reward function returns a list of {len(inputs)} dicts for {len(inputs)} inputs; got {got}")
            except Exception:
                return [None] * len(inputs), traceback.format_exc()
        results, first_error = [], None
        for i, (response, ground_truth) in enumerate(zip(responses, ground_truths)):
            try:
                if batch_out is not None:
                    result = batch_out[i]
                elif inputs is not None:
                    result = self.fn(inputs[i])
                else:
                    result = self.fn(response, ground_truth)
                results.append(_checked(result))
            except Exception:
                results.append(None)
                first_error = first_error or traceback.format_exc()
        return results, first_error

    def __call__(self, response: str, ground_truth: str, response_length: int | None = None) -> dict[str, float]:
        """One response's checked scores; a failure raises RewardContractError with the function's traceback."""
        results, error = self.grade([response], [ground_truth], None if response_length is None else [response_length])
        if results[0] is None:
            raise RewardContractError(f"reward function {self.name} failed:\n{error}")
        return results[0]

    def check(self, ground_truths: list[str]) -> None:
        """Call the function once on responses built from these real answers (a <think> block, then the
        answer in <answer> and in \\boxed{}); stop with a RewardContractError naming the function and
        the forms it may take if it raises or returns something else."""
        responses = [f"<think>Checking the reward function.</think> <answer>{g}</answer> \\boxed{{{g}}}" for g in ground_truths]
        lengths = [len(r.split()) for r in responses]  # a stand-in for the token count
        results, error = self.grade(responses, ground_truths, lengths)
        if error is not None:
            failed = sum(r is None for r in results)
            raise RewardContractError(
                f"reward function {self.name}, called as the {self.form!r} form ({self.chosen_by}), failed on {failed} of "
                f"{len(results)} responses built from real answers before the run ({error.strip().splitlines()[-1]}):"
                f"\n{error}\n{CONTRACT}"
            )


def _load_user_function(spec: str):
    """(function, module) named by "path/to/file.py:function", or "path/to/file.py" for its `main` (EasyR1's rule)."""
    path_text, _, name = spec.rpartition(":") if not spec.endswith(".py") else (spec, ":", "main")
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
    return fn, module


def _form_from_signature(spec: str, fn: Callable) -> str:
    """vlgrpo's form for two required positional parameters; for one, EasyR1's batch or sequential
    form by its annotation (list / dict) or name (reward_inputs / reward_input)."""
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(required) >= 2:
        return "vlgrpo"
    if len(required) == 1:
        param = required[0]
        annotation = param.annotation
        origin = typing.get_origin(annotation) or annotation
        text = annotation if isinstance(annotation, str) else getattr(origin, "__name__", "")
        if origin is list or text.lower().startswith(("list", "sequence")) or param.name == "reward_inputs":
            return "batch"
        if origin in (dict, Mapping) or text.lower().startswith(("dict", "mapping")) or param.name == "reward_input":
            return "sequential"
    raise RewardContractError(
        f"cannot tell the form of reward function {spec} from its signature {inspect.signature(fn)}; declare "
        f'REWARD_TYPE = "sequential" or "batch" in its file, or set worker.reward.reward_type.\n{CONTRACT}'
    )


def _bind_kwargs(spec: str, fn: Callable, kwargs: Mapping) -> Callable:
    """fn with worker.reward.reward_function_kwargs bound (EasyR1: functools.partial(fn, **kwargs)); a keyword
    the function does not take stops here, naming it and the ones it takes."""
    if not kwargs:
        return fn
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in params and not takes_any]
    if unknown:
        raise RewardContractError(
            f"worker.reward.reward_function_kwargs has {unknown}, which reward function {spec} does not take; "
            f"its parameters: {', '.join(params)}"
        )
    return functools.partial(fn, **kwargs)


def load_reward_function(
    spec: str, format_weight: float | None = None, reward_type: str | None = None, max_error_fraction: float = 1.0,
    kwargs: Mapping | None = None,
) -> RewardFunction:
    """Resolve config `worker.reward` into a RewardFunction.

    spec: "r1v", "math", or "path/to/file.py:function" in any of the FORMS. format_weight: None keeps
    the function's own default; a number is passed as `format_weight` (the function must then accept
    that keyword). reward_type: a key of FORMS, or None to read the file's REWARD_TYPE, else the signature.
    kwargs: worker.reward.reward_function_kwargs, bound to the function before its form is read.
    """
    if spec in BUILTIN_REWARDS:
        fn, module = BUILTIN_REWARDS[spec], None
    else:
        fn, module = _load_user_function(spec)
    fn = _bind_kwargs(spec, fn, kwargs or {})
    declared = getattr(module, "REWARD_TYPE", None)
    if declared is not None and declared not in FORMS:
        raise RewardContractError(f"{spec}: REWARD_TYPE is {declared!r}; allowed: {', '.join(map(repr, FORMS))}")
    if module is None and reward_type not in (None, "vlgrpo"):
        raise RewardContractError(f"the built-in reward {spec!r} is of the 'vlgrpo' form, but worker.reward.reward_type is {reward_type!r}")
    if reward_type is not None and declared is not None and reward_type != declared:
        raise RewardContractError(
            f"worker.reward.reward_type is {reward_type!r} but {spec} declares REWARD_TYPE = {declared!r}; set one or make them agree"
        )
    if module is None:
        form, chosen_by = "vlgrpo", "built-in"
    elif reward_type is not None:
        form, chosen_by = reward_type, "worker.reward.reward_type"
    elif declared is not None:
        form, chosen_by = declared, "REWARD_TYPE in its file"
    else:
        form, chosen_by = _form_from_signature(spec, fn), "read from its signature"
    if format_weight is not None:
        if "format_weight" not in inspect.signature(fn).parameters:
            raise TypeError(f"reward function {spec!r} takes no format_weight, but the config sets it to {format_weight}")
        fn = functools.partial(fn, format_weight=format_weight)
    return RewardFunction(fn, form, spec, chosen_by, max_error_fraction)


def reward_file_digest(spec: str) -> str | None:
    """SHA-256 of the file of a "path/to/file.py:function" reward (None for a built-in or a missing
    file): recorded with the results made with it, so a later run can tell that the file changed."""
    path = Path(spec.rpartition(":")[0])
    if spec in BUILTIN_REWARDS or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def reward_from_config(cfg: dict, check_answers: list[str] | None = None) -> RewardFunction:
    """The configured reward function (cfg: the whole config), checked on these answers if given."""
    reward = cfg["worker"]["reward"]
    try:
        fn = load_reward_function(reward["reward_function"], reward["format_weight"], reward["reward_type"], reward["max_error_fraction"],
                                  reward["reward_function_kwargs"])
    except RewardContractError:
        raise
    except Exception as error:  # importing the user's file runs its code: whatever fails is in the file or the key
        raise RewardContractError(
            f"worker.reward.reward_function {reward['reward_function']!r}: {type(error).__name__}: {error}"
        ) from error
    if check_answers:
        fn.check(check_answers)
    return fn


def _as_reward(fn: Callable) -> RewardFunction:
    """A plain callable is taken to be in vlgrpo's form."""
    return fn if isinstance(fn, RewardFunction) else RewardFunction(fn, "vlgrpo", getattr(fn, "__name__", repr(fn)))


def _assemble(reward: RewardFunction, results: list, first_error: str | None) -> tuple[list[dict[str, float]], int]:
    n_failed = sum(r is None for r in results)
    if n_failed and (n_failed == len(results) or n_failed > reward.max_error_fraction * len(results)):
        raise RewardFailure(
            f"the reward function {reward.name} failed on {n_failed} of {len(results)} responses "
            f"(worker.reward.max_error_fraction={reward.max_error_fraction}; all failing always stops); "
            f"the first error:\n{first_error}"
        )
    if n_failed:
        log.warning("reward function %s failed on %d of %d responses (scored 0); first error:\n%s",
                    reward.name, n_failed, len(results), first_error)
    keys = dict.fromkeys(REWARD_KEYS)
    for r in results:
        keys.update(dict.fromkeys(r or ()))
    zeros = dict.fromkeys(keys, 0.0)
    return [r if r is not None else dict(zeros) for r in results], n_failed


def score_responses(
    fn: RewardFunction | Callable, responses: list[str], ground_truths: list[str], lengths: list[int] | None = None
) -> tuple[list[dict[str, float]], int]:
    """Score each response against its ground truth; a failing response scores 0 and is counted.

    Returns (scores, n_failed): one dict per response, all with the same keys. A call that raises
    or returns something other than a dict with the REWARD_KEYS scores 0.0 for every key; the first
    failure is logged once per call, with its traceback. When all responses fail, or more than
    fn.max_error_fraction of them, RewardFailure stops the run with the first traceback.
    lengths: response lengths in tokens (EasyR1's forms pass them on).
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    reward = _as_reward(fn)
    return _assemble(reward, *reward.grade(responses, ground_truths, lengths))


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


def _grade_in_worker(reward: RewardFunction, responses: list[str], ground_truths: list[str], lengths: list[int] | None):
    return reward.grade(responses, ground_truths, lengths)


class Grading:
    """score_responses running in the background; result() gives exactly what score_responses gives.

    A batch-form function gets the whole batch in one call, as EasyR1 calls it.
    """

    def __init__(self, fn: RewardFunction | Callable, responses: list[str], ground_truths: list[str],
                 workers: int | None = None, lengths: list[int] | None = None):
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        self.reward, self.responses, self.ground_truths = _as_reward(fn), responses, ground_truths
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        workers = default_workers() if workers is None else workers
        self.futures = None
        if workers >= 2 and len(responses) > 1 and _picklable(self.reward):
            size = len(responses) if self.reward.form == "batch" else -(-len(responses) // (2 * workers))  # contiguous chunks, in order
            pool = _pool(workers)
            self.futures = [
                pool.submit(_grade_in_worker, self.reward, responses[i : i + size], ground_truths[i : i + size],
                            None if self.lengths is None else self.lengths[i : i + size])
                for i in range(0, len(responses), size)
            ]

    def result(self) -> tuple[list[dict[str, float]], int]:
        if self.futures is None:
            return score_responses(self.reward, self.responses, self.ground_truths, self.lengths)
        results, first_error = [], None
        for future in self.futures:
            part, error = future.result()
            results += part
            first_error = first_error or error
        return _assemble(self.reward, results, first_error)
