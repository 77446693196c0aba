"""CI runs the README's commands: its set-up command (the install a newcomer makes) and its test command appear
verbatim in .ci/run, in that order, after the virtual environment is activated."""
import pathlib

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
