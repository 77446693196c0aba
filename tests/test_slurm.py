"""The slurm/ batch scripts on a real SLURM: a one-node cluster on this machine (slurmctld and slurmd with
their configuration, state and logs in a temporary directory; auth/none, so no munge), each script
submitted in its CPU mode with `sbatch --wait` and its output checked. The daemons stop at the end."""
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from conftest import hf_greedy, run_cli

DAEMONS = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo"]
pytestmark = pytest.mark.skipif(any(shutil.which(d) is None for d in DAEMONS),
                                reason="needs SLURM's daemons and clients (Debian: slurm-wlm; .ci/run installs it)")
CPU_MODE = ["--gres=none", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
JOB_TIMEOUT_S = 600


@dataclass
class Cluster:
    root: str
    env: dict          # SLURM_CONF: how clients find this cluster

    def client(self, *args, timeout=60):
        return run_cli(*args, env=self.env, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_conf(root: str) -> str:
    """One node (this host, reached at 127.0.0.1) with at least 2 CPUs in one partition; ports chosen free,
    so it runs beside any other SLURM on the machine."""
    node, user = socket.gethostname().split(".")[0], getpass.getuser()
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    conf = f"""\
ClusterName=distmkci
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={max(2, os.cpu_count() or 1)} State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("slurm"))
    conf = write_conf(root)
    outputs = {name: open(os.path.join(root, f"{name}.out"), "w") for name in ("slurmctld", "slurmd")}
    daemons = [subprocess.Popen([name, "-D", "-f", conf], stdout=out, stderr=subprocess.STDOUT)
               for name, out in outputs.items()]
    cluster = Cluster(root, {"SLURM_CONF": conf})
    try:
        deadline = time.monotonic() + 60
        while cluster.client("sinfo", "-h", "-o", "%T").stdout.strip() != "idle":
            exited = [d.args[0] for d in daemons if d.poll() is not None]
            if exited or time.monotonic() > deadline:
                logs = "".join(open(os.path.join(root, f"{d}.out")).read()[-2000:] for d in ("slurmctld", "slurmd"))
                pytest.fail(f"the local SLURM did not come up ({exited or 'timeout'}):\n{logs}")
            time.sleep(0.5)
        yield cluster
    finally:
        cancel_all_jobs(cluster)
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for out in outputs.values():
            out.close()


def cancel_all_jobs(cluster: Cluster) -> None:
    """Jobs outlive slurmd (their slurmstepd keeps them running): cancel them, wait until they are gone."""
    jobs = cluster.client("squeue", "-h", "-o", "%i").stdout.split()
    if jobs:
        cluster.client("scancel", *jobs)
    deadline = time.monotonic() + 60
    while cluster.client("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
        time.sleep(1)


def sbatch(cluster: Cluster, script: str, out_dir, *options, **variables) -> tuple[str, str]:
    """Submit `script` in CPU mode and wait for it (bounded, polling each second: sbatch --wait polls every
    10 s); its final state and exit code ("COMPLETED 0:0") and its log."""
    env = {**cluster.env, "DISTMK_CPU": "1", "DISTMK_PYTHON": sys.executable, **variables}
    proc = run_cli("sbatch", "--parsable", *CPU_MODE, *options, f"--output={out_dir}/%x-%j.out", script, env=env)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        fields = dict(f.split("=", 1) for f in cluster.client("scontrol", "-o", "show", "job", job).stdout.split()
                      if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        if time.monotonic() > deadline:
            cancel_all_jobs(cluster)
            pytest.fail(f"{script} (job {job}) did not finish within {JOB_TIMEOUT_S} s")
        time.sleep(1)
    with open(os.path.join(out_dir, f"{fields['JobName']}-{job}.out")) as f:
        return f"{fields['JobState']} {fields['ExitCode']}", f.read()


def json_lines(log: str) -> list[dict]:
    """The log's lines that start with "{", read as JSON; one that is not fails with the log's end shown."""
    found = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError as e:
                raise AssertionError(f"a log line is not JSON ({e}): {line[:500]!r}\n{log[-3000:]}") from None
    return found


def test_scaling_sbatch_writes_json_figures_and_summary(cluster, tmp_path):
    results = tmp_path / "scaling"
    # input for allreduce.png in the shape benchmarks/allreduce.py writes (made-up latencies: it needs GPUs)
    allreduce = tmp_path / "allreduce.json"
    allreduce.write_text(json.dumps([{"world": 2, "bytes": 2**k, "distmk_us": 3.0 + k, "nccl_eager_us": 20.0 + k,
                                      "nccl_graph_us": 9.0 + k, "symm_mem_us": None} for k in (10, 16, 20)]))
    state, log = sbatch(cluster, "slurm/scaling.sbatch", tmp_path, DISTMK_RESULTS=str(results),
                        DISTMK_ALLREDUCE_JSON=str(allreduce))
    assert state == "COMPLETED 0:0", log[-3000:]
    records = json.loads((results / "scaling.json").read_text())
    assert [(r["model"], r["tp"]) for r in records] == [("tiny-llama", 1), ("tiny-llama", 2)], records
    for r in records:
        assert r["backend"] == "reference" and r["device"] == "cpu" and r["distmk_error"] is None, r
        assert r["step_ms"] > 0 and r["hf_eager_ms"] > 0 and r["params"] > 0
        assert r["cudagraph_ms"] is None and r["roofline_ms"] is None      # they need CUDA
    # the batch script's own python ran alone although SLURM told it about 2 tasks; tp=2 ran under torchrun
    assert [r["launcher"] for r in records] == ["single", "torchrun"]
    for figure in ("step_ms_vs_tp.png", "step_ms_vs_params.png", "allreduce.png"):
        assert (results / figure).stat().st_size > 0
    summary = (results / "summary.md").read_text()
    assert "| tiny-llama |" in summary and "efficiency_vs_tp.png: needs" in summary


def test_multinode_sbatch_generates_over_srun(cluster, tmp_path):
    """On this one node: srun's two tasks find each other through distmk.dist's SLURM detection."""
    state, log = sbatch(cluster, "slurm/multinode.sbatch", tmp_path)
    assert state == "COMPLETED 0:0", log[-3000:]
    (out,) = json_lines(log)
    assert out["tp"] == 2 and out["tokens"] == hf_greedy("tiny-llama")[0]


def test_serve_sbatch_answers_a_completion(cluster, tmp_path):
    state, log = sbatch(cluster, "slurm/serve.sbatch", tmp_path, DISTMK_PORT=str(free_port()))
    assert state == "COMPLETED 0:0" and "serve check: passed" in log, log[-3000:]
    (answer,) = json_lines(log)
    assert answer["health"] == 200 and isinstance(answer["completion"]["choices"][0]["text"], str)
