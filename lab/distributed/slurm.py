"""`python -m lab launch slurm`: the sbatch script that runs `lab.train` on N nodes of G GPUs each.

    python -m lab launch slurm --config configs/llama3-8b.toml --nodes 2 --gpus-per-node 8 \\
        --set parallel.dp=16 --partition gpu --checkpoint-dir ckpt --checkpoint-every 100 --max-restarts 2 \\
        --output llama3-8b.sbatch
    sbatch llama3-8b.sbatch

The script is the usual shape of a multi-node PyTorch job; each piece is there for a reason:

- `--ntasks-per-node=1`: Slurm starts one `torchrun` per node and torchrun starts the node's G ranks, one per
  GPU. (Slurm could start every rank itself, but then nothing would restart a failed one.)
- The first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"` hosts torchrun's c10d rendezvous, a TCP
  store: every node's torchrun meets there and is given its node rank, so no node has to be told its rank. The
  store is reached by the address that host gives for itself (`hostname --ip-address`, asked there through srun),
  not by its name, which other nodes may resolve to another interface or not at all; and on a port found free
  there when the job starts (`--port` fixes one), since a fixed 29500 collides with any other job's rendezvous on
  that host. `--rdzv-id $SLURM_JOB_ID` keeps two jobs whose first node is the same host apart.
- With `--checkpoint-dir`, `#SBATCH --signal=B:TERM@120` has Slurm send the script SIGTERM `--stop-before`
  seconds before `--time`. The script passes it to every rank (`scancel --signal=TERM`, which signals the job's
  steps), each ends its step, saves a checkpoint and exits (`lab.preemption`), and the script requeues the job
  (`#SBATCH --requeue`, its log appended to): the job starts again and `--resume` continues from that checkpoint.
  torchrun is told to give its ranks all but 30 s of that time before it kills them
  (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; it waits 30 s otherwise), which leaves those 30 s to requeue.
- `--max-restarts K`: when a rank fails, every node's torchrun stops its ranks and starts them again, up to K
  times; `--resume` makes them continue from the newest complete checkpoint (so does a resubmitted job), and
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE gives each attempt a store of its own (a shared one broke restarts).
- The NCCL and torch environment knobs (`KNOBS`), each with a comment saying what it does and when to change
  it; the ones that depend on the cluster's network are written commented out.

Nothing is left for the cluster to discover: the layout is checked before the script is written (the config's
dp x tp x cp x pp must equal nodes x GPUs per node), and a bad value is one `error:` line and exit status 2.

`array_script` writes the other shape a cluster needs: a job array of short runs, one per task, with the same
rendezvous and settings (`python -m lab sweep --launch slurm` measures a layout a task).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from lab.config import Config, check_supported, read_config

PROG = "python -m lab launch"
TIME = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$")  # [D-]HH:MM:SS, one of the forms sbatch accepts
FLIGHT_RECORDER_DIR = "flight-recorder"
STOP_MARGIN_S = 30  # of --stop-before: what the ranks get at least to checkpoint, and what is left to requeue
# A port the kernel calls free on the node that runs it: bind to port 0 and read which one it gave
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"

# (variable, value, what it does and when to change it, whether it is set). Those not set name what only the
# cluster knows (its adapters and interfaces) or are debugging switches: the script shows them commented out.
KNOBS: tuple[tuple[str, str, str, bool], ...] = (
    ("NCCL_DEBUG", "WARN", "NCCL's log level: WARN prints problems only; INFO also logs the network (IB or "
     "sockets) and adapters each rank chose: use it when a job does not start, or is slow, across nodes", True),
    ("NCCL_IB_HCA", "=mlx5_0,mlx5_1", "the InfiniBand/RoCE adapters NCCL may use (default: all): name the compute "
     "fabric's when nodes also have storage or management ones; '=' makes names exact (mlx5_1 alone would also "
     "match mlx5_10)", False),
    ("NCCL_SOCKET_IFNAME", "=ib0", "the IP interface NCCL bootstraps over (and sends data through when there is no "
     "IB): set it when NCCL picks a wrong one; '=ib0' is exactly ib0, '^docker,lo' anything but those", False),
    ("GLOO_SOCKET_IFNAME", "ib0", "the same for gloo groups (an --async-checkpoint saves over one): set it "
     "together with NCCL_SOCKET_IFNAME", False),
    ("NCCL_NET_GDR_LEVEL", "LOC", "up to which PCI distance a NIC reads and writes GPU memory directly (GPUDirect "
     "RDMA); NCCL picks it from the topology. A debugging switch: LOC (off) tests whether GPUDirect causes a hang "
     "or corruption; remove it afterwards", False),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "a failed or timed-out collective ends its process, so torchrun restarts "
     "the group instead of every rank waiting until --time; 3 skips NCCL's cleanup (which can hang too) and keeps "
     "the Flight Recorder's dump, which torchrun's own choice when this is unset, 1, loses. "
     "NCCL_ASYNC_ERROR_HANDLING is its deprecated name", True),
    ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1", "every restart of the group gets a fresh store for init_process_group; "
     "sharing torchrun's rendezvous store, a restarted rank can read the dead attempt's addresses and fail or hang "
     "(pytorch/pytorch#135712; seen with torch 2.13 and gloo)", True),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "torch's Flight Recorder: every rank keeps its last 2000 collectives "
     "(op, group, sequence number, sizes) in a ring buffer; 0 turns it off. torch >= 2.9 calls it "
     "TORCH_FR_BUFFER_SIZE and warns once that this name is old; this one works from torch 2.5", True),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "on a collective timeout every rank writes that buffer to a file; "
     f"torchfrtrace --prefix rank_ {FLIGHT_RECORDER_DIR}/JOBID reads them and names the ranks that diverged",
     True),
    ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f'"$PWD/{FLIGHT_RECORDER_DIR}/$SLURM_JOB_ID/rank_"', "where those files go: "
     "a shared folder, since the default, /tmp/nccl_trace_rank_, is on each node's own disk", True),
)


@dataclass(frozen=True)
class SlurmJob:
    """What the script needs; `main` fills it from the command line. Defaults are those of `--help`."""

    config: str
    nodes: int
    gpus_per_node: int
    overrides: tuple[str, ...] = ()  # `--set section.field=value`, checked here and passed on to lab.train
    cpus_per_task: int | None = None  # None: 8 per GPU
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None  # None: lab-<config file name>
    log: str = "%x-%j.out"  # sbatch's patterns: %x the job name, %j its id
    port: int | None = None  # None: a port free on the first node when the job starts
    stop_before: int = 120  # with checkpoints: SIGTERM this many seconds before --time, then checkpoint and requeue
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep: int = 0
    async_checkpoint: bool = False

    @property
    def cpus(self) -> int:
        return 8 * self.gpus_per_node if self.cpus_per_task is None else self.cpus_per_task

    @property
    def name(self) -> str:
        return self.job_name or f"lab-{Path(self.config).stem}"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_time(text: str) -> bool:
    """A time limit sbatch accepts as [D-]HH:MM:SS, and longer than zero."""
    match = TIME.match(text)
    if match is None:
        return False
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return minutes < 60 and seconds < 60 and (match[1] is None or hours < 24) and days + hours + minutes + seconds > 0


def _seconds(text: str) -> int:
    """The seconds of a time limit `_is_time` accepts."""
    days, hours, minutes, seconds = (int(group or 0) for group in TIME.match(text).groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def check_values(job: SlurmJob) -> None:
    """Every flag's range, as one line naming the value: a script with a bad one would fail on the cluster, after
    waiting in the queue."""
    for flag, value, low in (("--nodes", job.nodes, 1), ("--gpus-per-node", job.gpus_per_node, 1),
                             ("--max-restarts", job.max_restarts, 0), ("--keep", job.keep, 0),
                             ("--checkpoint-every", job.checkpoint_every, 0)):
        _require(value >= low, f"{flag}={value} must be an integer >= {low}")
    _require(job.cpus >= job.gpus_per_node,
             f"--cpus-per-task={job.cpus} must be >= --gpus-per-node={job.gpus_per_node} (a core per rank at least)")
    _require(job.port is None or 1024 <= job.port <= 65535,
             f"--port={job.port} must be in 1024-65535 (the rendezvous' TCP port)")
    _require(_is_time(job.time), f"--time={job.time!r} must be [D-]HH:MM:SS with minutes and seconds 00-59 (hours "
                                 f"00-23 after days), e.g. 24:00:00 or 2-00:00:00")
    limit = _seconds(job.time)
    _require(2 * STOP_MARGIN_S <= job.stop_before < limit,
             f"--stop-before={job.stop_before} must be in {2 * STOP_MARGIN_S}-{limit - 1} (seconds before --time="
             f"{job.time}: at least {STOP_MARGIN_S} for the ranks to checkpoint and {STOP_MARGIN_S} to requeue)")
    for flag, value in (("--partition", job.partition), ("--account", job.account), ("--job-name", job.job_name),
                        ("--log", job.log)):
        _require(value is None or re.fullmatch(r"\S+", value) is not None,
                 f"{flag}={value!r} must be one word, without spaces (it is written on an #SBATCH line)")
    if job.checkpoint_dir is None:
        _require(not (job.checkpoint_every or job.keep or job.async_checkpoint),
                 "--checkpoint-every, --keep and --async-checkpoint need --checkpoint-dir")
    _require(not job.max_restarts or (job.checkpoint_dir is not None and job.checkpoint_every > 0),
             f"--max-restarts={job.max_restarts} needs --checkpoint-dir and --checkpoint-every N: a restarted group "
             f"resumes from the newest checkpoint, and without one it starts over at step 0")


def _config(job: SlurmJob, *more: str) -> Config:
    """The run config as lab.train will read it (file, then `--set`s), validated and runnable."""
    config = Config.from_dict(read_config(job.config, [*job.overrides, *more]))
    check_supported(config)
    return config


def check_layout(job: SlurmJob) -> tuple[Config, list[str]]:
    """The run config and the warnings to write into the script. The layout must fill the allocation exactly;
    the refusal names both products and what would fit."""
    config = _config(job)
    p, world = config.parallel, job.nodes * job.gpus_per_node
    if p.world_size != world:
        fits = [f"--nodes {p.world_size // job.gpus_per_node}"] if p.world_size % job.gpus_per_node == 0 else []
        dp = world // (p.tp * p.cp * p.pp)
        if dp * p.tp * p.cp * p.pp == world:
            try:
                _config(job, f"parallel.dp={dp}")
                fits.append(f"--set parallel.dp={dp}")
            except ValueError:  # e.g. that dp does not divide the global batch
                pass
        valid = " or ".join(fits) if fits else f"a config whose dp*tp*cp*pp is {world}"
        raise ValueError(f"dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp} = {p.world_size} ranks, but --nodes * "
                         f"--gpus-per-node = {job.nodes}*{job.gpus_per_node} = {world} GPUs: use {valid}")
    warnings = []
    if job.gpus_per_node % p.tp:
        # Warned, not refused: where NVLink spans nodes (GB200 NVL72: 4 GPUs a Slurm node, 72 in one NVLink
        # domain) TP across nodes is right. Elsewhere every layer's TP collectives cross the slower network.
        where = "spans nodes" if p.tp > job.gpus_per_node else "straddles two nodes"
        warnings.append(f"warning: tp={p.tp} does not divide --gpus-per-node={job.gpus_per_node}, so a TP group "
                        f"{where} and every layer's TP collectives cross the inter-node network unless NVLink spans "
                        f"nodes (TP across nodes: see chapter 04)")
    return config, warnings


def train_args(job: SlurmJob) -> list[str]:
    """`lab.train`'s arguments. With checkpoints it always passes --resume: a restarted group and a resubmitted
    job then continue from the newest complete checkpoint (a first run, with none, starts at step 0)."""
    args = ["--config", job.config]
    for override in job.overrides:
        args += ["--set", override]
    if job.checkpoint_dir is not None:
        args += ["--checkpoint-dir", job.checkpoint_dir]
        args += ["--checkpoint-every", str(job.checkpoint_every)] if job.checkpoint_every else []
        args += ["--keep", str(job.keep)] if job.keep else []
        args += ["--async-checkpoint"] if job.async_checkpoint else []
        args += ["--resume"]
    return args


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=116, initial_indent="# ", subsequent_indent="# ")


def sbatch_script(job: SlurmJob, command: str | None = None) -> tuple[str, list[str]]:
    """The batch script and its warnings (also in it, as comments); ValueError, one line, if a value is bad.
    `command`, the line that wrote the script, is recorded at its top so that it can be written again."""
    check_values(job)
    config, warnings = check_layout(job)
    p = config.parallel
    sbatch = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={job.gpus_per_node}", f"--cpus-per-task={job.cpus}", f"--time={job.time}"]
    sbatch += [f"--partition={job.partition}"] if job.partition else []
    sbatch += [f"--account={job.account}"] if job.account else []
    sbatch += [f"--output={job.log}"]
    if job.checkpoint_dir is not None:  # SIGTERM before --time: checkpoint, requeue, resume (`_stop_and_requeue`)
        sbatch += [f"--signal=B:TERM@{job.stop_before}", "--requeue", "--open-mode=append"]
    shared = (f" {job.checkpoint_dir} must be on a filesystem every node sees: each rank writes its own part of "
              f"a checkpoint, and a resume may read any." if job.checkpoint_dir is not None else "")
    lines = ["#!/bin/bash", *([f"# Written by: {command}"] if command else []),
             *_comment("Submit it with `sbatch FILE` from the directory the paths below are relative to: the job "
                       "starts there, with the submitting shell's environment (activate the one that has lab)."
                       + shared),
             *(f"#SBATCH {line}" for line in sbatch), "",
             "set -eu", "",
             f"# Layout: dp={p.dp} x tp={p.tp} x cp={p.cp} x pp={p.pp} = {p.world_size} ranks = {job.nodes} nodes x "
             f"{job.gpus_per_node} GPUs.", *(line for warning in warnings for line in _comment(warning)), ""]
    lines.append("# NCCL and torch settings: what each does, and when to change it.")
    for variable, value, what, enabled in KNOBS:
        lines += [*_comment(what), f"{'' if enabled else '# '}export {variable}={value}"]
    lines += [f'mkdir -p "{FLIGHT_RECORDER_DIR}/$SLURM_JOB_ID"',
              *_comment(f"CPU threads for each rank's CPU work: the node's {job.cpus} cores over its "
                        f"{job.gpus_per_node} ranks (torchrun would set 1)"),
              f"export OMP_NUM_THREADS={max(1, job.cpus // job.gpus_per_node)}", "", *_rendezvous(job)]
    stops = job.checkpoint_dir is not None
    lines += [*(_stop_and_requeue(job) if stops else []),
              *_comment("One torchrun per node, each starting one rank per GPU. srun takes --cpus-per-task again "
                        "(since Slurm 22.05 it does not inherit sbatch's); --kill-on-bad-exit stops every node once "
                        "one node's torchrun has given up." + (" In the background, for the trap above to run while "
                                                               "it does." if stops else ""))]
    torchrun = [f"srun --cpus-per-task={job.cpus} --kill-on-bad-exit=1 torchrun", '--nnodes "$SLURM_NNODES"',
                f"--nproc-per-node {job.gpus_per_node}", "--rdzv-backend c10d",
                '--rdzv-endpoint "$HEAD_ADDR:$PORT"', '--rdzv-id "$SLURM_JOB_ID"']
    torchrun += [f"--max-restarts {job.max_restarts}"] if job.max_restarts else []
    torchrun += ["-m lab.train " + shlex.join(train_args(job))]
    lines.append(" \\\n    ".join(torchrun) + (" &" if stops else ""))
    lines += ["STEP=$!", 'wait "$STEP"'] if stops else []
    return "\n".join(lines) + "\n", warnings


def _rendezvous(job: SlurmJob) -> list[str]:
    """The lines that find the rendezvous' host, its address and a port, before torchrun starts."""
    port = (f"PORT={job.port}" if job.port is not None else
            f'PORT=$(srun --nodes=1 --ntasks=1 -w "$HEAD" python -c "{FREE_PORT}")')
    return ["# The first node hosts the c10d rendezvous: every node's torchrun meets there and gets its node rank.",
            'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            *_comment("Reached by the address it gives itself, asked there: its name may resolve to another interface "
                      "(or not at all) on the other nodes."),
            'HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | cut -d " " -f 1)',
            *_comment("On a port free there now: a fixed one (29500) collides with another job's rendezvous on the "
                      "same node." if job.port is None else "On the port --port fixed."),
            port, ""]


