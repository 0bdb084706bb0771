"""The README and the pages under docs/: every relative link leads to a file that exists, and
every #anchor to a heading of the page it names (GitHub's anchor rules)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"(?m)^#{1,6} (.+)$", text)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_links(page: Path) -> list[str]:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    return broken


def test_every_relative_link_and_anchor_resolves():
    assert len(PAGES) >= 6
    assert {page.name: broken_links(page) for page in PAGES} == {page.name: [] for page in PAGES}


def test_the_readme_stays_an_entrance_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") < 300
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, page.name


def test_the_checker_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [gone](missing.md) [bad](#nope) [web](https://x.y)\n")
    assert broken_links(page) == ["missing.md", "#nope"]


def test_the_flags_page_lists_every_flag_of_up_as_options_py_does():
    """docs/flags.md's tables are `up --help`'s entries: a flag added to options.py without
    running scripts/flags-doc (or a table edited by hand) fails here."""
    from localserve.cli import build_parser
    from localserve.options import flags_markdown

    page = (ROOT / "docs" / "flags.md").read_text()
    assert flags_markdown() in page
    up = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
              if a[0] == "up")[1]
    flags = {flag for action in up._actions for flag in action.option_strings} - {"-h", "--help"}
    missing = sorted(flag for flag in flags if f"`{flag}`" not in page)
    assert missing == []


def test_the_readmes_how_fast_fits_a_screen_and_every_figure_is_in_docs_performance():
    """One short table of today's figures in the README; each figure (a ratio with its
    spread) stands in docs/performance.md with its command, so the two cannot drift."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How fast\n", 1)[1].split("\n## ", 1)[0]
    assert len(section.rstrip("\n").split("\n")) + 1 <= 15
    performance = (ROOT / "docs" / "performance.md").read_text()
    figures = re.findall(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", section)
    assert len(figures) >= 6
    assert [f for f in figures if f not in performance] == []


def test_open_webui_is_started_on_a_port_that_is_not_localserves():
    """docs/office.md's Open WebUI command names its own port: without one Open WebUI takes
    8080, the port the README's office.toml gives localserve."""
    root = Path(__file__).resolve().parent.parent
    ours = re.search(r"^\s*port = (\d+)", (root / "README.md").read_text(), re.M).group(1)
    start = re.search(r"open-webui serve[^`]*", (root / "docs" / "office.md").read_text()).group(0)
    theirs = re.search(r"--port (\d+)", start)
    assert theirs and theirs.group(1) != ours, start
