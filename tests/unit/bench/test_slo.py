import pytest

from phasescope.bench.slo import SloError, goodput, meets, parse_slo
from phasescope.bench.workload import RequestRecord


def record(sent: float, token_times: list[float], error: str = "") -> RequestRecord:
    return RequestRecord(0, sent, token_times, len(token_times), prompt_tokens=10, error=error)


# TTFT, TPOT, E2E in ms: (100, 100, 300), (500, 50, 650), (100, 300, 700), one token at 200 ms, and a failure.
FAST = record(0.0, [0.1, 0.2, 0.3])
SLOW_START = record(0.0, [0.5, 0.55, 0.6, 0.65])
SLOW_DECODE = record(0.0, [0.1, 0.4, 0.7])
ONE_TOKEN = record(0.0, [0.2])
FAILED = record(0.0, [], error="UNAVAILABLE")
RECORDS = [FAST, SLOW_START, SLOW_DECODE, ONE_TOKEN, FAILED]


def test_parse_slo_takes_any_subset_of_the_objectives() -> None:
    assert parse_slo("ttft_ms=2000,tpot_ms=150") == {"ttft_ms": 2000.0, "tpot_ms": 150.0}
    assert parse_slo("e2e_ms=1e4") == {"e2e_ms": 10000.0}
    assert parse_slo(" ttft_ms = 1.5 , e2e_ms=3 ,tpot_ms=2") == {"ttft_ms": 1.5, "e2e_ms": 3.0, "tpot_ms": 2.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty objective"),
        ("ttft_ms=2000,", "empty objective"),
        ("ttft_ms", "has no '='"),
        ("ttfb_ms=2000", "unknown objective 'ttfb_ms'"),
        ("ttft=2000", "unknown objective 'ttft'"),
        ("ttft_ms=fast", "is not a number"),
        ("ttft_ms=-1", "positive"),
        ("ttft_ms=0", "positive"),
        ("ttft_ms=inf", "finite"),
        ("ttft_ms=nan", "positive"),
        ("ttft_ms=1,ttft_ms=2", "given twice"),
    ],
)
def test_parse_slo_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(SloError, match=message):
        parse_slo(text)


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ({"ttft_ms": 200}, [FAST, SLOW_DECODE, ONE_TOKEN]),
        ({"tpot_ms": 120}, [FAST, SLOW_START, ONE_TOKEN]),  # one token: no TPOT, counted as 0 (vLLM)
        ({"e2e_ms": 650}, [FAST, SLOW_START, ONE_TOKEN]),
        ({"ttft_ms": 200, "tpot_ms": 120}, [FAST, ONE_TOKEN]),
        ({"ttft_ms": 600, "e2e_ms": 680}, [FAST, SLOW_START, ONE_TOKEN]),
        ({"tpot_ms": 500, "e2e_ms": 700}, [FAST, SLOW_START, SLOW_DECODE, ONE_TOKEN]),
        ({"ttft_ms": 100, "tpot_ms": 100, "e2e_ms": 300}, [FAST]),  # bounds are inclusive
    ],
)
def test_goodput_counts_requests_meeting_every_objective(slo: dict[str, float], good: list[RequestRecord]) -> None:
    assert [r for r in RECORDS if meets(r, slo)] == good
    figures = goodput(RECORDS, duration=2.0, slo=slo)
    assert figures["slo_met"] == len(good)
    # The failed request counts in the denominator and is never good.
    assert figures["goodput_ratio"] == pytest.approx(len(good) / 5)
    assert figures["request_goodput"] == pytest.approx(len(good) / 2.0)
    assert figures["output_goodput"] == pytest.approx(sum(r.output_tokens for r in good) / 2.0)
    assert set(figures) >= {f"slo_{name}_met_ratio" for name in slo}


def test_goodput_reports_each_objective_on_its_own() -> None:
    figures = goodput(RECORDS, duration=1.0, slo={"ttft_ms": 200, "tpot_ms": 120})
    assert figures["slo_ttft_ms_met_ratio"] == pytest.approx(3 / 5)
    assert figures["slo_tpot_ms_met_ratio"] == pytest.approx(3 / 5)
    assert figures["goodput_ratio"] == pytest.approx(2 / 5)


def test_no_objectives_means_no_goodput_figures() -> None:
    assert goodput(RECORDS, duration=1.0, slo={}) == {}
