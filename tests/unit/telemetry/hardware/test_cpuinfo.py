"""/proc/cpuinfo, parsed once for the probe, the engine's device name, the bench's machine and the dtype check."""

import pytest

from phasescope.telemetry.hardware import probe

# Two cores with two SMT threads each, on one package (an x86 machine's /proc/cpuinfo, trimmed).
CPUINFO = "\n".join(
    f"processor\t: {cpu}\nmodel name\t: Example CPU @ 2.00GHz\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\n"
    f"flags\t\t: fpu sse2 avx2 avx512f amx_tile\n"
    for cpu in range(4)
)


@pytest.fixture
def cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    records = probe.parse_cpuinfo(CPUINFO)
    monkeypatch.setattr(probe, "_cpuinfo", lambda: records)


def test_one_record_per_logical_cpu() -> None:
    records = probe.parse_cpuinfo(CPUINFO)
    assert [record["processor"] for record in records] == ["0", "1", "2", "3"]
    assert records[3]["core id"] == "1"


@pytest.mark.usefixtures("cpuinfo")
def test_name_flags_and_physical_cores() -> None:
    assert probe.cpu_name() == "Example CPU @ 2.00GHz"
    assert {"avx2", "amx_tile"} <= probe.cpu_flags()
    # CPUs 0 and 2 are SMT siblings of core 0: they count once.
    assert probe.physical_cores({0, 2}) == 1
    assert probe.physical_cores({0, 1, 2, 3}) == 2


def test_without_a_cpuinfo_the_platform_names_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_cpuinfo", tuple)
    assert probe.cpu_name()
    assert probe.cpu_flags() == frozenset()
    assert probe.physical_cores({0, 1}) == 2


def test_the_file_is_read_once() -> None:
    assert probe._cpuinfo() is probe._cpuinfo()
