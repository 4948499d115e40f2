"""Every shipped scenario runs and reproduces its golden figures."""
import json

import pytest

from tests.helpers import GOLDEN, compute, scenario_files

FILES = scenario_files()


def test_every_scenario_has_a_golden():
    missing = [p.stem for p in FILES if not (GOLDEN / f"{p.stem}.json").exists()]
    assert not missing, f"run python -m tests.update_goldens for {missing}"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario_matches_golden(path):
    expected = json.loads((GOLDEN / f"{path.stem}.json").read_text())
    assert compute(path) == expected
