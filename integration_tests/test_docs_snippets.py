"""The user docs run as written: every ```python block of docs/quickstart.md and docs/packages/*.md
executes on CPU (a page's blocks in order, in one namespace, as a reader pastes them), and every
relative link of the docs and READMEs points at a file that exists.

A block that is shown but not run is fenced ```text, ```bash or ```python-no-run.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "quickstart.md", *sorted((ROOT / "docs" / "packages").glob("*.md"))]
PACKAGES = ["sa-cp", "sa-kernels", "sa-routing", "sa-mla", "sa-layers"]
RUN = "python"
SHOWN = {"python-no-run", "text", "bash"}
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line
    language: str
    code: str


def fenced_blocks(text: str, page: Path) -> list[Block]:
    """The fenced blocks of a markdown text, with their language and first code line."""
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if language is None and match:
            language, start, lines = match.group(1), number + 1, []
        elif language is not None and line.strip() == "```":
            blocks.append(Block(page, start, language, "\n".join(lines) + "\n"))
            language = None
        elif language is not None:
            lines.append(line)
    if language is not None:
        raise ValueError(f"{page}: the block opened at line {start - 1} is never closed")
    return blocks


def run_blocks(blocks: list[Block]) -> dict:
    """Execute the runnable blocks in order in one namespace; a traceback points at the markdown
    file and line of the failing statement."""
    namespace: dict = {"__name__": "docs_snippet"}
    torch.manual_seed(0)
    for block in blocks:
        if block.language != RUN:
            continue
        # pad with newlines so that line numbers in a traceback are the page's
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        exec(code, namespace)
    return namespace


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_every_package_has_a_page_and_the_quickstart_has_snippets():
    assert {p.stem for p in PAGES[1:]} == set(PACKAGES)
    runnable = [b for b in fenced_blocks(PAGES[0].read_text(), PAGES[0]) if b.language == RUN]
    assert len(runnable) >= 4, "the quickstart shows the models and the indexer recipe in code"


@pytest.mark.parametrize("page", PAGES, ids=[_relative(p) for p in PAGES])
def test_every_fenced_block_says_whether_it_runs(page):
    for block in fenced_blocks(page.read_text(), page):
        assert block.language in SHOWN | {RUN}, (
            f"{_relative(page)}:{block.line}: fence ```{block.language}: use ```python (run by "
            f"this test) or one of {sorted(SHOWN)} (shown only)"
        )


@pytest.mark.parametrize("page", PAGES, ids=[_relative(p) for p in PAGES])
def test_the_python_blocks_of_the_page_run_in_order_on_cpu(page):
    blocks = fenced_blocks(page.read_text(), page)
    if not any(b.language == RUN for b in blocks):
        pytest.skip(f"{_relative(page)} has no runnable block")
    run_blocks(blocks)


def test_a_failing_snippet_fails_at_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```python\nx = 1\n```\n\n```python-no-run\nraise SystemExit\n```\n\n"
        "```python\ny = x + 1\nassert y == 3, 'wrong'\n```\n"
    )
    blocks = fenced_blocks(page.read_text(), page)
    assert [(b.language, b.line) for b in blocks] == [
        ("python", 4),
        ("python-no-run", 8),
        ("python", 12),
    ]
    with pytest.raises(AssertionError, match="wrong") as failure:
        run_blocks(blocks)
    assert failure.traceback[-1].path == page and failure.traceback[-1].lineno + 1 == 13


def test_an_unclosed_block_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks("```python\nx = 1\n", tmp_path / "page.md")


LINKED = [
    ROOT / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
    *sorted(ROOT.glob("docs/packages/*.md")),
    *sorted(ROOT.glob("packages/*/README.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a markdown page, slugged as GitHub renders them."""
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", prose, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", LINKED, ids=[_relative(p) for p in LINKED])
def test_relative_links_point_at_files_and_headings_that_exist(doc):
    prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)  # code spans: `RecomputeReplay[T](name)` is no link
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{_relative(doc)} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{_relative(doc)} links to {target}: no such heading"


def test_heading_anchors_are_slugged_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Sparse MLA attention: FlashMLA + cuDNN\n\n## The `sa-demo` on CUDA\n")
    assert anchors(page) == {"sparse-mla-attention-flashmla--cudnn", "the-sa-demo-on-cuda"}
