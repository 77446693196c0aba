"""CI runs the README's commands: its set-up command (the install a newcomer makes) and its test command appear
verbatim in .ci/run, in that order, after the virtual environment is activated. Every relative link of README.md
and docs/*.md reaches a file or folder of the checkout (and a heading, where it names one). The README's headline
figures, and benchmarks/README.md's decode tables, are the ones their runs' JSON hold (benchmarks/results_table.py
writes them)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_command(label: str) -> str:
    """The first line of the first ```bash block after the README's paragraph that starts with `label`."""
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(label))
    fence = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
    return lines[fence + 1].strip()


def test_ci_runs_the_readme_set_up_and_test_commands():
    set_up, test = readme_command("**Set up and generate**"), readme_command("**Test**")
    assert set_up.startswith("pip install ") and test.startswith("python -m pytest"), (set_up, test)
    ci = [line.strip() for line in ROOT.joinpath(".ci/run").read_text().splitlines()]

    def at(command: str) -> int:
        where = [i for i, line in enumerate(ci) if line == command or line.startswith(command + " ||")]
        assert where, f".ci/run does not run the README's command {command!r}"
        return where[0]
    assert ci.index('source "$venv/bin/activate"') < at(set_up) < at(test)


def headings(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    titles = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in titles}


def test_readme_and_docs_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, seen = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue
            seen += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or anchor and (not dest.is_file() or anchor not in headings(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert seen and not broken, broken


def test_the_pages_tables_of_figures_are_generated_from_their_runs_json():
    """Each table marked `<!-- table: KIND ARGS -->` in README.md, benchmarks/README.md and docs/ is the one
    benchmarks/results_table.py makes from the runs' JSON, and every table of figures there is marked."""
    from results_table import MARKER, page_tables
    pages = [("README.md", 1), ("benchmarks/README.md", 7)] + [(f"docs/{p.name}", 0) for p in ROOT.glob("docs/*.md")]
    for page, least in pages:
        text = ROOT.joinpath(page).read_text()
        tables = list(page_tables(text))
        assert len(tables) >= least, page
        for marker, found, made in tables:
            assert found == made, f"{page}: {marker}"
        lines = text.splitlines()
        for i, line in enumerate(lines):         # a table whose first row holds a number is one of figures
            first_row = lines[i + 2] if line.startswith("|") and not lines[i - 1].startswith("|") else ""
            if re.search(r"\|\s*\**\d+(\.\d+)?\s*(ms|s|µs|KB|MB)?\**\s*\|", first_row):
                assert MARKER.match(lines[i - 1]), f"{page}: the table of figures at line {i + 1} is typed"
