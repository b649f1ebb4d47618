"""A real two-node Slurm cluster on this machine, for the tests that submit what ``hfscale slurm`` writes.

Debian's ``slurm-wlm`` runs several ``slurmd`` on one host (``slurmd -N NAME``): one ``slurmctld``, two nodes of
one CPU each, and a ``munged`` for their authentication, every file of them (configuration, key, socket, state,
spool, logs) in one scratch folder, so nothing of the machine's own ``/etc/slurm`` or ``/etc/munge`` is read or
written. Nothing is faked: ``sbatch`` queues the script, ``srun`` starts one driver per node through each node's
``slurmd``, ``scancel`` signals them.

The node names must resolve (the script takes machine 0's address from ``scontrol show hostnames``): the
cluster names its nodes after two host names of this machine that resolve to a loopback address
(``hfscale-n1``/``hfscale-n2`` where ``.ci/run`` added them to ``/etc/hosts``, else the host's own name and the
other loopback names there, but not ``localhost``, which Slurm reads as the host's own name). It needs root
(slurmd starts the jobs as their user; munged and slurmctld run as root here, which ``--force`` and
``SlurmUser=root`` allow). :func:`unavailable` says why a
cluster cannot start, for the skip.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "sinfo", "scontrol", "scancel")
PREFERRED_NAMES = ("hfscale-n1", "hfscale-n2")
"""The node names ``.ci/run`` maps to 127.0.0.1 in ``/etc/hosts`` (when root)."""
START_TIMEOUT_S = 60.0
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _is_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None, family=socket.AF_INET)
    except OSError:
        return False
    return bool(infos) and all(info[4][0].startswith("127.") for info in infos)


def _hosts_names() -> list[str]:
    """Names ``/etc/hosts`` gives a 127.x address, in file order."""
    try:
        lines = Path("/etc/hosts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0].startswith("127."):
            names += fields[1:]
    return names


def node_names() -> tuple[str, str] | None:
    """Two distinct names of this machine resolving to loopback, sorted: the nodes' names (Slurm's node names must
    be valid host names: letters, digits and hyphens)."""
    if all(_is_loopback(n) for n in PREFERRED_NAMES):
        return PREFERRED_NAMES
    candidates = [socket.gethostname(), *_hosts_names()]
    found: list[str] = []
    for name in candidates:
        # Slurm reads a node named localhost as this host's own name, a duplicate of the other node.
        valid = re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", name) is not None
        if valid and name not in found and name != "localhost" and _is_loopback(name):
            found.append(name)
    # Sorted: Slurm numbers a job's nodes (SLURM_NODEID, hfscale's machine rank) in the order of their names.
    return tuple(sorted(found[:2])) if len(found) >= 2 else None  # type: ignore[return-value]


def unavailable() -> str | None:
    """Why a real cluster cannot start here (for the skip), or None."""
    missing = [c for c in (*DAEMONS, *COMMANDS) if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a Slurm cluster on this machine needs root (slurmd starts jobs as their user)"
    if node_names() is None:
        return "needs two host names resolving to 127.0.0.1 (add '127.0.0.1 hfscale-n1 hfscale-n2' to /etc/hosts)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


_CONF = """\
ClusterName=hfscale-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Each task keeps the limits of its node's slurmd (a node started with a smaller address space is a smaller node).
PropagateResourceLimits=NONE
ReturnToService=2
MinJobAge=600
KillWait=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: its folder, its configuration and the environment its commands need."""

    root: Path
    nodes: tuple[str, ...]
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=60, **kw)  # type: ignore[call-overload]

    def sbatch(self, script: Path, *, env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` from its folder; the job's id."""
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env={**(env or {}), **self.env},
            cwd=script.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as fields (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id: int, *, timeout_s: float) -> dict[str, str]:
        """The job's fields once it has ended (or :class:`TimeoutError`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in DONE_STATES:
                return fields
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout_s:.0f} s")

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """``scontrol shutdown`` (the controller and every slurmd), then munged; whatever is left is killed."""
        subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=60, check=False)
        for proc in reversed(self.daemons):
            if proc.args[0] == "munged":
                proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start_munge(root: Path, env: dict[str, str]) -> subprocess.Popen:
    folder = root / "munge"
    folder.mkdir(mode=0o700)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    proc = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={folder}/munge.socket", f"--key-file={key}",
         f"--log-file={folder}/munged.log", f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (folder / "munge.socket").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start: {(folder / 'munged.log').read_text(errors='replace')[-1000:]}")
        time.sleep(0.1)
    return proc


def start_cluster(root: Path, *, address_space: Mapping[int, int] | None = None) -> SlurmCluster:
    """Start munged, slurmctld and two slurmd in ``root``; return once both nodes are idle.

    Args:
        root: an empty folder for every file of the cluster.
        address_space: ``RLIMIT_AS`` bytes of a node's slurmd by the node's position (``{1: 6 << 30}``; a job on
            both nodes numbers them the same way, so this is hfscale's machine rank): every task on that node
            inherits it (``PropagateResourceLimits=NONE``), as on a node with less memory.
    """
    names = node_names()
    if names is None:
        raise RuntimeError(unavailable() or "no node names")
    root.mkdir(parents=True, exist_ok=True)
    for folder in ("state", "spool"):
        (root / folder).mkdir()
    ctld_port, *node_ports = _free_ports(1 + len(names))
    nodes = "\n".join(
        f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=8000 State=UNKNOWN"
        for name, port in zip(names, node_ports, strict=True)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        _CONF.format(
            host=socket.gethostname().split(".")[0], ctld_port=ctld_port, root=root, nodes=nodes, names=",".join(names)
        ),
        encoding="utf-8",
    )
    # The cluster's sweeps lock this host's devices in a folder of their own, not the test session's: machine 0's
    # driver otherwise waits for the session's other trials while machine 1's waits for it at the rendezvous, both
    # idle (the Slurm test took 171 s against 56-66 s beside the other sweeps' tests, a core idle). Its trials
    # measure nothing a test compares, so they may run beside the session's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")} | {
        "SLURM_CONF": str(conf),
        "HFSCALE_LOCK_DIR": str(root / "locks"),
    }
    cluster = SlurmCluster(root=root, nodes=names, env=env)
    try:
        cluster.daemons.append(_start_munge(root, env))
        cluster.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.STDOUT))  # fmt: skip
        for k, name in enumerate(names):
            node = subprocess.Popen(["slurmd", "-D", "-N", name], env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT)  # fmt: skip
            cluster.daemons.append(node)
            if k in (address_space or {}):
                # Before any job: slurmd forks each job's slurmstepd, and the tasks under it, later.
                limit = (address_space or {})[k]
                resource.prlimit(node.pid, resource.RLIMIT_AS, (limit, limit))
        _wait_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _logs(cluster: SlurmCluster) -> list[str]:
    return ["slurmctld.log", *(f"slurmd-{name}.log" for name in cluster.nodes)]


def _wait_idle(cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    states = ""
    while time.monotonic() < deadline:
        done = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = done.stdout.strip()
        if done.returncode == 0 and sorted(line.split()[1] for line in states.splitlines()) == ["idle", "idle"]:
            return
        if any(proc.poll() is not None for proc in cluster.daemons):
            break
        time.sleep(0.5)
    raise RuntimeError(
        f"the Slurm nodes are not idle ({states or 'no sinfo'}; a daemon exited or {START_TIMEOUT_S:.0f} s passed): "
        + "\n".join(f"{name}: {cluster.log(name)[-800:]}" for name in _logs(cluster))
    )
