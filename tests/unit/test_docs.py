"""The docs a person navigates: README.md as a short front page, the pages under docs/,
and the settings reference generated from the settings class and the lane model
(tidegate_tools/docgen.py). Fails when a setting or a lane field has no description,
when a generated part is stale (`make docs` brings it up to date), or when a relative
link of README.md or docs/*.md points at no file or no heading."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, Field

from tidegate.lanes import KvPolicy, Lane, PeakSpec
from tidegate.settings import Settings
from tidegate_tools import docgen

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The pages the README must lead to (issue 32): what tidegate is and how a job travels,
# its routes, the OpenAI-compatible API, operations, security, settings, benchmarks.
EXPECTED = ("architecture.md", "api.md", "openai.md", "operations.md", "security.md",
            "settings.md", "benchmarks.md")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_setting_and_lane_field_has_a_description() -> None:
    assert docgen.undocumented() == [], "add Field(description=...), then run `make docs`"


def test_the_description_check_catches_a_field_without_one() -> None:
    class Two(BaseModel):
        described: int = Field(1, description="one")
        bare: int = 2

    assert docgen.undocumented(Two, ((Two, "lane"),)) == ["TIDEGATE_BARE", "lane.bare"]


def test_the_settings_reference_lists_every_setting_and_lane_field() -> None:
    text = (DOCS / "settings.md").read_text()
    for name in Settings.model_fields:
        assert f"| `{docgen.env_name(name)}` |" in text, name
    for model in (Lane, KvPolicy, PeakSpec):
        for name in model.model_fields:
            assert name == "name" or f"| `{name}` |" in text, name


def test_the_generated_docs_are_current() -> None:
    assert [str(p.relative_to(ROOT)) for p in docgen.stale()] == [], "run `make docs`"


def test_every_docs_page_opens_with_its_contents() -> None:
    for path in DOCS.glob("*.md"):
        head = path.read_text().splitlines()[:40]
        assert docgen.TOC_START in head, f"{path.name}: no contents near the top"


def test_the_readme_is_a_front_page_leading_into_docs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    for needed in ("make demo", "make test", "tidegate up"):
        assert needed in text, needed
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    for page in EXPECTED:
        assert (DOCS / page).exists(), page
        assert f"docs/{page}" in linked, f"the README does not link docs/{page}"


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown page that point at no file, or at no heading of the
    page they name; links in code are not links."""
    broken = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        missing_heading = bool(fragment) and dest.suffix == ".md" and dest.exists() \
            and fragment not in _anchors(dest)
        if not dest.exists() or missing_heading:
            broken.append(target)
    return broken


def _prose(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    return {slug for _, _, slug in docgen.headings(path.read_text())}


def test_every_relative_link_points_at_a_file_and_heading() -> None:
    for page in PAGES:
        assert broken_links(page) == [], page.relative_to(ROOT)


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    page.write_text("# Page\n\n## Here\n\n[ok](other.md#a-heading) [ok](#here) "
                    "[gone](missing.md) [no heading](other.md#nowhere) [web](https://x.org)\n"
                    "`[code](nowhere.md)`\n")
    assert broken_links(page) == ["missing.md", "other.md#nowhere"]
