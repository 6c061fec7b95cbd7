"""The seeded workload: what each request sends, and the record of what came back for it.

A workload is fully determined by its `WorkloadSpec` and a seed: the same seed gives the
same prompts and lengths, byte for byte, so a run is reproduced from its results file.

Prompts are built from `WORDS`, each one token in the byte-level BPE vocabularies of
common small models (checked on the default model's tokenizer: N words are N tokens), so
`--prompt-tokens 100` means about 100 prompt tokens; the exact count of every request is
the server's (`prompt_tokens` in its record). Random words make every prompt differ from
its first block on, so the prefix cache cannot flatter TTFT — except for the shared
prefix (`--shared-prefix-tokens`), the same words at the start of every prompt of the run,
there to measure exactly that.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

WORDS = [
    "sun", "sea", "sky", "red", "blue", "green", "cat", "dog", "tree", "stone", "river", "hill", "road", "rain",
    "wind", "fire", "snow", "gold", "iron", "wood", "bird", "fish", "star", "moon", "light", "night", "day", "house",
    "door", "book", "song", "ship", "wall", "field", "city", "king", "bread", "milk", "salt", "glass", "paper",
    "water",
]  # fmt: skip


class WorkloadError(ValueError):
    """A distribution spec or a prompt file the workload cannot use."""


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts: `fixed` (a), `uniform` (a to b inclusive) or `normal` (mean a, std b, rounded, at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """`64`, `fixed:64`, `uniform:16:128` or `normal:64:16`."""
        parts = text.strip().split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                value = float(parts[-1])
                if value < 1 or value != int(value):
                    raise WorkloadError(f"a fixed length must be a whole number ≥ 1, got {parts[-1]!r}")
                return cls("fixed", value)
            if parts[0] == "uniform" and len(parts) == 3:
                low, high = int(parts[1]), int(parts[2])
                if not 1 <= low <= high:
                    raise WorkloadError(f"uniform needs 1 ≤ low ≤ high, got {low}:{high}")
                return cls("uniform", low, high)
            if parts[0] == "normal" and len(parts) == 3:
                mean, std = float(parts[1]), float(parts[2])
                if mean < 1 or std < 0:
                    raise WorkloadError(f"normal needs mean ≥ 1 and std ≥ 0, got {mean:g}:{std:g}")
                return cls("normal", mean, std)
        except ValueError as exc:
            if isinstance(exc, WorkloadError):
                raise
            raise WorkloadError(f"not a number in {text!r}") from exc
        raise WorkloadError(f"{text!r} is not N, fixed:N, uniform:LOW:HIGH or normal:MEAN:STD")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        # Clipped to [1, mean + 4 std]: a long tail would only measure the context limit.
        return max(1, min(round(rng.gauss(self.a, self.b)), round(self.a + 4 * self.b)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class DatasetPrompt:
    prompt: str
    max_tokens: int | None


def read_dataset(path: Path) -> list[DatasetPrompt]:
    """A JSONL file of `{"prompt": "...", "max_tokens": N}` (max_tokens optional), one request per line."""
    prompts = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise WorkloadError(f'{path}:{number}: each line needs {{"prompt": "...", "max_tokens": N}}')
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):  # fmt: skip
            raise WorkloadError(f"{path}:{number}: max_tokens must be a whole number ≥ 1")
        prompts.append(DatasetPrompt(item["prompt"], max_tokens))
    if not prompts:
        raise WorkloadError(f"{path}: no prompts")
    return prompts


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class WorkloadSpec:
    """What every request of a run looks like; with a seed, it determines the requests exactly."""

    prompt_tokens: LengthDistribution
    """Tokens of each prompt's own part (after the shared prefix); unused with a dataset."""
    output_tokens: LengthDistribution
    """Output tokens per request (`ignore_eos`): a dataset line's max_tokens wins when it has one."""
    shared_prefix_tokens: int = 0
    """The same words at the start of every prompt of the run (the same for every point and repeat)."""
    dataset: tuple[DatasetPrompt, ...] = ()
    """Prompts from the user's JSONL file, drawn in a seeded order, instead of generated words."""
    base_seed: int = 0
    """The run's `--seed`: the shared prefix depends on it only, so every point shares it."""
    adapters: int = 0
    """LoRA adapters the requests spread over (`adapter_name`), by `adapter_mix`; 0: every request on the base
    model."""
    adapter_mix: AdapterMix | None = None


