"""eval/kvcache_eval/bootstrap.py: the paired bootstrap intervals of docs/EVALUATION.md."""

import random
import sys

import pytest

np = pytest.importorskip("numpy", reason="numpy is not installed (Debian: python3-numpy)")

from daemon import REPO_ROOT  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "eval"))

from kvcache_eval.bootstrap import paired_difference  # noqa: E402


def test_the_estimate_is_the_mean_paired_difference():
    treated, control = [1, 1, 0, 1, 0, 1], [0, 1, 0, 0, 0, 1]
    interval = paired_difference(treated, control)
    assert interval.estimate == pytest.approx(2 / 6)
    assert interval.low <= interval.estimate <= interval.high
    assert interval.samples == 6 and interval.resamples == 2000 and interval.level == 0.95


def test_identical_outcomes_give_a_zero_interval_and_a_constant_shift_its_value():
    control = [random.Random(1).random() for _ in range(50)]
    same = paired_difference(control, control)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    assert not same.excludes_zero
    shifted = paired_difference([x + 0.25 for x in control], control)
    assert shifted.low == pytest.approx(0.25) and shifted.high == pytest.approx(0.25)
    assert shifted.excludes_zero


def test_a_fixed_seed_gives_the_same_interval():
    rng = random.Random(2)
    treated = [rng.random() < 0.6 for _ in range(80)]
    control = [rng.random() < 0.4 for _ in range(80)]
    first = paired_difference(treated, control, seed=7)
    assert paired_difference(treated, control, seed=7) == first
    assert paired_difference(treated, control, seed=8) != first


def test_the_percentiles_are_the_stated_order_statistics():
    # The same draws by hand: R resampled means, sorted; the floor(aR)-th and the
    # (ceil((1-a)R)-1)-th.
    rng = random.Random(3)
    treated = [rng.random() for _ in range(30)]
    control = [rng.random() for _ in range(30)]
    diff = np.asarray(treated) - np.asarray(control)
    draws = np.random.default_rng(11).integers(0, 30, size=(400, 30))
    means = sorted(float(diff[row].mean()) for row in draws)
    interval = paired_difference(treated, control, resamples=400, seed=11, level=0.9)
    assert interval.low == pytest.approx(means[20]) and interval.high == pytest.approx(means[379])


def test_pairing_cancels_what_the_samples_share():
    # Hard and easy samples: the treated configuration is right on every sample the
    # control is, and on 10 more out of 200. An unpaired comparison would be wide; the
    # paired one sees only the 10 discordant samples.
    rng = random.Random(4)
    control = [rng.random() < 0.5 for _ in range(200)]
    treated = list(control)
    flipped = [i for i, c in enumerate(control) if not c][:10]
    for i in flipped:
        treated[i] = True
    interval = paired_difference(treated, control)
    assert interval.excludes_zero and interval.low > 0.01
    assert interval.high - interval.low < 0.07


def test_the_interval_covers_the_true_difference_about_as_often_as_stated():
    rng = np.random.default_rng(5)
    covered = 0
    trials = 300
    for trial in range(trials):
        control = rng.random(60) < 0.5
        treated = np.where(rng.random(60) < 0.3, rng.random(60) < 0.8, control)
        true = 0.3 * (0.8 - 0.5)
        interval = paired_difference(treated.tolist(), control.tolist(), resamples=500,
                                     seed=trial)
        covered += interval.low <= true <= interval.high
    assert 0.88 <= covered / trials <= 0.99, covered


def test_bad_input_is_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1, 0], [1])
    with pytest.raises(ValueError, match="no samples"):
        paired_difference([], [])
    with pytest.raises(ValueError, match="resamples"):
        paired_difference([1], [0], resamples=0)
    with pytest.raises(ValueError, match="level"):
        paired_difference([1], [0], level=1.0)
    with pytest.raises(ValueError, match="finite"):
        paired_difference([float("nan")], [0])