def _stop_and_requeue(job: SlurmJob) -> list[str]:
    """What the script does when Slurm sends it SIGTERM `stop_before` seconds before --time (`--signal=B:TERM@N`,
    this script only): pass SIGTERM to every rank, which saves a checkpoint at the end of its step and exits
    (lab.preemption), wait for them, and requeue the job, which resumes. The launch (`$STEP`) follows."""
    return [*_comment(f"torchrun gives its ranks {job.stop_before - STOP_MARGIN_S} s to checkpoint and exit after "
                      f"a SIGTERM before it kills them (it waits 30 s unless told), leaving {STOP_MARGIN_S} s to "
                      "requeue the job."),
            f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={job.stop_before - STOP_MARGIN_S}",
            *_comment(f"Slurm sends this script SIGTERM {job.stop_before} s before --time. scancel --signal passes "
                      "it to the job's steps (every torchrun and rank, not this script); each rank ends its step, "
                      "saves a checkpoint and exits. Then the job is requeued: it starts again from the top, and "
                      "lab.train --resume continues from that checkpoint."),
            "stop_and_requeue() {",
            "    trap '' TERM",
            f'    echo "lab: --time ends in {job.stop_before} s: the ranks checkpoint and stop; the job is requeued"',
            '    scancel --signal=TERM "$SLURM_JOB_ID"',
            '    wait "$STEP" || true',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "    exit 0",
            "}",
            "trap stop_and_requeue TERM"]


