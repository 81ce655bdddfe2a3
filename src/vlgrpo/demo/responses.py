"""Synthetic responses for the demo's supervised warm-up: the language and the format, never the answer.

The triangle count in a response is drawn at random, independently of the image, so a model
trained on these texts answers at chance. The draw favours one triangle (COUNT_WEIGHTS), so that
the greedy answer after the warm-up is the constant "180" (the text-only policy: right on 1/4 of
the balanced rows) and not a near-tie between four equally likely answers that image features
could break either way. The reasoning never states a count: the answer is the one decision GRPO
must learn to read off the image. A fraction of the responses reasons in the format the
template asks for; the rest skip the reasoning and give the bare answer, which the format reward
rejects but the accuracy reward still grades. Keeping that fraction below 1/2 puts the malformed
answer on the greedy path: after the warm-up, greedy validation scores format 0 and chance
accuracy, while samples at T=1 are well formatted about that fraction of the time, which gives GRPO
a format signal to start from. What it learns after that (the format reliably, the answer from the
image) it learns from rewards alone, as Qwen2.5-VL-3B does on Geometry3K.

One writer per built-in format template (r1v: <think>...</think><answer>...</answer>; math:
<think>...</think> ... \\boxed{...}), whose grader of the same name accepts the well-formatted texts.
"""

from __future__ import annotations

import numpy as np

from vlgrpo.demo.task import MAX_TRIANGLES, answer_for

COUNT_WEIGHTS = (0.4, 0.2, 0.2, 0.2)  # of 1..MAX_TRIANGLES triangles; greedy log-prob margin log 2
# Phrasings start with a word other than the bare answer's "The", so no prefix of a well-formatted
# response looks like one of a bare answer (the model would mix them).
REASONING = (
    "Each triangle has 180 degrees.",
    "A triangle's angles sum to 180.",
    "Count the triangles, times 180.",
)


def _r1v(reasoning: str, answer: str, well_formatted: bool) -> str:
    tagged = f"<answer> {answer} </answer>"
    return f"<think> {reasoning} </think>{tagged}" if well_formatted else f"The answer is {tagged}"


def _math(reasoning: str, answer: str, well_formatted: bool) -> str:
    boxed = f"The answer is \\boxed{{{answer}}}."
    return f"<think> {reasoning} </think> {boxed}" if well_formatted else boxed


WRITERS = {"r1v": _r1v, "math": _math}


def warmup_response(rng: np.random.Generator, template: str, well_formatted_fraction: float) -> str:
    """One response with a random triangle count, well formatted with probability well_formatted_fraction.

    template: the format template's name (data.format_prompt), "r1v" or "math".
    """
    writer = WRITERS.get(template)
    if writer is None:
        raise ValueError(
            f"the demo warm-up writes responses for the format templates {', '.join(WRITERS)}, "
            f"not for data.format_prompt={template!r}"
        )
    k = int(rng.choice(np.arange(1, MAX_TRIANGLES + 1), p=COUNT_WEIGHTS))
    reasoning = REASONING[int(rng.integers(len(REASONING)))]
    return writer(reasoning, answer_for(k), bool(rng.random() < well_formatted_fraction))
