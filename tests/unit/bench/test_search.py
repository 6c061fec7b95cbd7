from collections.abc import Callable

import pytest

from phasescope.bench.search import BracketSearch


def drive(search: BracketSearch, passes: Callable[[float], bool]) -> list[float]:
    """Run the search against a synthetic curve; the loads it tried, in order."""
    tried = []
    while (load := search.next_load()) is not None:
        tried.append(load)
        search.record(load, passes(load))
    return tried


def test_rate_search_expands_then_bisects_to_a_bracket_around_the_limit() -> None:
    search = BracketSearch(start=1.0, max_points=10, tolerance=0.1)
    tried = drive(search, lambda rate: rate <= 3.3)
    # Up by 2× until 4 fails, then bisection until the bracket is within 10 % of its lower end.
    assert tried == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    result = search.result()
    assert result["status"] == "bracketed"
    assert result["converged"] is True
    assert result["answer"] == 3.25
    assert result["bracket"] == [3.25, 3.5]


def test_search_stops_at_max_points_with_the_bracket_it_has() -> None:
    search = BracketSearch(start=1.0, max_points=4)
    tried = drive(search, lambda rate: rate <= 3.3)
    assert len(tried) == 4
    result = search.result()
    assert result["bracket"] == [3.0, 4.0]
    assert result["converged"] is False


def test_search_when_even_the_first_point_fails_expands_downwards() -> None:
    search = BracketSearch(start=1.0, max_points=8)
    tried = drive(search, lambda rate: rate <= 0.3)
    assert tried[:3] == [1.0, 0.5, 0.25]
    low, high = search.bracket
    assert low is not None
    assert high is not None
    assert low <= 0.3 < high


def test_search_that_never_passes_reports_no_answer() -> None:
    search = BracketSearch(start=1.0, max_points=3)
    drive(search, lambda rate: False)
    result = search.result()
    assert result["status"] == "never_passed"
    assert result["answer"] is None
    assert result["bracket"] == [None, 0.25]


def test_search_that_never_fails_within_the_bound_reports_a_lower_bound() -> None:
    search = BracketSearch(start=1.0, max_points=5)
    tried = drive(search, lambda rate: True)
    assert tried == [1.0, 2.0, 4.0, 8.0, 16.0]
    result = search.result()
    assert result["status"] == "never_failed"
    assert result["answer"] == 16.0
    assert result["bracket"] == [16.0, None]


def test_concurrency_search_uses_whole_loads_and_stops_at_width_one() -> None:
    search = BracketSearch(start=1, max_points=20, integer=True)
    tried = drive(search, lambda concurrency: concurrency <= 11)
    assert all(load == int(load) for load in tried)
    assert search.result()["bracket"] == [11.0, 12.0]
    assert tried == [1, 2, 4, 8, 16, 12, 10, 11]


def test_concurrency_search_where_one_fails_has_no_answer() -> None:
    search = BracketSearch(start=4, max_points=10, integer=True)
    tried = drive(search, lambda concurrency: False)
    assert tried == [4, 2, 1]
    assert search.result()["status"] == "never_passed"


@pytest.mark.parametrize("limit", [0.7, 1.0, 2.9, 5.5, 13.0])
def test_search_brackets_any_limit_within_the_point_budget(limit: float) -> None:
    search = BracketSearch(start=1.0, max_points=12, tolerance=0.05)
    drive(search, lambda rate: rate <= limit)
    low, high = search.bracket
    assert low is not None
    assert high is not None
    assert low <= limit < high
    assert search.result()["converged"] is True


def test_search_rejects_settings_that_cannot_terminate() -> None:
    with pytest.raises(ValueError, match="factor > 1"):
        BracketSearch(start=1.0, max_points=5, factor=1.0)
