"""`lab.checkpoint`: resume is bit-for-bit, a checkpoint saved at one layout loads exactly at another, a save killed
at any moment never leaves a checkpoint that loads wrongly, and `python -m lab checkpoint` inspects and converts.

Every run here is `lab.trainer`'s own loop (`train_worker`) on ranks forked by `lab.distributed.run` from this
process: a `python -m lab.train` subprocess would pay seconds of imports per run, and what is tested is the
checkpoint, not the command line (its checkpoint flags: `test_checkpoint_flags`). A kill -9 is a real SIGKILL, sent by a
rank to itself (one rank dies) or to its launcher (the whole run dies: the ranks follow their parent), at a point
of the save chosen by a hook armed in that rank only; one case kills at a random moment. The model is the tiny
config cut to two layers, trained four steps."""

import ast
import contextlib
import dataclasses
import errno
import hashlib
import inspect
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lab import checkpoint, train, trainer
from lab import distributed as lab_dist
from lab.checkpoint import Checkpointer, CheckpointOptions
from lab.config import Config
from lab.data import SyntheticTokens
from lab.model import build_model
from lab.parallel.dp import DataParallel, NaiveDP, ParamBox
from lab.parallel.optim import adamw
from lab.parallel.parallelize import build_mesh, parallelize
from lab.precision.master import MasterWeights

STEPS = 4
LAYOUTS = {  # name: ([parallel] section, model preset)
    "single": ({}, "tiny"),
    "dp2": ({"dp": 2}, "tiny"),
    "zero3": ({"dp": 2, "zero": 3}, "tiny"),
    "tp2": ({"tp": 2}, "tiny"),
    "pp2": ({"pp": 2}, "tiny"),
    "cp2": ({"cp": 2}, "tiny"),
    "tp4": ({"tp": 4}, "tiny"),  # 2 KV heads: each copied on 2 TP ranks
    "dp4": ({"dp": 4}, "tiny"),
    "zero3_dp4": ({"dp": 4, "zero": 3}, "tiny"),
    "zero1_dp2": ({"dp": 2, "zero": 1}, "tiny"),
    "dp2_tp2": ({"dp": 2, "tp": 2}, "tiny"),
    "ep2": ({"dp": 2, "ep": 2}, "tiny-moe"),  # each rank holds 4 of every layer's 8 experts
    "single_moe": ({}, "tiny-moe"),
}


def _config(layout: str) -> Config:
    parallel, preset = LAYOUTS[layout]
    return Config.from_dict({"model": {"preset": preset, "n_layers": 2}, "parallel": parallel,
                             "train": {"steps": STEPS, "global_batch": 8, "seq_len": 32, "lr": 3e-3,
                                       "warmup_steps": 2, "seed": 0}})


def _name(step: int) -> str:
    return f"step-{step:08d}"


# --- kill -9 at a chosen point ---------------------------------------------------------------------------------


@dataclass
class Kill:
    """SIGKILL `rank` at `phase` of the run (for a save: the save of `step`). `whole_run`: the rank kills its
    launcher first, and every rank dies with it (`PR_SET_PDEATHSIG`), as under `kill -9` of `python -m lab.train`.

    Phases, in the order a save goes: `after_step` (step done, no save running), `files_written` (this rank's
    DCP files are on disk, DCP's .metadata is not), `metadata_written` (DCP finished, lab's rename not done),
    `before_rename`, `after_rename` (the checkpoint is complete), `mid_prune` (`--keep` is deleting `step`'s
    checkpoint: every file but .metadata gone), and `random` (a random moment up to 0.5 s after resuming)."""

    phase: str
    step: int
    rank: int
    whole_run: bool
    witness: str = ""  # a file the rank creates just before it dies: the kill happened, at that point

    def die(self) -> None:
        open(self.witness, "w").close()
        if self.whole_run:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def arm(self) -> None:
        """Install the hook in this process (a forked rank: nothing leaks into the test's process)."""
        if dist.get_rank() != self.rank:
            return
        name = _name(self.step)
        if self.phase == "after_step":
            _hook(Checkpointer, "after_step", after=lambda _, step, *a, **k: step == self.step and self.die())
        elif self.phase == "files_written":
            _hook(FileSystemWriter, "write_data", after=lambda writer, *a, **k: name in str(writer.path) and self.die())
        elif self.phase == "metadata_written":
            _hook(FileSystemWriter, "finish", after=lambda writer, *a, **k: name in str(writer.path) and self.die())
        elif self.phase in ("before_rename", "after_rename"):
            hit = lambda src, dst, *a, **k: os.path.basename(dst) == name and self.die()  # noqa: E731
            _hook(os, "rename", **{self.phase.split("_")[0]: hit})
        elif self.phase == "mid_prune":
            def half_deleted(path, *a, **k):
                if os.path.basename(path).endswith(name):  # lab's prune: however it deletes, stop half-way
                    for file in os.listdir(path):
                        if file != ".metadata":
                            os.remove(os.path.join(path, file))
                    self.die()
            _hook(shutil, "rmtree", before=half_deleted)
        elif self.phase == "random":
            timer = threading.Timer(random.uniform(0.0, 0.5), self.die)
            timer.daemon = True
            _hook(Checkpointer, "resume", after=lambda *a, **k: timer.start())
        else:
            raise ValueError(f"phase={self.phase!r} is no kill point")


