"""`python -m lab sweep`: a real local sweep (tiny model, 2 gloo ranks, 3 steps, two layouts) read back from its
logs; the refusals, before any rank starts; the Slurm job array read by torchrun's and lab.train's own parsers;
`--collect` on logs written as lab.train writes them; the search's top k.

Everything runs in-process (`lab.__main__.main`): the command line is what is tested, not Python's start-up.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest

import lab.trainer
from lab import sweep
from lab.__main__ import main as lab_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
TERMS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """dp=2 and tp=2 on two local gloo ranks, 3 steps each, the first not timed."""
    out = tmp_path_factory.mktemp("sweep") / "local"
    assert lab_main(["sweep", "--config", TINY, "--nproc", "2", "--layout", "dp=2", "--layout", "tp=2",
                     "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    return out, json.loads((out / sweep.RESULT).read_text())


def test_the_json_has_every_field(local):
    out, result = local
    assert (result["ranks"], result["steps"], result["warmup"], result["system"]) == (2, 3, 1, "cpu")
    assert result["compared"] == 2 and abs(result["spearman"]) == pytest.approx(1.0)  # two layouts: agree or not
    assert [r["spec"] for r in result["layouts"]] == ["dp=2", "dp=1,tp=2"]
    for row in result["layouts"]:
        assert row["status"] == "measured" and row["note"].startswith("modelled as ")
        p, m = row["predicted"], row["measured"]
        assert set(TERMS) <= set(p["split_s"]) and p["split_s"]["total"] == pytest.approx(p["step_s"])
        assert p["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / p["step_s"]) and p["memory_bytes"] > 0
        assert m["step_s"] > 0 and m["tokens_per_s"] > 0 and m["steps_timed"] == 2
        assert m["peak_bytes"] is None and row["memory_ratio"] is None  # a CPU reports no peak memory
        assert row["ratio"] == pytest.approx(m["step_s"] / p["step_s"])
        assert {row["rank_predicted"], row["rank_measured"]} <= {1.0, 2.0}
    assert result["layouts"][1]["parallel"]["tp"] == 2 and result["layouts"][1]["sets"][:2] == ["parallel.dp=1",
                                                                                              "parallel.tp=2"]
    assert (out / sweep.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plot"] == sweep.PLOT
    table = sweep.table(result)
    assert "dp=1,tp=2" in table and "Spearman's rho of the two rankings (step time), 2 layouts" in table


def test_measured_values_come_from_the_runs_logs(local):
    """The median of rank 0's logged steps after the warm-up, not the model's number: a sweep that copied the
    prediction into the measurement, or timed the warm-up step, fails here."""
    out, result = local
    for row in result["layouts"]:
        logged = [json.loads(line) for line in (out / row["log"]).read_text().splitlines()]
        assert [s["step"] for s in logged] == [1, 2, 3]
        times = [result["tokens_per_step"] / s["tokens_per_s"] for s in logged[1:]]
        assert row["measured"]["step_times_s"] == pytest.approx(times)
        assert row["measured"]["step_s"] == pytest.approx(statistics.median(times))
        assert row["measured"]["final_loss"] == logged[-1]["loss"]
        assert row["measured"]["step_s"] != pytest.approx(row["predicted"]["step_s"], rel=1e-3)
    torchrun = (out / sweep.TORCHRUN).read_text().splitlines()
    assert len(torchrun) == 2 and torchrun[1].startswith("torchrun --standalone --nproc-per-node 2 -m lab.train ")
    assert "--set parallel.tp=2" in torchrun[1] and f"--log-json {out / result['layouts'][1]['log']}" in torchrun[1]


@pytest.mark.parametrize(("flags", "says"), [
    (["--layout", "dp=2,foo=1"], "--layout 'dp=2,foo=1': unknown key 'foo'; valid keys: dp, tp, sp,"),
    (["--layout", "dp=2", "--layout", "dp=4"], "--layout 'dp=4': dp*tp*cp*pp = 4*1*1*1 = 4, but --nproc=2"),
    (["--layout", "tp=3"], "--layout 'tp=3': tp*cp*pp must be integers dividing --nproc=2"),
    (["--layout", "tp"], "--layout 'tp': 'tp' is not key=value"),
    (["--layout", "pp=2,pp_schedule=zb-h1,recompute=full,grad_accum=2"],
     "--layout 'pp=2,pp_schedule=zb-h1,recompute=full,grad_accum=2': lab.train does not run zero-bubble with"),
    (["--layout", "dp=2", "--steps", "2"], "--steps=2 must be >= 3 (more than --warmup)"),
    ([], "say which layouts: --top K"),
    (["--layout", "dp=2", "--launch", "slurm", "--gpus-per-node", "3"], "--nproc=2 must be a multiple of"),
])
def test_bad_input_is_one_line_before_any_rank_starts(flags, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lab.trainer, "run", lambda *a, **k: pytest.fail("a rank started"))
    out = tmp_path / "out"
    assert lab_main(["sweep", "--config", TINY, "--nproc", "2", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m lab sweep: error: {says}") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # nothing written either


def test_an_unwritable_out_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lab.trainer, "run", lambda *a, **k: pytest.fail("a rank started"))
    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert lab_main(["sweep", "--config", TINY, "--nproc", "2", "--layout", "dp=2", "--out", str(a_file)]) == 2
    assert capsys.readouterr().err == (f"python -m lab sweep: error: --out {a_file}: not a directory (a file is "
                                       f"there)\n")
    assert lab_main(["sweep", "--collect", str(tmp_path)]) == 2
    assert "no plan.json there" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layouts on 2 nodes of 2 GPUs, written as a Slurm job array (nothing runs)."""
    out = tmp_path_factory.mktemp("sweep") / "cluster"
    assert lab_main(["sweep", "--config", TINY, "--set", "train.lr=0.002", "--nproc", "4", "--gpus-per-node", "2",
                     "--layout", "dp=4", "--layout", "dp=2,tp=2", "--steps", "5", "--launch", "slurm",
                     "--partition", "gpu", "--out", str(out)]) == 0
    return out


