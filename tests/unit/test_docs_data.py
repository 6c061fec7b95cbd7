"""docs/data against the Markdown that points into it (docs/data/README.md).

Every `docs/data/...` path and relative link in a `*.md` of the checkout names something, every study
folder there is cited by a document outside it and has a README saying what it is and how it was made,
the folder stays within its budget, and raw results are compressed (reproducibly: no file name or time in
a gzip header). Cheap on every run: gzip headers are read, and only small files decompressed whole.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data"
# Not the project's documents: dependencies, caches, and studies' outputs before they are kept.
SKIP_DIRS = {"node_modules", "__pycache__", "results", "build"}
RAW_SUFFIXES = {".json", ".jsonl"}
LARGE_CSV = 64 * 1024  # a small table reads well in a diff; a large one is raw results
DATA_PATH = re.compile(r"(?<![\w./-])docs/data(?:/[\w.*-]+)*/?")
LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
GZIP_MAGIC = b"\x1f\x8b\x08"  # gzip, deflate
GZIP_FNAME = 0x08  # the header flag: a file name follows the fixed header
BUDGET_BYTES = 2 * 1024 * 1024  # what the docs cite, not every study ever run (the history keeps those)
DECOMPRESS_WHOLE = 64 * 1024  # larger results: their header is checked, not every byte

Target = tuple[str, Path]  # as written, and the folder it is relative to
Targets = Callable[[Path, str], list[Target]]


def markdown_files() -> list[Path]:
    found: list[Path] = []
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if not entry.name.startswith(".") and entry.name not in SKIP_DIRS:
                    stack.append(entry)
            elif entry.suffix == ".md":
                found.append(entry)
    return sorted(found)


def data_files() -> list[Path]:
    return sorted(path for path in DATA.rglob("*") if path.is_file())


def names_something(path: Path) -> bool:
    text = str(path)
    if any(c in text for c in "*?["):  # a glob (docs/data/x/*.json.gz) names what it matches
        return any(Path("/").glob(text.lstrip("/")))
    return path.exists()


def data_paths(md: Path, line: str) -> list[Target]:
    # A path at the end of a sentence: its full stop is not part of it.
    return [(match.group(0).rstrip("."), ROOT) for match in DATA_PATH.finditer(line)]


def relative_links(md: Path, line: str) -> list[Target]:
    links = (match.group(1).split("#", 1)[0] for match in LINK.finditer(line))
    return [
        (link, md.parent)
        for link in links
        # Not a page's own anchor, a web or mail address, or an absolute path.
        if link and "://" not in link and not link.startswith(("mailto:", "/"))
    ]


def targets_in_markdown(targets: Targets) -> list[tuple[str, Path]]:
    """Each target of the kind in every Markdown file: where it is written (file:line), and what it resolves to."""
    found: list[tuple[str, Path]] = []
    for md in markdown_files():
        for number, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            found.extend(
                (f"{md.relative_to(ROOT)}:{number}: {written}", (base / written).resolve())
                for written, base in targets(md, line)
            )
    return found


def missing(targets: Targets) -> list[str]:
    return [f"{where} does not exist" for where, path in targets_in_markdown(targets) if not names_something(path)]


def test_the_markdown_points_into_docs_data_and_links_relatively() -> None:
    # Without this, a walk or a pattern that found nothing would pass the two tests below.
    assert DATA / "README.md" in markdown_files()
    assert len(targets_in_markdown(data_paths)) > 10
    assert len(targets_in_markdown(relative_links)) > 10


def test_every_docs_data_path_written_in_the_markdown_exists() -> None:
    problems = missing(data_paths)
    assert not problems, "\n".join(problems)


def test_every_relative_link_in_the_markdown_exists() -> None:
    problems = missing(relative_links)
    assert not problems, "\n".join(problems)


def test_no_raw_results_under_docs_data_are_left_uncompressed() -> None:
    raw = [
        str(path.relative_to(ROOT))
        for path in data_files()
        if path.suffix in RAW_SUFFIXES or (path.suffix == ".csv" and path.stat().st_size > LARGE_CSV)
    ]
    assert not raw, f"write them as NAME.json.gz (or gzip -9 -n them): {raw}"


def gzip_headers() -> dict[Path, bytes]:
    headers = {}
    for path in data_files():
        if path.suffix == ".gz":
            with path.open("rb") as stream:
                headers[path] = stream.read(10)
    return headers


def test_no_gzip_under_docs_data_carries_a_file_name_or_a_time() -> None:
    # Without either, the same JSON compresses to the same bytes: a result changes in git only when its data does.
    stamped = [str(path.relative_to(ROOT)) for path, header in gzip_headers().items()
               if header[3] & GZIP_FNAME or any(header[4:8])]  # fmt: skip
    assert not stamped, f"recompress them with gzip -9 -n: {stamped}"


def test_every_gzip_under_docs_data_is_gzip_and_the_small_ones_decompress() -> None:
    broken = [f"{path.relative_to(ROOT)}: not gzip" for path, header in gzip_headers().items()
              if not header.startswith(GZIP_MAGIC)]  # fmt: skip
    for path in gzip_headers():
        if path.stat().st_size <= DECOMPRESS_WHOLE:
            try:
                gzip.decompress(path.read_bytes())
            except (OSError, EOFError) as error:
                broken.append(f"{path.relative_to(ROOT)}: {error}")
    assert not broken, "\n".join(broken)


def test_docs_data_stays_within_its_budget() -> None:
    total = sum(path.stat().st_size for path in data_files())
    assert total <= BUDGET_BYTES, f"docs/data holds {total:,} bytes, over {BUDGET_BYTES:,}: keep what the docs cite"


def test_every_study_folder_under_docs_data_is_cited_outside_it() -> None:
    cited = " ".join(
        md.read_text(encoding="utf-8") for md in markdown_files() if not md.is_relative_to(DATA)
    )  # fmt: skip
    # A link relative to docs/ (data/NAME/...) or a path from the checkout's root (docs/data/NAME/...).
    uncited = sorted(folder.name for folder in DATA.iterdir() if folder.is_dir() and f"data/{folder.name}" not in cited)
    assert not uncited, f"no document cites these folders; drop them (the history keeps them): {uncited}"


def test_every_study_folder_under_docs_data_has_a_readme() -> None:
    # A study: each folder at the top of docs/data, and each folder holding a result.
    studies = {path for path in DATA.iterdir() if path.is_dir()}
    studies |= {path.parent for path in data_files() if path.name.endswith(".json.gz")}
    without = sorted(str(study.relative_to(ROOT)) for study in studies if not (study / "README.md").is_file())
    assert not without, f"study folders without a README.md: {without}"
