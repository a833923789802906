"""Every relative link in README.md and docs/**/*.md resolves: the file exists and, for a
`#anchor`, the target has a heading with that slug (GitHub's rule). External links are skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "tests" / "harness" / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); reference definitions `[id]: target`
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks and HTML comments."""
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            yield number, line


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: markup dropped, lowercase, punctuation other than `-` and `_`
    removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path):
    for number, line in _prose_lines(path.read_text()):
        prose = INLINE_CODE.sub("", line)
        for target in INLINE_LINK.findall(prose):
            yield number, target
        ref = REF_DEF.match(prose)
        if ref:
            yield number, ref.group(1)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: …
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems


def test_github_slug_rule():
    assert github_slug('What "auto" means') == "what-auto-means"
    assert github_slug("Plan the memory: `cputrain plan`") == "plan-the-memory-cputrain-plan"
    assert github_slug("Export to GGUF (llama.cpp, Ollama)") == "export-to-gguf-llamacpp-ollama"
    assert github_slug("DeepSpeed ZeRO-3") == "deepspeed-zero-3"
    assert github_slug("data.cache_dir and `model.lora.rank`") == "datacache_dir-and-modellorarank"


def test_link_checker_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page.write_text("# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x)\n"
                    "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
                    "[gone](missing.md) [no such heading](other.md#nothing)\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md does not exist" in problems[0]
    assert "#nothing" in problems[1]


def test_the_docs_exist_and_readme_links_every_page():
    assert len(PAGES) > 2
    linked = {(REPO / target.partition("#")[0]).resolve() for _, target in links(REPO / "README.md")
              if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and target.partition("#")[0]}
    unlinked = [str(p.relative_to(REPO)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"pages under docs/ that README.md does not link to: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_readme_stays_short_and_keeps_the_commands_ci_and_users_run():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is the front page (≤ 250 lines): move the detail to a page under docs/"
    setup = _section(text, "## Two commands")
    assert "make demo    # installs into .venv, then trains the built-in demo" in setup
    assert "make test    # installs with the test tools, then runs the test suite" in setup
    # .ci/run runs "the README's test command"; the Makefile points at "README, Tests" for the budget
    tests = _section(text, "## Tests")
    assert "make test " in tests and "make test-fast" in tests
    assert "**Budget.**" in tests and "≤ 30 minutes" in tests
    for folder in ("tests/unit", "tests/k8s", "tests/harness", "tests/e2e", "tests/distributed"):
        assert f"| `{folder}` |" in tests, folder
    # the commands, the tiers and the budget; how the suite keeps to it is the harness's own page
    assert len(tests.strip().splitlines()) <= 30, "README's Tests section (≤ 30 lines): the rest goes to tests/harness/README.md"
    assert "(tests/harness/README.md)" in tests
    assert "the README's test command" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / ".ci" / "run").read_text()


# A file of the project cited by its path from the repository's root, in prose, code spans or fences.
CITED_PATH = re.compile(r"(?<![\w/.-])((?:cputrain|tests|benchmarks)/[\w/.-]*?\.py)\b")


def missing_cited_paths(path: Path, root: Path = REPO) -> list[str]:
    """Every `cputrain/…py`, `tests/…py` and `benchmarks/…py` a page cites that is not in the tree."""
    return [f"{path.relative_to(root)}:{number}: {cited} does not exist"
            for number, line in enumerate(path.read_text().splitlines(), 1)
            for cited in CITED_PATH.findall(line) if not (root / cited).exists()]


def test_the_path_check_finds_a_moved_file(tmp_path):
    (tmp_path / "cputrain" / "plan" / "time").mkdir(parents=True)
    (tmp_path / "cputrain" / "plan" / "time" / "step_time.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("The step (`cputrain/plan/time/step_time.py`), once cputrain/plan/step_time.py.\n"
                    "```\npython benchmarks/gone.py\n```\nnot a path: src/cputrain/x.py, mycputrain/x.py\n")
    assert missing_cited_paths(page, root=tmp_path) == [
        "page.md:1: cputrain/plan/step_time.py does not exist", "page.md:3: benchmarks/gone.py does not exist"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_file_exists(page):
    missing = missing_cited_paths(page)
    assert not missing, "files cited that are not in the tree (moved or renamed?):\n" + "\n".join(missing)
