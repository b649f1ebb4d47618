"""``hfscale slurm``: a sweep on several nodes as an sbatch script, and the same drivers' command lines by hand.

A sweep on N machines is N drivers, one per node, each the same ``python -m hfscale.sweep`` command with its own
``--machine-rank`` (:mod:`hfscale.sweep.machines`); each driver starts its part of every trial with ``accelerate
launch`` (torchrun underneath), which rendezvous across the nodes. Under Slurm, ``srun`` starts the drivers (one
task per node, its rank from ``SLURM_NODEID``); machine 0's address is the allocation's first host (``scontrol show
hostnames``) and the port is derived from the job id: each job has a block of :data:`PORT_BLOCK` ports below the
ephemeral range (32768 and up), so two jobs sharing a node do not collide (unless their ids are 110 apart).
``srun`` is told not to end the job when one node's driver fails: machine 0 records that as a row and finishes the
sweep.

The drivers need the run folder on a filesystem every node sees (``$HOME``, a project or scratch folder) for the
other machines' logs to land in machine 0's run folder; without one each keeps its logs in ``RUN-machineK`` on its
own disk and the rows are still machine 0's.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PORT_BASE = 10000
"""Drivers' port under Slurm: ``PORT_BASE + (SLURM_JOB_ID % PORT_JOBS) * PORT_BLOCK``; trial ``i`` uses that + 1 + i."""
PORT_BLOCK = 200
"""Ports of one job: the drivers' and one per run of the sweep (a sweep with more runs on several machines is
refused, :func:`hfscale.sweep.machines.check_port_block`)."""
PORT_JOBS = 110
"""Blocks: the last ends at 31999, below Linux's ephemeral ports (32768 and up)."""