@dataclass(frozen=True)
class AdapterMix:
    """How requests pick their adapter: `uniform`, or `zipf` with exponent `s` (adapter k weighted 1/(k+1)^s:
    a few hot adapters and a long tail, as fleets of fine-tunes see)."""

    kind: str = "uniform"
    s: float = 1.0

    @classmethod
    def parse(cls, text: str) -> AdapterMix:
        """`uniform`, `zipf` or `zipf:S` (S > 0)."""
        kind, _, exponent = text.strip().partition(":")
        if kind == "uniform" and not exponent:
            return cls()
        if kind == "zipf":
            try:
                s = float(exponent) if exponent else 1.0
            except ValueError:
                raise WorkloadError(f"zipf's exponent must be a number, got {exponent!r}") from None
            if not s > 0:
                raise WorkloadError(f"zipf's exponent must be > 0, got {s:g}")
            return cls("zipf", s)
        raise WorkloadError(f"{text!r} is not uniform, zipf or zipf:S")

    def describe(self) -> str:
        return "uniform" if self.kind == "uniform" else f"zipf:{self.s:g}"

    def weights(self, adapters: int) -> list[float]:
        if self.kind == "uniform":
            return [1.0] * adapters
        return [1.0 / (k + 1) ** self.s for k in range(adapters)]


def adapter_name(index: int) -> str:
    """The name the bench serves its `index`-th adapter under (and its requests ask for)."""
    return f"adapter-{index}"


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str
    max_tokens: int
    adapter: str = ""
    """The LoRA adapter it runs with ("": the base model)."""


@dataclass
class RequestRecord:
    index: int
    sent: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    finished: float = 0.0
    """When the stream ended (last token, or the error): for the requests in flight over time."""

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) ÷ (output tokens − 1); None for fewer than two tokens (vLLM counts it as 0 for goodput)."""
        if self.output_tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def shared_prefix(spec: WorkloadSpec) -> str:
    if not spec.shared_prefix_tokens:
        return ""
    # Its own generator, from the base seed only: the same prefix for every point and repeat.
    return _words(random.Random(f"shared-prefix:{spec.base_seed}"), spec.shared_prefix_tokens) + " "


def derive_seed(base_seed: int, step: int, repeat: int) -> int:
    """The seed of one run (a point's repeat): stable across Python versions and processes, distinct per run."""
    digest = hashlib.sha256(f"phasescope-bench:{base_seed}:{step}:{repeat}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def workload(spec: WorkloadSpec, seed: int, count: int) -> list[BenchRequest]:
    """`count` seeded requests: the same spec and seed always give the same prompts and lengths."""
    rng = random.Random(seed)
    prefix = shared_prefix(spec)
    order = list(range(len(spec.dataset)))
    requests = []
    # The adapters are drawn from a generator of their own, so a run's prompts are the same with or without them.
    adapter_rng = random.Random(f"adapters:{seed}")
    mix = spec.adapter_mix or AdapterMix()
    weights = mix.weights(spec.adapters) if spec.adapters else []
    for index in range(count):
        if spec.dataset:
            # Draw without replacement; a new seeded shuffle each time the file is used up.
            if index % len(order) == 0:
                rng.shuffle(order)
            item = spec.dataset[order[index % len(order)]]
            body = item.prompt
            max_tokens = item.max_tokens or spec.output_tokens.sample(rng)
        else:
            body = _words(rng, spec.prompt_tokens.sample(rng))
            max_tokens = spec.output_tokens.sample(rng)
        adapter = adapter_name(adapter_rng.choices(range(spec.adapters), weights)[0]) if spec.adapters else ""
        requests.append(BenchRequest(index, prefix + body, max_tokens, adapter))
    return requests
