"""`python -m lab launch slurm`: the sbatch script read as text (there is no Slurm here), the flags it hands to
torchrun and lab.train read back by their own parsers, its refusals, and bash's syntax check of the file.

Everything runs in-process (`lab.__main__.main`): the command line is what is tested, not Python's start-up.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.__main__ import main as lab_main
from lab.distributed.slurm import KNOBS, SlurmJob, sbatch_script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "llama3-8b.toml")  # dp=8, zero=3, global batch 16: one node of 8 GPUs
VALID = ["launch", "slurm", "--config", CONFIG, "--nodes", "1", "--gpus-per-node", "8"]


@pytest.fixture(scope="module")
def script_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two nodes of 8 GPUs (dp 16), with checkpoints and restarts, written by the command line to a file."""
    path = tmp_path_factory.mktemp("slurm") / "llama3-8b.sbatch"
    assert lab_main(["launch", "slurm", "--config", CONFIG, "--nodes", "2", "--gpus-per-node", "8",
                     "--set", "parallel.dp=16", "--partition", "gpu", "--account", "proj", "--time", "2-00:00:00",
                     "--checkpoint-dir", "ckpt", "--checkpoint-every", "50", "--max-restarts", "2",
                     "--output", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def script(script_path: Path) -> str:
    return script_path.read_text()


def launch_command(script: str) -> list[str]:
    """The `srun ... torchrun ...` command as the shell splits it (continuation lines joined; what follows a
    launch in the background left out)."""
    start = script.index("\nsrun ")
    return shlex.split(script[start:].split(" &\n")[0].replace("\\\n", " "))


def test_sbatch_lines(script):
    assert [line for line in script.splitlines() if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=lab-llama3-8b", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --output=%x-%j.out",
        "#SBATCH --signal=B:TERM@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    assert script.startswith("#!/bin/bash\n")
    assert "# Layout: dp=16 x tp=1 x cp=1 x pp=1 = 16 ranks = 2 nodes x 8 GPUs." in script
    assert "warning" not in script  # tp=1 stays on a node


def test_torchrun_rendezvous_on_the_first_node(script):
    assert '\nHEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n' in script
    command = launch_command(script)
    assert command[:command.index("torchrun")] == ["srun", "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    from torch.distributed.run import get_args_parser  # torchrun's own parser: no flag of ours is invented

    torchrun = get_args_parser().parse_args(command[command.index("torchrun") + 1:])
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("$SLURM_NNODES", "8")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("c10d", "$HEAD_ADDR:$PORT",
                                                                                  "$SLURM_JOB_ID")
    assert '\nHEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | cut -d " " -f 1)\n' in script
    assert '\nPORT=$(srun --nodes=1 --ntasks=1 -w "$HEAD" python -c "import socket;' in script  # free there, now
    assert torchrun.max_restarts == 2 and torchrun.module and torchrun.training_script == "lab.train"
    from lab.train import build_parser  # and lab.train's: the flags it is handed exist and mean what we think

    train = build_parser().parse_args(torchrun.training_script_args)
    assert (train.config, train.set, train.checkpoint_dir, train.checkpoint_every, train.resume) == (
        CONFIG, ["parallel.dp=16"], "ckpt", 50, True)


def test_every_knob_is_explained(script):
    lines = script.splitlines()
    for variable, _, _, enabled in KNOBS:
        export = next(i for i, line in enumerate(lines) if line.lstrip("# ").startswith(f"export {variable}="))
        assert lines[export].startswith("export" if enabled else "# export"), variable
        assert lines[export - 1].startswith("# ") and "export" not in lines[export - 1], f"{variable} unexplained"
    exported = {line.split("=")[0].split()[-1] for line in lines if line.startswith("export ")}
    assert exported == {"NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                        "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "OMP_NUM_THREADS",
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    assert "\nexport OMP_NUM_THREADS=8\n" in script and "\nexport TORCH_NCCL_ASYNC_ERROR_HANDLING=3\n" in script
    # without it a restarted group can read the dead attempt's addresses from torchrun's store (torch 2.13: the
    # restarted lab.train failed in init_process_group; with it, it resumed and ended on the uninterrupted losses)
    assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_NET_GDR_LEVEL"} <= {k[0] for k in KNOBS}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_accepts_the_script(script_path):
    done = subprocess.run(["bash", "-n", str(script_path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_prints_the_script_without_output(capsys):
    assert lab_main(VALID) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --nodes=1\n" in out and "--nproc-per-node 8 " in out
    assert "--max-restarts" not in out and "--resume" not in out  # neither asked for
    assert "--signal" not in out and "stop_and_requeue" not in out  # no checkpoint to stop with
    assert lab_main([*VALID, "--port", "29600"]) == 0
    assert "\nPORT=29600\n" in capsys.readouterr().out


def test_sigterm_before_the_time_limit_checkpoints_and_requeues(script):
    assert "#SBATCH --signal=B:TERM@120\n#SBATCH --requeue\n#SBATCH --open-mode=append\n" in script
    assert "\nexport TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90\n" in script  # 120 s less 30 to requeue
    assert "\ntrap stop_and_requeue TERM\n" in script and script.endswith(' --resume &\nSTEP=$!\nwait "$STEP"\n')


def refusal(capsys, argv: list[str]) -> str:
    assert lab_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("python -m lab launch: error: ")
    return captured.err


def test_layout_that_does_not_fill_the_nodes_is_refused(capsys):
    err = refusal(capsys, [*VALID, "--nodes", "2"])
    assert "dp*tp*cp*pp = 8*1*1*1 = 8 ranks, but --nodes * --gpus-per-node = 2*8 = 16 GPUs" in err
    assert "use --nodes 1 or --set parallel.dp=16" in err
    # 32 GPUs: dp=32 would not divide the global batch of 16, so only the node count is offered
    assert err_tail(refusal(capsys, [*VALID, "--nodes", "4"])) == "use --nodes 1"


def err_tail(err: str) -> str:
    return err.strip().rsplit(": ", 1)[1]


@pytest.mark.parametrize("flags, says", [
    (["--nodes", "0"], "--nodes=0 must be an integer >= 1"),
    (["--gpus-per-node", "eight"], "argument --gpus-per-node: invalid int value: 'eight'"),
    (["--cpus-per-task", "4"], "--cpus-per-task=4 must be >= --gpus-per-node=8"),
    (["--time", "24:60:00"], "--time='24:60:00' must be [D-]HH:MM:SS"),
    (["--time", "1-24:00:00"], "--time='1-24:00:00' must be"),
    (["--time", "00:00:00"], "--time='00:00:00' must be"),
    (["--port", "80"], "--port=80 must be in 1024-65535"),
    (["--stop-before", "30"], "--stop-before=30 must be in 60-86399 (seconds before --time=24:00:00: at least 30"),
    (["--stop-before", "3600", "--time", "01:00:00"], "--stop-before=3600 must be in 60-3599"),
    (["--partition", "gpu a100"], "--partition='gpu a100' must be one word"),
    (["--max-restarts", "-1"], "--max-restarts=-1 must be an integer >= 0"),
    (["--max-restarts", "1"], "--max-restarts=1 needs --checkpoint-dir and --checkpoint-every N"),
    (["--max-restarts", "1", "--checkpoint-dir", "ckpt"], "--max-restarts=1 needs --checkpoint-dir and"),
    (["--keep", "2"], "--checkpoint-every, --keep and --async-checkpoint need --checkpoint-dir"),
    (["--config", "configs/none.toml"], "config file 'configs/none.toml' does not exist"),
    (["--set", "parallel.pp=2", "--set", "parallel.dp=4"], "lab.train does not run zero>=2 with pp"),
])
def test_bad_values_are_one_line(capsys, flags, says):
    assert says in refusal(capsys, [*VALID, *flags])


def test_tp_across_nodes_is_a_warning_in_the_script():
    job = SlurmJob(CONFIG, nodes=2, gpus_per_node=8,
                   overrides=("parallel.tp=16", "parallel.dp=1", "parallel.zero=0"))
    text, warnings = sbatch_script(job)
    assert len(warnings) == 1 and "tp=16 does not divide --gpus-per-node=8" in warnings[0]
    assert "see chapter 04" in warnings[0] and "# warning: tp=16 does not divide" in text
    assert not sbatch_script(SlurmJob(CONFIG, nodes=2, gpus_per_node=8,
                                      overrides=("parallel.tp=8", "parallel.dp=2", "parallel.zero=0")))[1]


def test_lab_help_lists_launch(capsys):
    assert lab_main(["--help"]) == 0
    assert "  launch " in capsys.readouterr().out


def test_readme_shows_what_its_command_writes(capsys, monkeypatch):
    section = (ROOT / "README.md").read_text().split("## Multi-node with Slurm\n", 1)[1]
    command_block, script_block = re.findall(r"```bash\n(.*?)```", section, re.S)[:2]
    command, submit = command_block.replace("\\\n", " ").splitlines()[:2]
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "lab", "launch"] and submit == f"sbatch {argv[argv.index('--output') + 1]}"
    del argv[argv.index("--output"):argv.index("--output") + 2]
    monkeypatch.chdir(ROOT)  # the README's config path is relative to the repository
    assert lab_main(argv[3:]) == 0
    written = capsys.readouterr().out.splitlines()
    missing = [line for line in script_block.splitlines() if line not in written]
    assert not missing, f"README shows lines its command does not write: {missing}"


STUBS = {  # Slurm's commands as this test needs them: each logs its call, then does the least that is real
    "scontrol": 'case "$1 $2" in "show hostnames") printf "node-a\\nnode-b\\n";; esac',
    "srun": 'while [ $# -gt 0 ]; do case "$1" in -w) shift 2;; -*) shift;; *) break;; esac; done\nexec "$@"',
    "hostname": 'echo "10.1.2.3 172.17.0.1"',
    # one node, one rank: lab.train itself, in the process srun started (so scancel can signal it)
    "torchrun": 'echo $$ > "$STUBS/rank.pid"\nwhile [ "$1" != "-m" ]; do shift; done\nexec python "$@"',
    "scancel": 'kill -TERM "$(cat "$STUBS/rank.pid")"',
}


def _stubbed_job(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The script of a tiny run with checkpoints, and an environment in which srun, scontrol, scancel, torchrun and
    hostname are the stubs above and the job is JOBID 77 on node-a and node-b."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "$STUBS/calls"\n{body}\n')
        (stubs / name).chmod(0o755)
    (stubs / "python").write_text(f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')  # this virtualenv's
    (stubs / "python").chmod(0o755)
    script = tmp_path / "tiny.sbatch"
    assert lab_main(["launch", "slurm", "--config", str(ROOT / "configs" / "tiny.toml"), "--nodes", "1",
                     "--gpus-per-node", "1", "--cpus-per-task", "1", "--set", "model.n_layers=2",
                     "--set", "train.steps=12", "--checkpoint-dir", "ckpt", "--output", str(script)]) == 0
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUBS": str(stubs),
           "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "1"}
    return script, env


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_the_script_checkpoints_on_sigterm_requeues_and_the_requeued_job_resumes(tmp_path):
    """The script run by bash with stubbed Slurm commands: the rendezvous is the head node's address and a free
    port; SIGTERM to the script (Slurm's --signal=B:TERM) reaches lab.train, which checkpoints its step and exits
    143; the script requeues the job; run again, as the requeued job is, it resumes there and finishes."""
    script, env = _stubbed_job(tmp_path)
    out = tmp_path / "job.out"
    with out.open("w") as log:
        job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"step +2/12", out.read_text()):  # mid-run
            assert job.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=240) == 0, out.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text, calls = out.read_text(), (tmp_path / "stubs" / "calls").read_text().splitlines()
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+): checkpoint", text)[1])
    assert 2 <= stopped < 12 and os.listdir(tmp_path / "ckpt") == [f"step-{stopped:08d}"]
    assert "scancel --signal=TERM 77" in calls and calls[-1] == "scontrol requeue 77"
    endpoint = next(c for c in calls if c.startswith("torchrun ")).split("--rdzv-endpoint ")[1].split()[0]
    address, port = endpoint.split(":")
    assert address == "10.1.2.3" and 1024 <= int(port) <= 65535 and port != "29500"
    again = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"step-{stopped:08d}" in again.stdout and f"for {12 - stopped} steps" in again.stdout
    assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == "step-00000012"
    assert (tmp_path / "stubs" / "calls").read_text().count("requeue") == 1  # it finished: no second requeue
