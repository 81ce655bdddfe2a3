"""Rewards: EasyR1's r1v and math graders on the real geometry3k answers, loading, failure handling."""

import logging
import re
from pathlib import Path

import pytest

from vlgrpo import rewards
from vlgrpo.rewards import (
    Grading, RewardContractError, RewardFailure, load_reward_function, math, r1v, reward_from_config, score_responses,
)

GEOMETRY3K = Path(__file__).resolve().parents[2] / "shared" / "data" / "geometry3k"


@pytest.fixture(scope="module")
def gold_answers() -> list[str]:
    if not (GEOMETRY3K / "train.parquet").is_file():
        pytest.skip(f"shared geometry3k data not found at {GEOMETRY3K}")
    import pyarrow.parquet as pq

    answers = []
    for split in ("train", "validation", "test"):
        answers += pq.read_table(GEOMETRY3K / f"{split}.parquet", columns=["answer"]).column("answer").to_pylist()
    return answers


def _wrong_number(answer: str) -> str | None:
    """The answer with its first digit changed (2 -> 3, 9 -> 0); None if it has no digit."""
    match = re.search(r"\d", answer)
    if match is None:
        return None
    digit = str((int(match.group()) + 1) % 10)
    return answer[: match.start()] + digit + answer[match.end() :]


def test_all_geometry3k_answers_are_read(gold_answers):
    assert len(gold_answers) == 3002
    assert all(isinstance(a, str) and a for a in gold_answers)


def test_every_gold_answer_in_r1v_format_scores_1(gold_answers):
    failed = [a for a in gold_answers if r1v(f"<think>reasoning</think>\n<answer>{a}</answer>", a)["overall"] != 1.0]
    assert failed == []


def test_every_gold_answer_in_math_format_scores_1(gold_answers):
    failed = [a for a in gold_answers if math(f"<think>reasoning</think> so \\boxed{{{a}}}.", a)["overall"] != 1.0]
    assert failed == []


def test_a_wrong_number_scores_accuracy_0(gold_answers):
    distinct = sorted(set(gold_answers))
    pairs = [(a, w) for a in distinct if (w := _wrong_number(a)) is not None]
    assert len(pairs) > 0.95 * len(distinct)  # nearly every geometry3k answer has a digit
    graded_right = [(a, w) for a, w in pairs if r1v(f"<think>t</think><answer>{w}</answer>", a)["accuracy"] != 0.0]
    assert graded_right == []
    scores = r1v("<think>t</think><answer>7</answer>", "8")
    assert scores == {"overall": 0.5, "format": 1.0, "accuracy": 0.0}
    assert math("<think>t</think>\\boxed{7}", "8") == {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0}


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>a</think><answer>3</answer>", (1.0, 1.0)),
        ("<think>a</think> \n\t <answer>3</answer>", (1.0, 1.0)),  # whitespace between the blocks
        ("<think>line\nline</think><answer> 3 </answer>", (1.0, 1.0)),  # DOTALL think, stripped answer
        ("Sure. <think>a</think><answer>3</answer>", (0.0, 1.0)),  # text before <think>
        ("<think>a</think><answer>3</answer> done", (0.0, 1.0)),  # text after </answer>
        ("<think>a</think> so <answer>3</answer>", (0.0, 1.0)),  # text between the blocks
        ("<think>a</think><answer>3", (0.0, 0.0)),  # missing </answer>: the whole response is graded
        ("<answer>3</answer>", (0.0, 1.0)),  # no think block
        # A newline inside the answer: format matches (DOTALL) but EasyR1's extraction regex is not
        # DOTALL, so the whole response is graded and fails.
        ("<think>a</think><answer>\n3\n</answer>", (1.0, 0.0)),
        ("3", (0.0, 1.0)),  # bare answer: the whole stripped response is graded
        ("<think>a</think><answer>3</answer><answer>4</answer>", (1.0, 1.0)),  # first answer counts
    ],
)
def test_r1v_format_and_extraction_edge_cases(response, expected):
    scores = r1v(response, "3")
    assert (scores["format"], scores["accuracy"]) == expected
    assert scores["overall"] == 0.5 * expected[0] + 0.5 * expected[1]


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>a</think> The answer is \\boxed{3}.", (1.0, 1.0)),
        ("< think >a< / think > \\boxed{3}", (1.0, 1.0)),  # spaces around < > / are removed first
        ("pre <think>a</think>\\boxed{3}", (0.0, 1.0)),  # text before <think>
        ("<think>a</think> \\boxed{4} then \\boxed{3}", (1.0, 1.0)),  # the last box counts
        ("<think>a</think> \\boxed{\\frac{1}{2}}", (1.0, 0.0)),  # brace-balanced content 1/2 != 3
        ("<think>a</think> 3", (0.0, 0.0)),  # no box
        ("<think>a</think> \\boxed{3", (0.0, 0.0)),  # unclosed box
    ],
)
def test_math_format_and_extraction_edge_cases(response, expected):
    scores = math(response, "3")
    assert (scores["format"], scores["accuracy"]) == expected
    assert scores["overall"] == pytest.approx(0.1 * expected[0] + 0.9 * expected[1])