_SCRIPT = """\
#!/bin/bash
# Written by `hfscale slurm`: the sweep of {{ recipe }} on {{ nodes }} nodes, one hfscale driver per node.
# Machine 0 (the first node) writes the rows and the report into the run folder.
#SBATCH --job-name={{ job_name }}
#SBATCH --nodes={{ nodes }}
#SBATCH --ntasks-per-node=1
{% if gpus_per_node %}#SBATCH --gpus-per-node={{ gpus_per_node }}
{% endif %}#SBATCH --cpus-per-task={{ cpus_per_task }}
{% if time %}#SBATCH --time={{ time }}
{% endif %}{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% if account %}#SBATCH --account={{ account }}
{% endif %}#SBATCH --output={{ job_name }}-%j.out
# No -u: module and conda scripts in the setup lines read unset variables.
set -eo pipefail
{% for line in setup %}{{ line }}
{% endfor %}
# Machine 0's address and the drivers' port; trial i of the sweep rendezvouses on that port + 1 + i, within this
# job's block of {{ port_block }} ports.
export HFSCALE_MAIN_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
export HFSCALE_MAIN_PORT=$(( {{ port_base }} + (SLURM_JOB_ID % {{ port_jobs }}) * {{ port_block }} ))
export HFSCALE_PORT_BLOCK={{ port_block }}
# The drivers' shared secret: their channel refuses any request without it.
export HFSCALE_SWEEP_TOKEN="$(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n')"
{% if resume %}export HFSCALE_RUN_DIR={{ run_dir_q }}
{% else %}export HFSCALE_RUN_DIR="${HFSCALE_RUN_DIR:-{{ run_dir_default }}}"
{% endif %}
# One driver per node, its machine rank from SLURM_NODEID. A node whose driver fails does not end the others:
# machine 0 records the failure as a row and finishes the sweep.
srun --nodes={{ nodes }} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=0 --wait=0 \\
  bash -c 'exec "$@" --machine-rank "$SLURM_NODEID"' hfscale-driver \\
  {{ driver }} \\
  --main-process-ip "$HFSCALE_MAIN_ADDR" --main-process-port "$HFSCALE_MAIN_PORT"
"""


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """A sweep on ``nodes`` nodes: what the sbatch script and the by-hand command lines run."""

    recipe: str
    """The recipe (a path every node sees, or a shipped recipe's name); with ``resume``, the run folder."""
    nodes: int
    """Nodes (machines); one driver on each."""
    gpus_per_node: int
    """GPUs to ask Slurm for on each node (0 for a CPU sweep)."""
    processes_per_node: int | None = None
    """Trial processes per node for trials that do not pin ``num_processes`` (default ``gpus_per_node``)."""
    resume: bool = False
    """``recipe`` is a run folder to complete (``hfscale sweep --resume``)."""
    run_dir: str | None = None
    """The run folder (default ``runs/NAME-$SLURM_JOB_ID``); must be on a filesystem every node sees."""
    job_name: str | None = None
    """Slurm's job name (default ``hfscale-NAME``)."""
    time: str | None = None
    """``#SBATCH --time``, e.g. ``04:00:00``."""
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    """CPU cores for each node's driver and its trial processes (default 8 per GPU, at least 4): without it Slurm
    gives one, and every data loader and tokenizer of the node shares it."""
    python: str = "python"
    """The interpreter on the nodes (one with hfscale installed)."""
    setup: tuple[str, ...] = ()
    """Lines run before the drivers start (``module load ...``, ``source venv/bin/activate``)."""
    sweep_args: tuple[str, ...] = ()
    """More ``hfscale sweep`` options for every driver (``--timeout-s 600``, ``--only NAME``, ...)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.processes_per_node is None and self.gpus_per_node == 0:
            raise ValueError("--gpus-per-node 0 (a CPU sweep) needs --processes-per-node N")
        if self.processes_per_node is not None and self.processes_per_node < 1:
            raise ValueError(f"--processes-per-node must be at least 1, got {self.processes_per_node}")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task must be at least 1, got {self.cpus_per_task}")
        if self.resume and self.run_dir is not None:
            raise ValueError("--run-dir with --resume: the run folder to resume is RECIPE itself")

    @property
    def name(self) -> str:
        """The recipe's (or run folder's) name, for the job and the run folder."""
        stem = Path(self.recipe.rstrip("/")).name
        return re.sub(r"[^A-Za-z0-9_.-]", "-", stem.removesuffix(".yaml").removesuffix(".yml")) or "sweep"

    @property
    def cpus(self) -> int:
        """``--cpus-per-task``: as given, else 8 per GPU, at least 4 (and one per trial process)."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        return max(4, 8 * self.gpus_per_node, self.processes_per_node or 0)

    @property
    def num_processes(self) -> int:
        return self.nodes * (self.processes_per_node or self.gpus_per_node)

    def driver_argv(self, run_dir: str) -> list[str]:
        """Every driver's command, less its machine rank and machine 0's address and port."""
        where = ["--resume", self.recipe] if self.resume else [self.recipe, "--run-dir", run_dir]
        return [
            self.python,
            "-m",
            "hfscale.sweep",
            *where,
            "--num-machines",
            str(self.nodes),
            "--num-processes",
            str(self.num_processes),
            *self.sweep_args,
        ]

    def node_commands(self, *, main_addr: str, port: int, run_dir: str | None = None) -> list[list[str]]:
        """One driver's command per node (node ``k`` is machine ``k``) for a cluster without Slurm: start them
        on the nodes in any order within ``--machine-wait-s``."""
        folder = self.recipe if self.resume else (run_dir or self.run_dir or f"runs/{self.name}")
        base = self.driver_argv(folder)
        return [
            [*base, "--machine-rank", str(k), "--main-process-ip", main_addr, "--main-process-port", str(port)]
            for k in range(self.nodes)
        ]

    def sbatch_script(self) -> str:
        """The sbatch script: headers, the setup lines, machine 0's address and port, and one ``srun`` that
        starts a driver per node."""
        import jinja2

        run_dir_default = self.run_dir or f"runs/{self.name}-$SLURM_JOB_ID"
        # The run folder is expanded by the script's shell (the job id), so it stays out of the quoted argv.
        driver = " ".join(shlex.quote(a) for a in self.driver_argv("@RUN_DIR@")).replace(
            shlex.quote("@RUN_DIR@"), '"$HFSCALE_RUN_DIR"'
        )
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
        return env.from_string(_SCRIPT).render(
            recipe=self.recipe,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            cpus_per_task=self.cpus,
            time=self.time,
            partition=self.partition,
            account=self.account,
            job_name=self.job_name or f"hfscale-{self.name}",
            setup=self.setup,
            port_base=PORT_BASE,
            port_jobs=PORT_JOBS,
            port_block=PORT_BLOCK,
            resume=self.resume,
            run_dir_q=shlex.quote(self.recipe),
            run_dir_default=run_dir_default,
            driver=driver,
        )


