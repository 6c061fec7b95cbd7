"""The seeded workload: what each request sends, and the record of what came back for it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORDS = [
    "lighthouse",
    "harbour",
    "orbit",
    "lantern",
    "meadow",
    "circuit",
    "glacier",
    "violin",
    "compass",
    "ember",
    "quartz",
    "saddle",
    "canyon",
    "ribbon",
    "falcon",
    "walnut",
    "prism",
    "tundra",
    "anchor",
    "velvet",
]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    max_tokens: int


@dataclass
class RequestRecord:
    index: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None


def workload(seed: int, count: int, max_tokens: int) -> list[BenchRequest]:
    """Seeded requests: a varied preamble (so prefix caching cannot reuse it) and a task."""
    rng = random.Random(seed)
    tasks = ("Tell a story about", "Describe in detail", "Write a poem about", "Explain how to build")
    requests = []
    for index in range(count):
        preamble = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        requests.append(
            BenchRequest(index, f"[{index}] {preamble}. {rng.choice(tasks)} a {rng.choice(WORDS)}.", max_tokens)
        )
    return requests