def test_math_grades_brace_balanced_fraction():
    assert math("<think>a</think>\\boxed{\\frac{ 4 }{ 11 }}", "\\frac { 4 } { 11 }")["accuracy"] == 1.0


def test_format_weight_is_applied_and_checked():
    assert r1v("<think>a</think><answer>2</answer>", "3", format_weight=0.2)["overall"] == pytest.approx(0.2)
    assert math("<think>a</think>\\boxed{3}", "3", format_weight=0.0)["overall"] == 1.0
    with pytest.raises(ValueError, match="format_weight"):
        r1v("x", "3", format_weight=1.5)


def test_load_builtins_with_and_without_format_weight():
    assert load_reward_function("r1v", None).fn is r1v
    assert load_reward_function("math", None).fn is math
    assert load_reward_function("math", None).form == "vlgrpo"
    fn = load_reward_function("r1v", 0.1)
    assert fn("<think>a</think><answer>3</answer>", "4")["overall"] == pytest.approx(0.1)


USER_REWARD = '''
def length_reward(response, ground_truth, format_weight=0.25):
    accuracy = float(response.strip() == ground_truth)
    return {"overall": (1 - format_weight) * accuracy + format_weight, "format": 1.0,
            "accuracy": accuracy, "length": float(len(response))}

def no_weight(response, ground_truth):
    return {"overall": 1.0, "format": 1.0, "accuracy": 1.0}

VALUE = 3
'''


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_REWARD)
    return path


def test_load_user_function(user_file):
    fn = load_reward_function(f"{user_file}:length_reward", None)
    assert fn("42", "42") == {"overall": 1.0, "format": 1.0, "accuracy": 1.0, "length": 2.0}
    fn = load_reward_function(f"{user_file}:length_reward", 0.5)
    assert fn("41", "42")["overall"] == 0.5


def test_load_errors_name_the_problem(user_file, tmp_path):
    with pytest.raises(ValueError, match="neither a built-in .*r1v, math"):
        load_reward_function("r1V", None)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward_function(f"{tmp_path / 'missing.py'}:fn", None)
    with pytest.raises(AttributeError, match="no function 'nope'.*length_reward, no_weight"):
        load_reward_function(f"{user_file}:nope", None)
    with pytest.raises(AttributeError, match="no function 'VALUE'"):
        load_reward_function(f"{user_file}:VALUE", None)
    with pytest.raises(TypeError, match="takes no format_weight"):
        load_reward_function(f"{user_file}:no_weight", 0.3)