def _hook(owner: object, attr: str, before: Callable | None = None, after: Callable | None = None) -> None:
    original = getattr(owner, attr)

    def hooked(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result

    setattr(owner, attr, hooked)


def _record_loaded_state(directory: str) -> None:
    """After the resume, save what was loaded into `directory` (to compare it with the checkpoint it came from)."""
    original = Checkpointer.resume

    def resume(self, par, optimizer, scheduler, data) -> int:
        step = original(self, par, optimizer, scheduler, data)
        if step:
            checkpoint.save(directory, step, par, optimizer, scheduler, data, self.config)
        return step

    Checkpointer.resume = resume


class _FullDiskFile:
    """A checkpoint file on a full disk: every write fails with ENOSPC, which (like the real one) names no file."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def _full_disk_at(step: int) -> Callable:
    """DCP's file system with the disk full from the save of `step` on (the writer monkeypatched, nothing
    mounted: the test does not depend on the machine)."""
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(fs, path, mode):
        with original(fs, path, mode) as stream:
            yield _FullDiskFile(stream) if _name(step) in str(path) and "w" in mode else stream

    return create_stream


def _rank_trains(config: Config, options: CheckpointOptions, kill: Kill | None, loaded: str | None,
                 full_disk: int | None = None) -> list[float]:
    if loaded is not None:
        _record_loaded_state(loaded)
    if full_disk is not None and dist.get_rank() == 1:
        FileSystem.create_stream = _full_disk_at(full_disk)
    if kill is not None:  # after: a kill at resume comes once the loaded state is recorded
        kill.arm()
    return [entry.loss for entry in trainer.train_worker(config, None, False, options)]


def _train(layout: str, ckpt, every: int = 0, keep: int = 0, resume: bool = False, asynchronous: bool = False,
           kill: Kill | None = None, loaded=None, full_disk: int | None = None) -> list[float]:
    """Train `layout` for STEPS steps with checkpoints in `ckpt`; rank 0's losses of the steps it made (after a
    resume: those after the checkpoint's step). `full_disk`: rank 1's disk is full from the save of that step."""
    config = _config(layout)
    options = CheckpointOptions(str(ckpt), every, keep, resume, asynchronous)
    return lab_dist.run(_rank_trains, config.parallel.world_size, config, options, kill,
                        loaded and str(loaded), full_disk, timeout_s=120)[0]


def _train_killed(kill: Kill, layout: str, ckpt, **options) -> None:
    """A run that `kill` stops: SIGKILLed as a whole (its launcher, a fork of this process) or in one rank (a
    random moment may come after the run finished)."""
    kill = dataclasses.replace(kill, witness=f"{ckpt}.killed")
    with contextlib.suppress(FileNotFoundError):
        os.remove(kill.witness)
    if kill.whole_run:
        launcher = mp.get_context("fork").Process(target=_train, args=(layout, ckpt), kwargs={**options,
                                                                                                     "kill": kill})
        launcher.start()
        launcher.join(timeout=120)
        if launcher.is_alive():  # its ranks die with it
            launcher.kill()
            launcher.join()
        finished = launcher.exitcode == 0
        assert finished or launcher.exitcode == -signal.SIGKILL, f"the run failed: exit code {launcher.exitcode}"
    else:
        try:  # the launcher kills the other ranks and names a rank; which one, when several fail, is its business
            _train(layout, ckpt, **options, kill=kill)
            finished = True
        except lab_dist.RankError:
            finished = False
    killed = os.path.exists(kill.witness)
    assert (killed or finished) if kill.phase == "random" else (killed and not finished), (kill, finished)


def _tensors(path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a checkpoint, whole, whatever layout saved them."""
    return {k: v for k, v in checkpoint.read_full(str(path)).items() if k.startswith(("model.", "optim."))}


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{what}: {key}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Uninterrupted runs, made once per layout: {layout: (checkpoint dir, losses)}. dp2 saves after every
    step (the kill tests compare with each of its checkpoints), the others every 2 steps."""
    root, made = tmp_path_factory.mktemp("trained"), {}

    def get(layout: str):
        if layout not in made:
            made[layout] = root / layout, _train(layout, root / layout, every=1 if layout == "dp2" else 2)
        return made[layout]

    return get


# --- exact resume after kill -9 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, rank, whole_run", [("zero3", 1, True), ("tp2", 1, False), ("pp2", 0, False)])
def test_kill_9_mid_training_then_resume_is_bit_for_bit(trained, tmp_path, capfd, layout, rank, whole_run):
    """A run holding the step-2 checkpoint is SIGKILLed after step 3 (the whole run, or one rank); `--resume`
    continues from step 2 and steps 3-4 equal the uninterrupted run's exactly (fp32 on CPU). Plain DP: the next
    test, killed inside saves, ends with the uninterrupted losses too."""
    source, reference = trained(layout)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source / _name(2), ckpt / _name(2))
    _train_killed(Kill("after_step", 3, rank, whole_run), layout, ckpt, every=2, resume=True)
    assert os.listdir(ckpt) == [_name(2)]
    capfd.readouterr()
    assert _train(layout, ckpt, every=2, resume=True) == reference[2:]
    assert f"checkpoint: resuming from {ckpt / _name(2)}\n" in capfd.readouterr().out


def test_saves_killed_at_any_point_never_load_wrongly(trained, tmp_path, capfd):
    """dp2, a checkpoint after every step, --keep 2, killed at each point of a save in turn (whole run or one
    rank; one save asynchronous) and once at a random moment, each run resuming the one before. After each kill
    the complete checkpoints are the expected ones (the newest two: --keep), each equal to the uninterrupted
    run's of its step; the next run says it resumes from the newest (naming the unfinished save it ignores), and
    what it loaded equals it, tensor by tensor. The run that finishes has the uninterrupted losses."""
    source, reference = trained("dp2")
    ckpt = tmp_path / "ckpt"
    runs = [  # (kill, the complete checkpoints' steps after it, an asynchronous save)
        (Kill("metadata_written", 2, 0, whole_run=True), [1], False),  # step 1 saved; step 2's .metadata written
        (Kill("files_written", 2, 1, whole_run=False), [1], False),
        (Kill("before_rename", 2, 0, whole_run=True), [1], False),
        (Kill("after_rename", 2, 0, whole_run=False), [1, 2], False),  # the rename is when a checkpoint exists
        (Kill("files_written", 3, 0, whole_run=True), [1, 2], True),  # in the background writer's thread
        (Kill("mid_prune", 1, 0, whole_run=True), [2, 3], False),  # step 3 saved, --keep 2 deleting step 1
        (Kill("random", 0, 1, whole_run=False), None, False),  # in step 4 (or after its save, or too late)
        (None, None, False),  # the run that finishes
    ]
    resumed_from, note = None, ""
    for i, (kill, expected, asynchronous) in enumerate(runs):
        capfd.readouterr()
        loaded, options = tmp_path / f"loaded-{i}", {"every": 1, "keep": 2, "resume": True,
                                                     "asynchronous": asynchronous}
        if kill is None:
            step = int(os.path.basename(resumed_from)[len("step-"):])
            assert _train("dp2", ckpt, **options, loaded=loaded) == reference[step:]
        else:
            _train_killed(kill, "dp2", ckpt, **options, loaded=loaded)
        out = capfd.readouterr().out
        if resumed_from is not None:  # it said so, and loaded exactly that checkpoint's state
            assert f"checkpoint: {note}\n" in out, out
            step = int(os.path.basename(resumed_from)[len("step-"):])
            _assert_same(_tensors(loaded / _name(step)), _tensors(resumed_from), f"loaded by run {i}")
        complete = checkpoint.complete_checkpoints(str(ckpt))
        for path in complete:  # every complete checkpoint holds the uninterrupted run's state of its step
            _assert_same(_tensors(path), _tensors(source / os.path.basename(path)), f"after run {i}")
        resumed_from, note = checkpoint.newest(str(ckpt))
        if expected is not None:
            assert complete == [str(ckpt / _name(step)) for step in expected], kill
        unfinished = sorted(n for n in os.listdir(ckpt) if n.startswith(".tmp-step-"))
        assert note == f"resuming from {resumed_from}" + (
            f" (ignoring {', '.join(unfinished)}: a save that did not finish)" if unfinished else "")
    assert resumed_from == str(ckpt / _name(STEPS))


def test_keep_deletes_the_oldest_and_what_a_killed_prune_left(tmp_path):
    for step in (1, 2, 3):
        os.makedirs(tmp_path / _name(step))
        open(tmp_path / _name(step) / ".metadata", "w").close()
    os.makedirs(tmp_path / ".tmp-deleted-step-00000000")  # a prune killed half-way
    checkpoint.prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == [_name(2), _name(3)]


def test_an_unfinished_save_is_ignored_and_named(trained, tmp_path):
    source, _ = trained("dp2")
    shutil.copytree(source / _name(2), tmp_path / _name(2))
    shutil.copytree(source / _name(4), tmp_path / ".tmp-step-00000004")  # killed before its rename
    os.remove(tmp_path / ".tmp-step-00000004" / ".metadata")
    path, note = checkpoint.newest(str(tmp_path))
    assert path == str(tmp_path / _name(2))
    assert note == (f"resuming from {path} (ignoring .tmp-step-00000004: a save that did not finish)")


def test_a_checkpoint_saved_before_the_first_step_loads(tmp_path):
    """No optimizer step yet, so no AdamW state saved: loading it gives a fresh AdamW's (zero moments, step 0)."""
    state = _build("single")
    path = checkpoint.save(str(tmp_path), 0, *state)
    checkpoint.load(path, *state)
    assert all(not s["exp_avg"].any() and s["step"] == 0 for s in state[1].state.values())