def task_commands(script: str) -> dict[int, list[str]]:
    """Each array task's command as the shell splits it: the branch of the `case` on the task id."""
    body = script[script.index('case "$SLURM_ARRAY_TASK_ID" in\n'):script.index("\nesac\n")]
    branches = re.findall(r"\n(\d+)\)\n(.*?)\n    ;;", body, re.S)
    return {int(i): shlex.split(command.replace("\\\n", " ")) for i, command in branches}


def test_the_slurm_job_array_runs_a_layout_a_task(cluster):
    from torch.distributed.run import get_args_parser  # torchrun's own parser: no flag of ours is invented

    from lab.train import build_parser, config_from_args

    plan, script = json.loads((cluster / sweep.PLAN).read_text()), (cluster / sweep.SBATCH).read_text()
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[:3] == ["#SBATCH --job-name=lab-sweep-tiny", "#SBATCH --array=0-1%1", "#SBATCH --nodes=2"]
    assert "#SBATCH --gpus-per-node=2" in sbatch and "#SBATCH --partition=gpu" in sbatch
    assert f"#SBATCH --output={cluster / 'logs' / 'slurm-%A_%a.out'}" in sbatch
    tasks = task_commands(script)
    assert sorted(tasks) == [0, 1] and plan["hardware"] == "h100"
    lines = (cluster / sweep.TORCHRUN).read_text().splitlines()
    for i, layout in enumerate(plan["layouts"]):
        command = tasks[i]
        assert command[:command.index("torchrun")] == ["srun", "--cpus-per-task=16", "--kill-on-bad-exit=1"]
        torchrun = get_args_parser().parse_args(command[command.index("torchrun") + 1:])
        assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_endpoint) == ("$SLURM_NNODES", "2",
                                                                                      "$HEAD_ADDR:$PORT")
        assert torchrun.module and torchrun.training_script == "lab.train"
        train = build_parser().parse_args(torchrun.training_script_args)
        assert train.set == ["train.lr=0.002", "train.steps=5", *layout["sets"]]
        assert train.log_json == str(cluster / layout["log"]) and train.config == TINY
        config, _ = config_from_args(train)  # what the task's lab.train will run: the plan's layout, 4 ranks
        assert config.to_dict()["parallel"] == layout["parallel"] and config.parallel.world_size == 4
        assert shlex.split(lines[i])[shlex.split(lines[i]).index("lab.train") + 1:] == torchrun.training_script_args
    assert [layout["parallel"]["tp"] for layout in plan["layouts"]] == [1, 2]
    assert all(layout["predicted"]["step_s"] > 0 for layout in plan["layouts"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_accepts_the_job_array(cluster):
    done = subprocess.run(["bash", "-n", str(cluster / sweep.SBATCH)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_collect_reads_the_logs_back(cluster, capsys):
    """Logs as lab.train writes them on a GPU (peak memory included), for one layout of two: the other is
    reported as not run."""
    plan = json.loads((cluster / sweep.PLAN).read_text())
    first = plan["layouts"][0]
    rates = [1000.0, 4000.0, 5000.0, 3000.0, 2000.0]  # step 1 and 2 are the warm-up; the median of 3-5 is 3000
    with open(cluster / first["log"], "w") as log:
        for step, rate in enumerate(rates, 1):
            entry = lab.trainer.StepLog(step, 5.0 - step / 10, 3e-3, 1.0, rate, 2**30 * step)
            log.write(json.dumps(entry.as_dict()) + "\n")
    assert lab_main(["sweep", "--collect", str(cluster)]) == 0
    assert "Spearman's rho of the two rankings (step time), 1 layouts: n/a" in capsys.readouterr().out
    result = json.loads((cluster / sweep.RESULT).read_text())
    done, missing = result["layouts"]
    assert done["measured"]["step_s"] == pytest.approx(plan["tokens_per_step"] / 3000.0)
    assert done["measured"]["tokens_per_s"] == pytest.approx(3000.0) and done["measured"]["steps_timed"] == 3
    assert done["measured"]["peak_bytes"] == 5 * 2**30
    assert done["memory_ratio"] == pytest.approx(5 * 2**30 / first["predicted"]["memory_bytes"])
    assert done["ratio"] == pytest.approx(done["measured"]["step_s"] / first["predicted"]["step_s"])
    assert missing["measured"] is None and missing["status"].startswith("no log: not run yet")
    assert result["spearman"] is None and (cluster / sweep.PLOT).exists()


def test_top_k_runs_the_searchs_best(tmp_path):
    args = sweep.build_parser().parse_args(["--config", TINY, "--nproc", "2", "--top", "2", "--out", str(tmp_path)])
    plan = sweep.plan_from_args(args, "test")
    steps = [layout["predicted"]["step_s"] for layout in plan["layouts"]]
    assert len(steps) == 2 and steps == sorted(steps) and plan["system"] == "cpu"
    assert [layout["note"][:15] for layout in plan["layouts"]] == ["the search's #1", "the search's #2"]
    for layout in plan["layouts"]:
        p = layout["parallel"]
        assert p["dp"] * p["tp"] * p["cp"] * p["pp"] == 2


def test_spearman():
    assert sweep.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert sweep.spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert sweep.ranks_of([2.0, 1.0, 2.0]) == [2.5, 1.0, 2.5]