def torchrun_command(job: SlurmJob, train: list[str]) -> str:
    """The launch of one `lab.train` run over the job's nodes, with `train` as its arguments: one torchrun per
    node (srun), each starting a rank per GPU, meeting at the rendezvous `_rendezvous` found. The line
    `sbatch_script` writes, without its restarts: for the short runs of a sweep (`array_script`)."""
    torchrun = [f"srun --cpus-per-task={job.cpus} --kill-on-bad-exit=1 torchrun", '--nnodes "$SLURM_NNODES"',
                f"--nproc-per-node {job.gpus_per_node}", "--rdzv-backend c10d",
                '--rdzv-endpoint "$HEAD_ADDR:$PORT"', '--rdzv-id "$SLURM_JOB_ID"', "-m lab.train " + shlex.join(train)]
    return " \\\n    ".join(torchrun)


def array_script(job: SlurmJob, tasks: list[list[str]], command: str | None = None, at_once: int = 1) -> str:
    """A Slurm job array whose task i runs `lab.train` with `tasks[i]` as its arguments on `job`'s nodes: a sweep
    of short runs, a layout a task (`python -m lab sweep --launch slurm`). Each task is a job of its own (its own
    allocation, rendezvous and job id); `at_once` of them run at a time, one by default, so that the layouts are
    measured one after another rather than sharing the network. No checkpoints, restarts or requeues: a sweep's
    runs last minutes. The caller checks each task's layout (`check_layout` with that task's overrides)."""
    check_values(job)
    _require(tasks, "a job array needs at least one task")
    _require(at_once >= 1, f"at_once={at_once} must be >= 1 (array tasks running at a time)")
    sbatch = [f"--job-name={job.name}", f"--array=0-{len(tasks) - 1}%{at_once}", f"--nodes={job.nodes}",
              "--ntasks-per-node=1", f"--gpus-per-node={job.gpus_per_node}", f"--cpus-per-task={job.cpus}",
              f"--time={job.time}"]
    sbatch += [f"--partition={job.partition}"] if job.partition else []
    sbatch += [f"--account={job.account}"] if job.account else []
    sbatch += [f"--output={job.log}"]
    lines = ["#!/bin/bash", *([f"# Written by: {command}"] if command else []),
             *_comment(f"Submit it with `sbatch FILE` from the directory the paths below are relative to, in the "
                       f"environment that has lab. Task i of the array (0-{len(tasks) - 1}) runs run i on "
                       f"{job.nodes} node(s) of {job.gpus_per_node} GPUs; %A in the log's name is the array's "
                       f"job id, %a the task."),
             *(f"#SBATCH {line}" for line in sbatch), "", "set -eu", "",
             "# NCCL and torch settings: what each does, and when to change it."]
    for variable, value, what, enabled in KNOBS:
        lines += [*_comment(what), f"{'' if enabled else '# '}export {variable}={value}"]
    lines += [f'mkdir -p "{FLIGHT_RECORDER_DIR}/$SLURM_JOB_ID"',
              f"export OMP_NUM_THREADS={max(1, job.cpus // job.gpus_per_node)}", "", *_rendezvous(job),
              'case "$SLURM_ARRAY_TASK_ID" in']
    for i, train in enumerate(tasks):
        lines += [f"{i})", torchrun_command(job, train), "    ;;"]
    lines += ['*) echo "lab: no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


class _OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line (argparse's default adds the usage), reported by `main` like any ValueError."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="write a batch script that runs lab.train on a cluster")
    kinds = parser.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser("slurm", help="an sbatch script: torchrun on every node, c10d rendezvous, NCCL settings",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="TOML run config; its dp*tp*cp*pp must equal nodes x GPUs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, checked here and passed on to lab.train (repeatable)")
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate: one torchrun each")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs on each node: one rank each")
    p.add_argument("--cpus-per-task", type=int, help="CPU cores per node for its ranks (default: 8 per GPU)")
    p.add_argument("--time", default="24:00:00", help="the job's time limit, [D-]HH:MM:SS (default 24:00:00)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", help="default: lab-<config file name>")
    p.add_argument("--log", default="%x-%j.out", help="the job's output file (default %%x-%%j.out: name-jobid.out)")
    p.add_argument("--port", type=int, help="the rendezvous' TCP port on the first node (default: one found free "
                   "there when the job starts)")
    p.add_argument("--stop-before", type=int, default=120, metavar="SECONDS", help="with --checkpoint-dir: Slurm "
                   "sends SIGTERM this long before --time; the ranks checkpoint and stop, the job requeues (120)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole group after a failure "
                   "(torchrun's); needs --checkpoint-dir and --checkpoint-every")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="passed to lab.train, with --resume")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="passed to lab.train")
    p.add_argument("--keep", type=int, default=0, metavar="K", help="passed to lab.train")
    p.add_argument("--async-checkpoint", action="store_true", help="passed to lab.train")
    p.add_argument("--output", metavar="FILE", help="write the script to FILE instead of printing it")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = vars(build_parser().parse_args(argv))
        output = args.pop("output")
        del args["kind"]
        script, warnings = sbatch_script(SlurmJob(**{**args, "overrides": tuple(args["overrides"])}),
                                         command=f"{PROG} {shlex.join(argv)}")
        if output is not None:
            Path(output).write_text(script)
    except (ValueError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"{PROG}: {warning}", file=sys.stderr)
    if output is None:
        print(script, end="")
    else:
        print(f"wrote {output}; submit it with: sbatch {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
