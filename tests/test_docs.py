"""The repo's docs stand alone: no file cites the design notes kept outside the repo, and every relative
link in README.md and docs/ points at a file (and, for `#anchors`, a heading) that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Split so this file does not match itself: the design notes and the folder they sit in, outside the repo.
OUTSIDE = ("DESIGN" + ".md", ".." + "/shared")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        ROOT / n for n in names if n.endswith((".py", ".md", ".toml", ".yaml", ".yml", ".txt", "Makefile"))
    ]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_no_file_cites_documents_outside_the_repo():
    citing = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace") if path.is_file() else ""
        citing += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
    assert citing == []


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []
