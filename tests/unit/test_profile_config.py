"""`[profile]`: the window and the ranks are validated naming the field, and round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel.job import ConfigError, ProfileConfig, from_dict, loads
from trainer.profiling import profiles_rank, trace_path

pytestmark = pytest.mark.unit

MINIMAL = '[data]\nsource = "python-stdlib"\n[train]\nsteps = 10\n'


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ("steps = [3, 2]", "profile.steps must be [first, last]"),
        ("steps = [2, 2]", "profile.steps must be [first, last]"),
        ("steps = [0, 2]", "profile.steps must be [first, last]"),
        ("steps = [5, 11]", "train.steps 10"),
        ("steps = [1, 2, 3]", "profile.steps must be [first, last]"),
        ('steps = ["a", 2]', "profile.steps[0]"),
        ("ranks = [-1]", "profile.ranks must be global ranks"),
        (f"ranks = [{2**31}]", "profile.ranks must be global ranks"),
        ('ranks = "some"', "profile.ranks"),
        ("rank = [0]", "profile.rank"),
    ],
)
def test_bad_profile_names_the_field(profile, message):
    with pytest.raises(ConfigError) as err:
        loads(MINIMAL + "[profile]\n" + profile + "\n")
    assert message in str(err.value)


def test_profile_parses_and_round_trips():
    assert loads(MINIMAL).profile == ProfileConfig(steps=(), ranks=(0,))
    cfg = loads(MINIMAL + '[profile]\nsteps = [2, 10]\nranks = "all"\n')
    assert cfg.profile == ProfileConfig(steps=(2, 10), ranks="all")
    assert from_dict(cfg.to_dict()) == cfg
    cfg = loads(MINIMAL, ["profile.steps=[1, 3]", "profile.ranks=[0, 5]"])
    assert cfg.profile == ProfileConfig(steps=(1, 3), ranks=(0, 5))


def test_which_ranks_profile_and_where():
    assert not profiles_rank(ProfileConfig(), 0)  # no window: nobody
    assert profiles_rank(ProfileConfig(steps=(1, 2)), 0)
    assert not profiles_rank(ProfileConfig(steps=(1, 2)), 1)
    assert profiles_rank(ProfileConfig(steps=(1, 2), ranks="all"), 7)
    assert trace_path(Path("/out"), 3, 2, 4) == Path("/out/profile/rank_3/steps_2-4.pt.trace.json")

