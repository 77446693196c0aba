"""The one-shot CPU commands of README.md and docs/ run as written (a tiny preset or the graph compiler, no GPU): a
newcomer who copies one gets what it says. Servers are test_serve.py's; GPU and SLURM commands run elsewhere."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def documented_commands() -> list[str]:
    """Each command of the pages' bash blocks, its continuation lines joined."""
    commands = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for command in re.sub(r"\\\n\s*", "", block).splitlines():
                if command.strip() and not command.lstrip().startswith("#"):
                    commands.append(command.split(" # ")[0].strip())
    return list(dict.fromkeys(commands))


def runs_here(command: str) -> bool:
    one_shot = "distmk.generate" in command or "distmk.graph" in command
    return one_shot and "cuda" not in command and not command.startswith("pip ") and (
        "tiny-" in command or "distmk.graph" in command)


CPU_COMMANDS = [c for c in documented_commands() if runs_here(c)]


def test_the_pages_have_cpu_commands_to_run():
    assert len(CPU_COMMANDS) >= 6, CPU_COMMANDS
    assert any(c.startswith("torchrun") for c in CPU_COMMANDS) and any("mpirun" in c for c in CPU_COMMANDS)


@pytest.mark.parametrize("command", CPU_COMMANDS)
def test_a_documented_cpu_command_runs(command):
    if "mpirun" in command and shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun")
    # as root (CI's container) Open MPI asks for these; any other user needs nothing
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    proc = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), command
