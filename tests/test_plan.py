import pytest

from vlgrpo import config, plan

BASE = {"experiment": "t", "model": {"path": "m"}, "data": {"train": "a.parquet", "val": "b.parquet"}}


def cfg(**trainer):
    return config.validate({**BASE, "trainer": trainer})


def test_total_steps_are_max_steps_where_set_as_easyr1_counts_them():
    assert plan.total_steps(cfg(total_epochs=15, max_steps=195), 65) == 195
    assert plan.total_steps(cfg(total_epochs=2, max_steps=200), 65) == 200  # not min(130, 200): epochs repeat
    assert plan.total_steps(cfg(total_epochs=2, max_steps=None), 65) == 130
    with pytest.raises(ValueError, match="smaller than one rollout batch"):
        plan.total_steps(cfg(), 0)


def test_segments_end_every_save_freq_and_at_the_last_step():
    assert plan.segment_ends(cfg(save_freq=5), 12) == [5, 10, 12]
    assert plan.segment_ends(cfg(save_freq=5), 10) == [5, 10]
    assert plan.segment_ends(cfg(save_freq=50), 7) == [7]


def test_validation_steps():
    assert plan.validation_steps(cfg(save_freq=5, val_freq=10), 25) == [0, 10, 20, 25]
    assert plan.validation_steps(cfg(save_freq=5, val_freq=5, val_before_train=False), 10) == [5, 10]


def test_raising_max_steps_only_adds_segments():
    short = plan.segment_ends(cfg(save_freq=5, max_steps=20), 20)
    longer = plan.segment_ends(cfg(save_freq=5, max_steps=40), 40)
    assert longer[: len(short)] == short
