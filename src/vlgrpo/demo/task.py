"""The demo's synthetic geometry task: count the triangles, answer the sum of their angles.

A square figure of `image_size` px is split into four quadrants; k of them (1 <= k <= 4, chosen at
random) hold one filled triangle each. The question asks for the sum of the interior angles of all
triangles, so the answer, 180*k, can only be read off the image. k is balanced within each split,
so a text-only policy's best constant answer is right on about 1/4 of the rows.

Rows have the Geometry3K columns (`images` as a list of {bytes: PNG, path}, `problem` starting with
"<image>", `answer`), so every later stage treats this data exactly like the real thing.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from vlgrpo import atomic

SPLITS = ("train", "validation", "test")
# Independent random streams per split (and one for the model's warm-up), so changing one split's
# size leaves the others' rows unchanged.
STREAMS = {"train": 0, "validation": 1, "test": 2, "warmup": 3}
MAX_TRIANGLES = 4
DEGREES_PER_TRIANGLE = 180

QUESTIONS = (
    "<image>Find the sum of the interior angles of all triangles in the figure.",
    "<image>What is the total of the interior angles of the triangles shown?",
    "<image>Add up the interior angles of every triangle in the diagram. Find the total.",
    "<image>Find the total measure of all angles of the triangles in the figure.",
)

SCHEMA = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
    ],
    # The Hugging Face `datasets` features of hiyouga/geometry3k, so `load_dataset("parquet")`
    # decodes `images` as a sequence of PIL images there too.
    metadata={
        "huggingface": json.dumps(
            {
                "info": {
                    "features": {
                        "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
                        "problem": {"dtype": "string", "_type": "Value"},
                        "answer": {"dtype": "string", "_type": "Value"},
                    }
                }
            }
        )
    },
)

_MIN_AREA_FRACTION = 0.15  # of the quadrant, so a triangle covers several vision patches
_MIN_ANGLE_DEG = 20.0  # no slivers that vanish at 14 px patches


def answer_for(n_triangles: int) -> str:
    """The exact answer string for a figure with `n_triangles` triangles ("180", "360", ...)."""
    return str(DEGREES_PER_TRIANGLE * n_triangles)


def _triangle_ok(points: np.ndarray, quadrant: float) -> bool:
    """points: (3, 2). True if the triangle is big and not a sliver."""
    (ax, ay), (bx, by), (cx, cy) = points
    area = abs((bx - ax) * (cy - ay) - (cx - ax) * (by - ay)) / 2
    if area < _MIN_AREA_FRACTION * quadrant**2:
        return False
    for i in range(3):
        u, v = points[(i + 1) % 3] - points[i], points[(i + 2) % 3] - points[i]
        cos = float(u @ v) / (np.linalg.norm(u) * np.linalg.norm(v))
        if math.degrees(math.acos(max(-1.0, min(1.0, cos)))) < _MIN_ANGLE_DEG:
            return False
    return True


def random_triangle(rng: np.random.Generator, x0: float, y0: float, quadrant: float) -> np.ndarray:
    """Vertices (3, 2) of a random non-degenerate triangle inside the quadrant at (x0, y0)."""
    margin = quadrant * 0.1
    while True:
        points = rng.uniform(margin, quadrant - margin, size=(3, 2)) + (x0, y0)
        if _triangle_ok(points, quadrant):
            return points


def render_figure(rng: np.random.Generator, quadrants: list[int], image_size: int) -> Image.Image:
    """An RGB image_size x image_size figure with one random triangle in each listed quadrant (0-3)."""
    image = Image.new("RGB", (image_size, image_size), "white")
    draw = ImageDraw.Draw(image)
    half = image_size / 2
    for q in quadrants:
        points = random_triangle(rng, (q % 2) * half, (q // 2) * half, half)
        fill = tuple(int(c) for c in rng.integers(120, 230, size=3))
        outline = tuple(int(c) for c in rng.integers(0, 90, size=3))
        draw.polygon([tuple(p) for p in points.round().tolist()], fill=fill, outline=outline, width=2)
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def make_rows(seed: int, stream: str, n: int, image_size: int) -> list[dict]:
    """`n` rows of the task from the random stream `stream` (a split name or "warmup").

    Each row: {"images": [{"bytes": PNG, "path": str}], "problem": str, "answer": str}. Triangle
    counts are balanced (each of 1..4 appears n/4 times, up to rounding) and shuffled.
    """
    if n < 1:
        raise ValueError(f"need at least one row for {stream!r}, got n={n}")
    rng = np.random.default_rng([seed, STREAMS[stream]])
    counts = rng.permutation(np.arange(n) % MAX_TRIANGLES + 1)
    rows = []
    for i, k in enumerate(counts.tolist()):
        quadrants = sorted(rng.choice(MAX_TRIANGLES, size=k, replace=False).tolist())
        image = render_figure(rng, quadrants, image_size)
        rows.append(
            {
                "images": [{"bytes": png_bytes(image), "path": f"{stream}_{i:05d}.png"}],
                "problem": QUESTIONS[int(rng.integers(len(QUESTIONS)))],
                "answer": answer_for(k),
            }
        )
    return rows


def best_constant_accuracy(answers: list[str]) -> tuple[str, float]:
    """(answer, accuracy) of the single answer that is right most often: a text-only ceiling."""
    if not answers:
        raise ValueError("no answers")
    answer, hits = Counter(answers).most_common(1)[0]
    return answer, hits / len(answers)


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write rows with SCHEMA to `path` atomically (temporary name, then rename)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    with atomic.replacing(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def make_dataset(cfg: dict, out_dir: Path) -> dict:
    """Write out_dir/{train,validation,test}.parquet for cfg["demo"] (seeded by cfg["seed"]).

    Returns stats: rows and answer counts per split, the test split's best constant answer and its
    accuracy (the evidence that answers depend on the image), image size and seconds taken.
    """
    demo = cfg["demo"]
    if demo["task"] != "count_triangles":
        raise ValueError(f"unknown demo task {demo['task']!r}; known: count_triangles")
    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {"train": demo["n_train"], "validation": demo["n_val"], "test": demo["n_test"]}
    stats: dict = {"task": demo["task"], "seed": cfg["seed"], "image_size": demo["image_size"], "splits": {}}
    answers: dict[str, list[str]] = {}
    for split in SPLITS:
        rows = make_rows(cfg["seed"], split, sizes[split], demo["image_size"])
        write_parquet(rows, out_dir / f"{split}.parquet")
        answers[split] = [r["answer"] for r in rows]
        stats["splits"][split] = {"rows": len(rows), "answers": dict(sorted(Counter(answers[split]).items()))}
    answer, accuracy = best_constant_accuracy(answers["test"])
    stats["best_constant_answer"] = {"split": "test", "answer": answer, "accuracy": accuracy}
    stats["seconds"] = round(time.perf_counter() - start, 3)
    return stats