def test_score_responses_scores_a_raising_reward_0_and_counts_it(caplog):
    def flaky(response, ground_truth):
        if response == "boom":
            raise RuntimeError("grader exploded")
        return r1v(response, ground_truth)

    responses = ["<think>a</think><answer>3</answer>", "boom", "<think>a</think><answer>4</answer>", "boom"]
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        scores, n_failed = score_responses(flaky, responses, ["3"] * 4)
    assert n_failed == 2
    assert [s["overall"] for s in scores] == [1.0, 0.0, 0.5, 0.0]
    assert scores[1] == {"overall": 0.0, "format": 0.0, "accuracy": 0.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per call, not once per failure
    assert "2 of 4" in warnings[0].getMessage() and "RuntimeError: grader exploded" in warnings[0].getMessage()


def test_score_responses_treats_a_broken_result_as_a_failure():
    results = iter([{"format": 1}, None, {"overall": 1, "format": 0, "accuracy": True, "extra": 2}])  # no overall, no dict
    scores, n_failed = score_responses(lambda r, g: next(results), ["a", "b", "c"], ["x"] * 3)
    assert n_failed == 2
    zeros = {"overall": 0.0, "format": 0.0, "accuracy": 0.0, "extra": 0.0}
    assert scores == [zeros, zeros, {"overall": 1.0, "format": 0.0, "accuracy": 1.0, "extra": 2.0}]


def test_score_responses_keeps_user_keys_and_checks_lengths(user_file):
    fn = load_reward_function(f"{user_file}:length_reward", None)
    scores, n_failed = score_responses(fn, ["42", "7"], ["42", "42"])
    assert n_failed == 0 and [s["length"] for s in scores] == [2.0, 1.0]
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        score_responses(fn, ["42", "7"], ["42"])


def test_a_math_grader_crash_keeps_the_format_score(monkeypatch):
    def crash(given, ground_truth):
        raise RecursionError("sympy gave up")

    monkeypatch.setattr(rewards, "grade_answer", crash)
    assert math("<think>a</think> \\boxed{3}", "3") == {"overall": pytest.approx(0.1), "format": 1.0, "accuracy": 0.0}


# EasyR1's two forms (examples/reward_function/r1v.py is sequential, math.py batch), written for this test.
SEQUENTIAL_FILE = '''
import re
REWARD_TYPE = "sequential"

def compute_score(reward_input, format_weight=0.5):
    if not isinstance(reward_input, dict):
        raise ValueError("Please use reward_type=sequential")
    fmt = 1.0 if re.fullmatch(r"<think>.*?</think>\\s*<answer>.*?</answer>", reward_input["response"], re.DOTALL) else 0.0
    match = re.search(r"<answer>(.*?)</answer>", reward_input["response"])
    acc = 1.0 if match and match.group(1).strip() == reward_input["ground_truth"].strip() else 0.0
    return {"overall": (1 - format_weight) * acc + format_weight * fmt, "format": fmt, "accuracy": acc,
            "length": float(reward_input["response_length"])}
'''
BATCH_FILE = '''
REWARD_TYPE = "batch"

def compute_score(reward_inputs, format_weight=0.1):
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use reward_type=batch")
    scores = []
    for item in reward_inputs:
        acc = 1.0 if item["ground_truth"] in item["response"] else 0.0
        scores.append({"overall": (1 - format_weight) * acc + format_weight, "format": 1.0, "accuracy": acc,
                       "batch_size": float(len(reward_inputs)), "length": float(item["response_length"])})
    return scores
'''
# No REWARD_TYPE: the form is read from the signature.
UNDECLARED_FILE = '''
def seq(reward_input: dict, format_weight: float = 0.5) -> dict:
    return {"overall": 1.0, "format": 1.0, "accuracy": 1.0}

def bat(reward_inputs: list[dict]) -> list[dict]:
    return [{"overall": 0.5, "format": 1.0, "accuracy": 0.0} for _ in reward_inputs]

def pair(response, ground_truth):
    return {"overall": 0.25, "format": 0.0, "accuracy": 0.5}

def unclear(x, *, format_weight=0.5):
    return {"overall": 1.0, "format": 1.0, "accuracy": 1.0}

def wrong_keys(response, ground_truth):
    return {"score": 1.0}
'''


@pytest.fixture
def form_files(tmp_path) -> dict[str, Path]:
    files = {"sequential": SEQUENTIAL_FILE, "batch": BATCH_FILE, "undeclared": UNDECLARED_FILE}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    return {name: tmp_path / f"{name}.py" for name in files}


def test_easyr1_forms_are_called_as_declared(form_files):
    responses = ["<think>a</think><answer>3</answer>", "<think>a</think> so <answer>4</answer>", "3"]
    truths, lengths = ["3", "3", "3"], [11, 13, 1]

    sequential = load_reward_function(f"{form_files['sequential']}:compute_score", None)
    assert (sequential.form, sequential.chosen_by) == ("sequential", "REWARD_TYPE in its file")
    scores, failed = Grading(sequential, responses, truths, workers=0, lengths=lengths).result()
    assert failed == 0
    assert [(s["overall"], s["format"], s["accuracy"], s["length"]) for s in scores] == [
        (1.0, 1.0, 1.0, 11.0), (0.0, 0.0, 0.0, 13.0), (0.0, 0.0, 0.0, 1.0)]

    batch = load_reward_function(f"{form_files['batch']}:compute_score", 0.5)
    assert batch.form == "batch"
    scores, failed = score_responses(batch, responses, truths, lengths)
    assert failed == 0
    assert [(s["overall"], s["accuracy"], s["batch_size"], s["length"]) for s in scores] == [
        (1.0, 1.0, 3.0, 11.0), (0.5, 0.0, 3.0, 13.0), (1.0, 1.0, 3.0, 1.0)]  # one call for the whole batch
    with pytest.raises(ValueError, match="needs response lengths"):
        score_responses(batch, responses, truths)


def test_the_form_is_read_from_the_config_or_the_signature(form_files):
    path = form_files["undeclared"]
    forms = {name: load_reward_function(f"{path}:{name}", None) for name in ("seq", "bat", "pair")}
    assert {name: (f.form, f.chosen_by) for name, f in forms.items()} == {
        "seq": ("sequential", "read from its signature"), "bat": ("batch", "read from its signature"),
        "pair": ("vlgrpo", "read from its signature")}
    assert forms["bat"]("x", "y", 1) == {"overall": 0.5, "format": 1.0, "accuracy": 0.0}
    assert forms["pair"]("x", "y") == {"overall": 0.25, "format": 0.0, "accuracy": 0.5}
    with pytest.raises(RewardContractError, match=r"cannot tell the form .*unclear.*REWARD_TYPE"):
        load_reward_function(f"{path}:unclear", None)
    configured = load_reward_function(f"{path}:unclear", 0.3, reward_type="sequential")
    assert (configured.form, configured.chosen_by) == ("sequential", "worker.reward.reward_type")
    assert configured("x", "y", 1)["overall"] == 1.0
    with pytest.raises(RewardContractError, match="reward_type is 'batch' but .* declares REWARD_TYPE = 'sequential'"):
        load_reward_function(f"{form_files['sequential']}:compute_score", None, reward_type="batch")
    with pytest.raises(RewardContractError, match="built-in reward 'r1v' is of the 'vlgrpo' form"):
        load_reward_function("r1v", None, reward_type="batch")


def reward_cfg(spec: str, **overrides) -> dict:
    return {"worker": {"reward": {"reward_function": spec, "format_weight": None, "reward_type": None,
                                  "max_error_fraction": 1.0, "reward_function_kwargs": {}, **overrides}}}


def test_a_function_that_breaks_the_contract_stops_before_the_run(form_files):
    answers = ["3", "\\frac{1}{2}", "45"]
    reward_from_config(reward_cfg(f"{form_files['sequential']}:compute_score"), answers)  # keeps it: no error
    reward_from_config(reward_cfg(f"{form_files['batch']}:compute_score"), answers)
    assert reward_from_config(reward_cfg("math"), answers).check(answers) is None
    # An EasyR1 sequential function whose file declares the batch form, and one that returns other keys.
    liar = form_files["sequential"].parent / "liar.py"
    liar.write_text(SEQUENTIAL_FILE.replace('REWARD_TYPE = "sequential"', 'REWARD_TYPE = "batch"'))
    cases = [(f"{liar}:compute_score", {}, "batch", "ValueError: Please use reward_type=sequential"),
             (f"{form_files['undeclared']}:wrong_keys", {}, "vlgrpo", "lacks keys ['overall']")]
    for spec, overrides, form, cause in cases:
        with pytest.raises(RewardContractError) as error:
            reward_from_config(reward_cfg(spec, **overrides), answers)
        message = str(error.value)
        assert spec in message and f"called as the {form!r} form" in message and cause in message
        assert "compute_score(reward_inputs: list[dict]" in message and "fn(response: str, ground_truth: str" in message


def test_too_many_failures_stop_with_the_first_traceback():
    def flaky(response, ground_truth):
        if response.startswith("boom"):
            raise ZeroDivisionError(f"cannot grade {response}")
        return r1v(response, ground_truth)

    ok, bad = "<think>a</think><answer>3</answer>", "boom"
    lenient = load_reward_function("r1v")  # default fraction 1.0: only a step where all fail stops
    lenient = type(lenient)(flaky, "vlgrpo", "flaky.py:flaky")
    assert score_responses(lenient, [ok, bad + "1", bad + "2", ok], ["3"] * 4)[1] == 2
    with pytest.raises(RewardFailure) as error:
        score_responses(lenient, [bad + "1", bad + "2"], ["3"] * 2)
    message = str(error.value)
    assert "flaky.py:flaky failed on 2 of 2 responses" in message
    assert "Traceback (most recent call last)" in message and "ZeroDivisionError: cannot grade boom1" in message
    strict = type(lenient)(flaky, "vlgrpo", "flaky.py:flaky", max_error_fraction=0.25)
    assert score_responses(strict, [ok, bad, ok, ok], ["3"] * 4)[1] == 1  # 1 of 4 is not more than 25%
    with pytest.raises(RewardFailure, match="2 of 4 responses .*max_error_fraction=0.25"):
        score_responses(strict, [ok, bad, bad, ok], ["3"] * 4)


# EasyR1's examples/reward_function/dapo.py in outline: a batch function with three required keywords
# (reward_function_kwargs) whose results hold no `format`.
OVERLONG_FILE = """
REWARD_TYPE = "batch"


def compute_score(reward_inputs, max_response_length, overlong_buffer_length, overlong_penalty_factor):
    out = []
    for item in reward_inputs:
        accuracy = 1.0 if item["response"].strip().endswith(item["ground_truth"]) else -1.0
        expected = max_response_length - overlong_buffer_length
        n = item["response_length"]
        overlong = 0.0 if n <= expected else (expected - n) / overlong_buffer_length if n <= max_response_length else -1.0
        out.append({"overall": accuracy + overlong * overlong_penalty_factor, "accuracy": accuracy, "overlong": overlong})
    return out


def main(reward_inputs):
    return [{"overall": 2.0} for _ in reward_inputs]
"""


def test_reward_function_kwargs_are_bound_and_only_overall_is_required(tmp_path):
    path = tmp_path / "overlong.py"
    path.write_text(OVERLONG_FILE)
    kwargs = {"max_response_length": 10, "overlong_buffer_length": 4, "overlong_penalty_factor": 0.5}
    fn = reward_from_config(reward_cfg(f"{path}:compute_score", reward_function_kwargs=kwargs), ["3", "4"])
    assert fn.form == "batch"
    scores, failed = score_responses(fn, ["x 3", "x 4", "x 5"], ["3", "4", "4"], lengths=[6, 8, 12])
    # lengths 6 <= 10 - 4: no penalty; 8: (6 - 8) / 4 = -0.5; 12 > 10: -1
    assert failed == 0
    assert scores == [{"overall": 1.0, "accuracy": 1.0, "overlong": 0.0},
                      {"overall": 1.0 - 0.25, "accuracy": 1.0, "overlong": -0.5},
                      {"overall": -1.0 - 0.5, "accuracy": -1.0, "overlong": -1.0}]
    with pytest.raises(RewardContractError, match=r"\['overlong_factor'\], which reward function .* does not take"):
        reward_from_config(reward_cfg(f"{path}:compute_score", reward_function_kwargs={"overlong_factor": 1.0}), ["3"])
    with pytest.raises(RewardContractError, match="missing 1 required positional argument"):  # a keyword left out
        reward_from_config(reward_cfg(f"{path}:compute_score", reward_function_kwargs={k: v for k, v in kwargs.items() if k != "max_response_length"}), ["3"])


def test_a_file_alone_means_its_main_function(tmp_path):
    path = tmp_path / "overlong.py"
    path.write_text(OVERLONG_FILE)
    fn = reward_from_config(reward_cfg(str(path)), ["3"])
    assert fn.name == str(path) and fn("x", "3", 1) == {"overall": 2.0}