def _slurm_gpus(value: str | None) -> int:
    """``SLURM_GPUS_PER_NODE`` (``4``, ``h100:4``) as a count; 0 when it cannot be read."""
    match = re.search(r"(\d+)\s*$", value or "")
    return int(match.group(1)) if match else 0


def resume_command(
    run_dir: str | os.PathLike[str],
    *,
    num_machines: int = 1,
    num_processes: int | None = None,
    gpus_per_node: int = 0,
    main_addr: str | None = None,
    port: int | None = None,
    python: str = sys.executable,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """The command that continues a run folder, for a hint ("continue with: ..."): the one that works for its kind.

    One machine: ``hfscale sweep --resume RUN``. Several machines need every machine's driver again, each following
    machine 0, whose folder ``run_dir`` must be (machine ``k``'s own folder holds only its logs): under Slurm
    (``SLURM_JOB_ID`` set) a new job, ``hfscale slurm RUN --resume ...`` then ``sbatch``; by hand, each machine's
    driver command with ``--resume RUN`` (:meth:`SlurmJob.node_commands`, what ``hfscale slurm`` prints).

    Args:
        run_dir: machine 0's run folder (the one holding ``results.jsonl``).
        num_machines: machines of the sweep.
        num_processes: trial processes in all for trials that do not pin theirs (``--num-processes``); None: one
            per GPU.
        gpus_per_node: GPUs of each machine; Slurm's ``SLURM_GPUS_PER_NODE`` wins where it is set.
        main_addr: machine 0's address for the by-hand commands.
        port: the drivers' port for the by-hand commands (default 29500).
        python: the interpreter of the by-hand commands.
        environ: where ``SLURM_*`` variables are read.
    """
    if num_machines <= 1:
        return f"hfscale sweep --resume {shlex.quote(str(run_dir))}"
    gpus = _slurm_gpus(environ.get("SLURM_GPUS_PER_NODE")) if environ.get("SLURM_GPUS_PER_NODE") else gpus_per_node
    per_node = num_processes // num_machines if num_processes else (gpus or 1)
    job = SlurmJob(
        recipe=str(run_dir),
        nodes=num_machines,
        gpus_per_node=gpus,
        processes_per_node=None if per_node == gpus else per_node,
        resume=True,
        python=python,
    )
    if environ.get("SLURM_JOB_ID"):
        options = ["--resume", "--nodes", str(job.nodes), "--gpus-per-node", str(job.gpus_per_node)]
        if job.processes_per_node is not None:
            options += ["--processes-per-node", str(job.processes_per_node)]
        script = f"{job.name}-resume.sbatch"
        return (
            f"{shlex.join(['hfscale', 'slurm', str(run_dir), *options, '--out', script])} (with the first job's "
            f"--setup/--python/--partition options), then sbatch {script}"
        )
    commands = job.node_commands(main_addr=main_addr or "MAIN_HOST", port=port or 29500)
    return "every machine's driver again (in any order, within --machine-wait-s): " + "; ".join(
        f"machine {k}: {shlex.join(cmd)}" for k, cmd in enumerate(commands)
    )


__all__ = ["PORT_BASE", "PORT_BLOCK", "PORT_JOBS", "SlurmJob", "resume_command"]
