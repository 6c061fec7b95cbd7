"""When `phasescope serve` re-executes itself with tcmalloc preloaded, and with what LD_PRELOAD."""

from collections.abc import Callable

import pytest

from phasescope.cli.serve import tcmalloc_preload
from phasescope.environment import TCMALLOC_PRELOADED


def installed(name: str) -> str | None:
    return {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}.get(name)


def nothing(name: str) -> None:
    return None


def test_a_cpu_build_with_tcmalloc_installed_preloads_it_before_what_was_there() -> None:
    assert tcmalloc_preload({}, True, installed) == "libtcmalloc_minimal.so.4"
    assert tcmalloc_preload({"LD_PRELOAD": "/opt/x.so"}, True, installed) == "libtcmalloc_minimal.so.4:/opt/x.so"


@pytest.mark.parametrize(
    ("environ", "cpu_build", "find"),
    [
        ({}, False, installed),  # a CUDA build: vLLM's own choices stand
        ({}, True, nothing),  # not installed: serve as is
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, True, installed),  # the operator preloaded one already
        ({TCMALLOC_PRELOADED: "libtcmalloc_minimal.so.4"}, True, installed),  # the re-executed server: never again
    ],
)
def test_nothing_is_preloaded_when_it_is_not_a_cpu_build_not_installed_or_already_done(
    environ: dict[str, str], cpu_build: bool, find: Callable[[str], str | None]
) -> None:
    assert tcmalloc_preload(environ, cpu_build, find) is None