def test_async_checkpoints_hold_the_same_state(trained, tmp_path):
    """--async-checkpoint: training goes on while a checkpoint is written from its copy in CPU memory; every
    checkpoint equals the synchronous run's, tensor by tensor."""
    source, reference = trained("dp2")
    ckpt = tmp_path / "ckpt"
    assert _train("dp2", ckpt, every=2, asynchronous=True) == reference
    for step in (2, 4):
        _assert_same(_tensors(ckpt / _name(step)), _tensors(source / _name(step)), _name(step))
        _assert_manifest_is_the_files(ckpt / _name(step))  # hashed in the background writer's thread


def _assert_manifest_is_the_files(path) -> None:
    """lab.json lists every file of the checkpoint but itself, with its size and sha256."""
    files = json.loads((path / "lab.json").read_text())["files"]
    assert sorted(files) == sorted(n for n in os.listdir(path) if n != "lab.json")
    for name, recorded in files.items():
        data = (path / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


# --- damaged, foreign and unwritable checkpoints: one line each -----------------------------------------------


def _flip(path, count: int = 64) -> None:
    """Flip `count` bytes in the middle of a file (of a .distcp shard: inside a tensor's bytes)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(data)


DAMAGE = {  # how: (what it does to a checkpoint folder, the words that name it)
    "flipped": (lambda d: _flip(d / "__1_0.distcp"), "__1_0.distcp is corrupt: its sha256 differs"),
    "truncated": (lambda d: os.truncate(d / "__0_0.distcp", 1000), "__0_0.distcp has 1,000 bytes"),
    "missing shard": (lambda d: os.remove(d / "__1_0.distcp"), "__1_0.distcp is missing"),
    "garbage metadata": (lambda d: (d / ".metadata").write_bytes(b"garbage"), ".metadata has 7 bytes"),
    "missing lab.json": (lambda d: os.remove(d / "lab.json"), "lab.json is missing"),
}


@pytest.mark.parametrize("how", DAMAGE)
def test_inspect_and_resume_name_a_damaged_file(trained, tmp_path, capsys, how):
    """Each kind of damage to the newest checkpoint: `inspect` refuses it in one line naming the file, the step
    and the newest intact checkpoint; resume skips it, saying which and why."""
    source, _ = trained("dp2")
    for step in (2, 4):
        shutil.copytree(source / _name(step), tmp_path / _name(step))
    assert checkpoint.main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.endswith(" bytes, 3 files intact (size and sha256 as written)\n")
    damage, words = DAMAGE[how]
    damage(tmp_path / _name(4))
    assert checkpoint.main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and str(tmp_path / _name(4)) in err, err
    assert f"the newest intact checkpoint is {tmp_path / _name(2)}" in err and ("step 4" in err or how ==
                                                                                 "missing lab.json"), err
    path, note = checkpoint.newest(str(tmp_path))
    assert path == str(tmp_path / _name(2)) and f"(skipping {_name(4)}: {words}" in note, note


def test_flipped_bytes_are_skipped_and_the_run_goes_on_exactly(trained, tmp_path, capfd):
    """The issue's case: 64 flipped bytes in a shard of the newest checkpoint. The resumed run says it skips it,
    moves it aside (else --keep would count it as the newest), and resumes from the one before it, exactly."""
    source, reference = trained("dp2")
    for step in (2, 4):
        shutil.copytree(source / _name(step), tmp_path / _name(step))
    _flip(tmp_path / _name(4) / "__1_0.distcp")
    capfd.readouterr()
    assert _train("dp2", tmp_path, every=2, resume=True) == reference[2:]
    out = capfd.readouterr().out
    assert (f"checkpoint: resuming from {tmp_path / _name(2)} (skipping {_name(4)}: __1_0.distcp is corrupt: its "
            f"sha256 differs from the one recorded when it was written; moved aside to .damaged-step-*)\n") in out
    assert sorted(os.listdir(tmp_path)) == [f".damaged-{_name(4)}", _name(2), _name(4)]
    _assert_same(_tensors(tmp_path / _name(4)), _tensors(source / _name(4)), "the step-4 checkpoint saved again")


def _main(ckpt, *flags: str) -> int:
    return train.main(["--config", "configs/tiny.toml", "--set", "model.n_layers=2", "--steps", str(STEPS),
                       "--checkpoint-dir", str(ckpt), "--quiet", *flags])


def test_no_intact_checkpoint_refuses_unless_fresh(trained, tmp_path, capsys):
    """Step folders, none intact: --resume refuses in one line naming each and why (exit 2) instead of starting
    from step 0; --fresh starts from step 0 and says so. No step folder at all (a first run): step 0, no flag."""
    source, _ = trained("dp2")
    for step in (2, 4):
        shutil.copytree(source / _name(step), tmp_path / _name(step))
    os.remove(tmp_path / _name(2) / "lab.json")
    _flip(tmp_path / _name(4) / "__0_0.distcp")
    assert _main(tmp_path, "--resume") == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and not captured.out, captured
    assert (f"no intact checkpoint in {tmp_path} to resume from ({_name(4)}: __0_0.distcp is corrupt" in captured.err
            and f"{_name(2)}: lab.json is missing" in captured.err and "pass --fresh" in captured.err), captured.err
    assert _main(tmp_path, "--resume", "--fresh", "--checkpoint-every", "2") == 0
    out = capsys.readouterr().out
    assert f"checkpoint: no intact checkpoint in {tmp_path}: starting from step 0 (skipping {_name(4)}" in out
    assert f"trained tiny (106,816 parameters) for {STEPS} steps" in out
    assert checkpoint.newest(str(tmp_path))[0] == str(tmp_path / _name(STEPS))
    assert _main(tmp_path / "new", "--resume", "--steps", "2") == 0
    assert f"checkpoint: no complete checkpoint in {tmp_path / 'new'}: starting from step 0\n" in \
        capsys.readouterr().out


def test_resume_into_another_model_is_refused(trained, tmp_path, capsys):
    """A 2-layer checkpoint resumed with 1 or 8 layers, another vocabulary, precision or data stream: one line naming
    each differing field and the tensors that differ, before any rank starts. What a resume may change (steps,
    lr, global batch, layout) is said in the line it prints, with what follows from it."""
    source, _ = trained("dp2")
    shutil.copytree(source / _name(2), tmp_path / _name(2))
    for flags, words in [
        (["--set", "model.n_layers=1"], ["model.n_layers 2->1", "9 tensor(s) only in the checkpoint (first: "
                                                                 "model.layers.1."]),  # the issue's: it trained
        (["--set", "model.n_layers=8"], ["model.n_layers 2->8", "54 tensor(s) missing from it (first: "
                                                                  "model.layers.2."]),
        (["--set", "model.vocab_size=512", "--set", "train.precision='bf16'"],
         ["model.vocab_size 256->512, train.precision fp32->bf16", "2 tensor(s) of another shape (first: "
                                                                   "model.output.weight (256, 64) vs (512, 64))"]),
        (["--set", "train.seq_len=16", "--set", "train.seed=1"], ["train.seq_len 32->16", "train.seed 0->1"]),
    ]:
        assert _main(tmp_path, "--resume", "--nproc", "2", "--dp", "2", *flags) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and not captured.out, captured
        assert f"{tmp_path / _name(2)} is another experiment's: this run changes " in captured.err
        assert all(w in captured.err for w in [*words, "a resume may change only the layout, steps"]), captured.err
    assert os.listdir(tmp_path) == [_name(2)]
    assert _main(tmp_path, "--resume", "--steps", "3", "--set", "train.global_batch=16", "--set", "train.lr=1e-3") == 0
    out = capsys.readouterr().out
    assert ("this run changes train.steps 4->3, train.lr 0.003->0.001 (the lr schedule is recomputed from them: "
            "from step 3 the lr follows the new one), train.global_batch 8->16 (from step 3 each step reads 16 "
            "sequences") in out, out
    assert "for 1 steps" in out


def test_disk_full_in_a_save_is_one_line_and_keeps_the_previous_checkpoint(trained, tmp_path, capsys, monkeypatch):
    """The disk fills during the save of step 4 (ENOSPC from the writer: monkeypatched). Single process: one
    error line naming the cause, the file, and the checkpoint left intact; the partial save is removed. Two
    ranks, asynchronous (the failure is in the background thread of rank 1): the same line is the rank's error.
    A resume then continues from step 2 exactly."""
    source, reference = trained("dp2")
    monkeypatch.setattr(FileSystem, "create_stream", _full_disk_at(4))
    assert _main(tmp_path / "single", "--checkpoint-every", "2") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (f"could not save step 4 to {tmp_path / 'single'}: No space left on device (errno ENOSPC writing "
            f"__0_0.distcp on rank 0); the partial save .tmp-{_name(4)} was removed and the newest complete "
            f"checkpoint, {_name(2)}, is untouched") in err, err
    assert os.listdir(tmp_path / "single") == [_name(2)]
    assert _main(tmp_path / "ranks", "--checkpoint-every", "2", "--nproc", "2", "--dp", "2") == 2  # ranks too
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not save step 4" in err and "is untouched" in err, err
    monkeypatch.undo()
    ckpt = tmp_path / "dp2"
    with pytest.raises(lab_dist.RankError) as failed:
        _train("dp2", ckpt, every=2, asynchronous=True, full_disk=4)
    assert (f"CheckpointError: could not save step 4 to {ckpt}: No space left on device (errno ENOSPC writing "
            f"__1_0.distcp on rank 1); the partial save .tmp-{_name(4)} was removed and the newest complete "
            f"checkpoint, {_name(2)}, is untouched") in failed.value.message, failed.value.message
    assert os.listdir(ckpt) == [_name(2)]
    assert _train("dp2", ckpt, every=2, resume=True) == reference[2:]


# --- resharding -----------------------------------------------------------------------------------------------


def _build(layout: str) -> tuple:
    """(par, optimizer, scheduler, data, config) at `layout`, built as `lab.train` builds them."""
    config = _config(layout)
    par = parallelize(config.model, build_mesh(config.parallel), config.parallel, torch.device("cpu"),
                      config.train.seed, config.train.seq_len)
    optimizer = adamw(par.parameters(), config.train.lr, config.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: trainer.lr_factor(step, config))
    data = SyntheticTokens(config.model.vocab_size, config.train.seq_len, config.train.global_batch, 0)
    return par, optimizer, scheduler, data, config


def _reshard_worker(source: str, target: str, layout: str) -> int:
    """Build the run at `layout`, load `source` into it, save it to `target`; the data stream's step."""
    par, optimizer, scheduler, data, config = _build(layout)
    meta = checkpoint.load(source, par, optimizer, scheduler, data, config)
    checkpoint.save(target, meta["step"], par, optimizer, scheduler, data, config)
    return data.step


@pytest.mark.parametrize("source_layout, layout", [
    ("dp4", "dp2_tp2"),
    ("zero3_dp4", "zero1_dp2"),
    ("pp2", "single"),
    ("tp2", "single"),
    ("tp4", "dp2_tp2"),
    ("ep2", "single_moe"),  # experts: whole tensors, each saved by the rank holding it
    ("cp2", "single"),
])
def test_reshard_is_exact(trained, tmp_path, source_layout, layout):
    """Load at another layout and save again: every model and optimizer tensor, gathered whole, is equal."""
    source = trained(source_layout)[0] / _name(2)
    world = _config(layout).parallel.world_size
    steps = lab_dist.run(_reshard_worker, world, str(source), str(tmp_path), layout, timeout_s=120)
    assert steps == [2] * world  # the data stream continues at the saved global batch
    before = _tensors(source)
    assert len(before) == 4 * len(list(build_model(_config(layout).model).parameters()))
    _assert_same(_tensors(tmp_path / _name(2)), before, f"{source_layout} -> {layout}")


class RowShardedDP(NaiveDP):
    """An engine lab.checkpoint has never seen: ZeRO-1 by rows. Gradients are all-reduced whole (NaiveDP); each
    rank's optimizer then updates only its rows `lo:hi` of every parameter (views of it, FSDP2's dim-0 cut) and
    the ranks exchange their rows after the step. It says what it holds as boxes starting at row `lo`."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__(model, group)
        rank = dist.get_rank(group)
        self.rows = {param: _rows(param, self.world) for param in self.params}  # every rank's (lo, hi)
        self.pieces = [(param, lo, torch.nn.Parameter(param.data[lo:hi]))
                       for param in self.params for lo, hi in [self.rows[param][rank]] if lo < hi]

    def parameters(self) -> list[torch.Tensor]:
        return [piece for _, _, piece in self.pieces]

    def finish(self) -> None:
        super().finish()
        for param, lo, piece in self.pieces:
            piece.grad = param.grad[lo:lo + len(piece)]

    @torch.no_grad()
    def after_step(self) -> None:
        for param, rows in self.rows.items():
            for rank, (lo, hi) in enumerate(rows):
                if lo < hi:
                    dist.broadcast(param.data[lo:hi], src=dist.get_global_rank(self.group, rank), group=self.group)

    def state_boxes(self, values: list[dict[str, torch.Tensor]]) -> list[ParamBox]:
        return [ParamBox(param, (lo,) + (0,) * (param.dim() - 1), dict(held))
                for (param, lo, _), held in zip(self.pieces, values, strict=True)]

    def load_boxes(self, values: list[dict[str, torch.Tensor]]) -> tuple[list[ParamBox], Callable[[], None]]:
        return self.state_boxes(values), self.after_step  # each rank loaded its rows: give them to the others


def _rows(param: torch.Tensor, world: int) -> list[tuple[int, int]]:
    n = -(-len(param) // world)
    return [(min(r * n, len(param)), min((r + 1) * n, len(param))) for r in range(world)]


def _row_sharded_worker(source: str, target: str) -> None:
    """dp2 with `RowShardedDP` in place of lab's engine: load `source`, check what each rank now holds against
    it, save to `target`."""
    par, _, lab_scheduler, data, config = _build("dp2")
    engine = RowShardedDP(par.model, par.engine.group)
    par = dataclasses.replace(par, engine=engine, masters=MasterWeights(engine.parameters(), par.masters.policy))
    optimizer = adamw(par.parameters(), config.train.lr, config.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lab_scheduler.lr_lambdas[0])  # lab.train's schedule
    meta = checkpoint.load(source, par, optimizer, scheduler, data, config)
    saved = checkpoint.read_full(source)
    names = {param: name for name, param in par.model.named_parameters()}
    for param, lo, piece in engine.pieces:  # the whole weights (rows exchanged), this rank's rows of the moments
        name = names[param]
        assert torch.equal(param, saved[f"model.{name}"]), name
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[piece][state], saved[f"optim.{name}.{state}"][lo:lo + len(piece)])
    checkpoint.save(target, meta["step"], par, optimizer, scheduler, data, config)


def test_an_engine_of_its_own_round_trips_through_checkpoint_unchanged(trained, tmp_path):
    """An engine that lab.checkpoint does not know (`RowShardedDP`, defined here) holds rows of each parameter:
    its boxes alone put them where they belong, at load and at save."""
    source = trained("dp2")[0] / _name(2)
    lab_dist.run(_row_sharded_worker, 2, str(source), str(tmp_path), timeout_s=120)
    _assert_same(_tensors(tmp_path / _name(2)), _tensors(source), "dp2 -> dp2 by rows")


def test_the_checkpointer_names_no_engine():
    """lab.checkpoint reaches an engine only through `parameters`, `state_boxes`, `load_boxes` and `parameter_of`:
    it imports and names no engine class and reads no engine's attributes."""
    tree = ast.parse(inspect.getsource(checkpoint))
    engines = {cls.__name__ for cls in _subclasses(DataParallel)} | {"DataParallel"}
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              for alias in node.names}
    assert not named & engines, named & engines
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "lab.parallel.zero" not in imported
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "engine"}
    read |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"}
    assert read <= {"parameters", "state_boxes", "load_boxes", "parameter_of"}, read


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def test_resume_at_another_dp_sees_the_same_global_batches(trained, tmp_path, capfd):
    """dp4 -> dp2 x tp2: the resumed run says how the data stream changed and continues with the same global
    batches (another batch would move the loss by far more than the reduction order's 1e-5)."""
    source, reference = trained("dp4")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source / _name(2), ckpt / _name(2))
    resumed = _train("dp2_tp2", ckpt, resume=True)
    out = capfd.readouterr().out
    assert "resharded (dp 4->2, tp 1->2)" in out and "each dp rank now reads other rows" in out
    expected = reference[2:]
    assert len(resumed) == len(expected)
    for a, b in zip(resumed, expected, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_resume_at_the_last_step_trains_nothing(trained, tmp_path, capsys):
    source, _ = trained("dp2")
    shutil.copytree(source / _name(STEPS), tmp_path / _name(STEPS))
    assert train.main(["--config", "configs/tiny.toml", "--set", "model.n_layers=2", "--steps", str(STEPS),
                       "--checkpoint-dir", str(tmp_path), "--resume", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "resharded (dp 2->1)" in out and f"already at step {STEPS}" in out


# --- python -m lab checkpoint ----------------------------------------------------------------------------------


def test_inspect_and_convert(trained, tmp_path, capsys):
    source, _ = trained("tp2")
    assert checkpoint.main(["inspect", str(source)]) == 0  # a directory of checkpoints: its newest
    out = capsys.readouterr().out
    assert f"step {STEPS}, saved by 2 rank(s) [dp=1, tp=2" in out
    assert "model.layers.0.attn.wq.weight" in out and "(2 chunk(s))" in out
    assert "optim.layers.0.attn.wq.weight.exp_avg_sq" in out
    out = tmp_path / "model.pt"
    assert checkpoint.main(["convert", str(source / _name(2)), "--to-single-file", str(out)]) == 0
    model = build_model(_config("tp2").model, "cpu")
    model.load_state_dict(torch.load(out))  # ordinary PyTorch, strict: every key, every shape
    saved = checkpoint.read_full(str(source / _name(2)), "model.")
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[f"model.{name}"]), name


def test_checkpoint_flags():
    args = train.build_parser().parse_args(["--checkpoint-dir", "d", "--checkpoint-every", "3", "--keep", "2",
                                            "--resume", "--async-checkpoint"])
    assert train._checkpoint_options(args) == CheckpointOptions("d", every=3, keep=2, resume=True, asynchronous=True)
    args = train.build_parser().parse_args(["--checkpoint-dir", "d", "--resume", "--fresh"])
    assert train._checkpoint_options(args) == CheckpointOptions("d", resume=True, fresh=True)


def test_bad_input_is_one_line(tmp_path, capsys):
    assert checkpoint.main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a complete checkpoint" in err
    assert train.main(["--resume"]) == 2
    assert "need --checkpoint-dir" in capsys.readouterr().err
    assert train.main(["--checkpoint-dir", str(tmp_path), "--fresh"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fresh goes with --resume" in err
