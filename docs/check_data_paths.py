"""Check docs/data against the Markdown that points into it (docs/data/README.md).

    python3 docs/check_data_paths.py

Fails (exit status 1, one line per problem) when
- a `docs/data/...` path written in any `*.md` of the checkout, or a relative link `[...](path)`
  in one, names nothing that exists (a path the same file compresses with `gzip -9 -n PATH`
  counts when PATH.gz exists: that is a command writing PATH and compressing it);
- a raw result under docs/data is left uncompressed (`*.json`, `*.jsonl`, a `*.csv` over 64 KiB),
  or a `*.gz` there does not decompress or carries a file name or a time in its header
  (`gzip -9 -n` writes neither, so the same JSON gives the same bytes);
- a study folder (each folder at the top of docs/data, and each folder holding a `*.json.gz`)
  has no README.md.
"""

from __future__ import annotations

import fnmatch
import gzip
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
SKIP_DIRS = {"node_modules", "__pycache__", "results", "build"}
RAW_SUFFIXES = {".json", ".jsonl"}
LARGE_CSV = 64 * 1024
DATA_PATH = re.compile(r"(?<![\w./-])docs/data(?:/[\w.*-]+)*/?")
LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
GZIPPED = re.compile(r"gzip -9 -n (?:-c )?([\w./*-]+)")


def markdown_files() -> list[Path]:
    found = []
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_dir():
                if not entry.name.startswith(".") and entry.name not in SKIP_DIRS:
                    stack.append(entry)
            elif entry.suffix == ".md":
                found.append(entry)
    return sorted(found)


def exists(path: Path) -> bool:
    text = str(path)
    if any(c in text for c in "*?["):
        return any(Path("/").glob(text.lstrip("/")))
    return path.exists()


def check_mentions(md: Path, problems: list[str]) -> int:
    text = md.read_text(encoding="utf-8")
    # Where the same file compresses what a command wrote: `gzip -9 -n PATH` (PATH may be a glob).
    compressed = [str((base / target).resolve()) for target in GZIPPED.findall(text) for base in (ROOT, md.parent)]
    where = md.relative_to(ROOT)
    checked = 0

    def resolve(raw: str, base: Path, line: int) -> None:
        nonlocal checked
        target = (base / raw).resolve()
        checked += 1
        if exists(target):
            return
        if any(fnmatch.fnmatchcase(str(target), pattern) for pattern in compressed) and exists(
            target.with_name(target.name + ".gz")
        ):
            return
        problems.append(f"{where}:{line}: {raw} does not exist")

    for number, line in enumerate(text.splitlines(), 1):
        for match in DATA_PATH.finditer(line):
            resolve(match.group(0).rstrip("."), ROOT, number)
        for match in LINK.finditer(line):
            link = match.group(1).split("#", 1)[0]
            if not link or "://" in link or link.startswith(("mailto:", "/")):
                continue
            resolve(link, md.parent, number)
    return checked


def check_data(problems: list[str]) -> int:
    files = sorted(path for path in DATA.rglob("*") if path.is_file())
    for path in files:
        where = path.relative_to(ROOT)
        if path.suffix in RAW_SUFFIXES or (path.suffix == ".csv" and path.stat().st_size > LARGE_CSV):
            problems.append(f"{where}: raw results left uncompressed (gzip -9 -n {where})")
        if path.suffix == ".gz":
            header = path.read_bytes()[:10]
            if header[3] & 0x08 or any(header[4:8]):
                problems.append(f"{where}: the gzip header carries a file name or a time (use gzip -9 -n)")
            try:
                with gzip.open(path) as stream:
                    while stream.read(1 << 20):
                        pass
            except (OSError, EOFError) as error:
                problems.append(f"{where}: does not decompress: {error}")
    studies = {path for path in DATA.iterdir() if path.is_dir()}
    studies |= {path.parent for path in files if path.name.endswith(".json.gz")}
    problems.extend(
        f"{study.relative_to(ROOT)}/: study folder without a README.md"
        for study in sorted(studies)
        if not (study / "README.md").is_file()
    )
    return len(files)


def main() -> int:
    problems: list[str] = []
    mentions = sum(check_mentions(md, problems) for md in markdown_files())
    files = check_data(problems)
    for problem in problems:
        print(problem)
    print(f"{mentions} paths and links checked, {files} files under docs/data: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
