"""The documentation holds together: a short README, every relative link resolves inside the
repository, and nothing cites a file outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
DOCS += sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "deploy" / "README.md"]
# [text](target) with a relative target; a target may carry a #fragment.
LINK = re.compile(r"\[[^\]]*\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


def test_relative_links_resolve_inside_the_repository():
    broken, checked = [], 0
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), start=1):
            for target in LINK.findall(line):
                path, _, fragment = target.partition("#")
                dest = (doc.parent / path).resolve()
                where = f"{doc.relative_to(ROOT)}:{n}: {target}"
                checked += 1
                if not dest.is_relative_to(ROOT):
                    broken.append(f"{where} (outside the repository)")
                elif not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif fragment and dest.suffix == ".md":
                    headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
                    if fragment not in {_anchor(h) for h in headings}:
                        broken.append(f"{where} (no heading #{fragment})")
    assert checked > 50, f"only {checked} links found: is the link pattern still right?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_nothing_cites_a_design_document_outside_the_repository():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    me = Path(__file__).relative_to(ROOT).as_posix()
    hits = [
        f"{name}:{n}"
        for name in tracked
        if name != me
        and Path(ROOT / name).suffix in {".py", ".md", ".sh", ".toml", ""}
        and (ROOT / name).is_file()
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if "DESIGN.md" in line or "../shared" in line
    ]
    assert not hits, (
        "cites a file outside the repository (use docs/architecture.md):\n" + "\n".join(hits)
    )
