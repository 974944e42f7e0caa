"""The golden vectors of span pooling (tests/data/golden_span_pool) are what
make_span_pool_golden.py writes, and its float64 model pools by SPEC.md "Span pooling"."""

import random

import make_span_pool_golden
from golden import SPAN_POOL_DIR, SPAN_POOL_NAMES
from momentum64 import span_pool


def test_the_files_are_the_generators_output(tmp_path):
    make_span_pool_golden.OUT_DIR = tmp_path
    for name in make_span_pool_golden.CASES:
        make_span_pool_golden.write(tmp_path, name)
    assert sorted(make_span_pool_golden.CASES) == SPAN_POOL_NAMES
    for name in SPAN_POOL_NAMES:
        for kind in ("trace", "decisions"):
            file = f"{name}.{kind}.jsonl"
            assert (tmp_path / file).read_text() == (SPAN_POOL_DIR / file).read_text(), file


def test_span_pool_is_by_position_not_by_index():
    # Indices 2 and 3 are neighbours, their positions 8 apart.
    assert span_pool([1.0, 0.0, 0.0, 5.0, 0.0], [0, 1, 2, 10, 11], 3) == [1.0, 1.0, 0.0, 5.0, 5.0]
    assert span_pool([1.0, 0.0, 2.0], [0, 1, 2], 1) == [1.0, 0.0, 2.0]


def test_span_pool_is_the_window_max_on_random_rows():
    rng = random.Random(4)
    for k in (3, 7, 255):
        positions = sorted(rng.sample(range(400), 60))
        row = [rng.random() for _ in positions]
        half = (k - 1) // 2
        pooled = span_pool(row, positions, k)
        for i, p in enumerate(positions):
            window = [v for v, q in zip(row, positions) if p - half <= q <= p + half]
            assert pooled[i] == max(window) >= row[i]
