"""Logs every process's slow garbage collections: put this folder on PYTHONPATH of the process to watch.

Each Python process that starts with it (the bench, the server, vLLM's engine core and worker) appends
to /tmp/gcprobe/gc-PID.log one line per full collection, or per collection over 5 ms: when, the
process's name, the generation, how long, what it freed, how many objects were frozen and tracked.
Calls to gc.freeze and gc.unfreeze are logged too, with their caller.
"""

import gc
import os
import time
import traceback
from pathlib import Path

LOG_DIR = Path("/tmp/gcprobe")
LOG_DIR.mkdir(exist_ok=True)
_started = [0.0]


def _write(line: str) -> None:
    with (LOG_DIR / f"gc-{os.getpid()}.log").open("a") as log:
        log.write(line + "\n")


def _on_collection(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took_ms = (time.perf_counter() - _started[0]) * 1e3
    if info["generation"] < 2 and took_ms <= 5:
        return
    try:
        name = Path("/proc/self/comm").read_text().strip()
    except OSError:
        name = "?"
    _write(
        f"{time.time():.3f} {name} gen{info['generation']} {took_ms:.2f}ms collected={info['collected']} "
        f"frozen={gc.get_freeze_count()} tracked={len(gc.get_objects())}"
    )


def _logged(name: str) -> None:
    original = getattr(gc, name)

    def call() -> None:
        original()
        caller = traceback.extract_stack(limit=2)[0]
        frozen = gc.get_freeze_count()
        _write(f"{time.time():.3f} CALL {name} -> frozen={frozen} from {caller.filename}:{caller.lineno}")

    setattr(gc, name, call)


gc.callbacks.append(_on_collection)
_logged("freeze")
_logged("unfreeze")
