"""`python -m lab <command>`: the course's command line.

    python -m lab doctor                      what this machine can run
    python -m lab train --config configs/tiny.toml --nproc 2
    python -m lab calc params --model llama3-8b
    python -m lab serve --config configs/tiny.toml --requests 32
    python -m lab calc bubble --pp-schedule zb-h1 --pp 8 --grad-accum 32
    python -m lab checkpoint inspect ckpt/step-00000020
    python -m lab launch slurm --config configs/llama3-8b.toml --nodes 2 --gpus-per-node 8 --set parallel.dp=16
    python -m lab sweep --config configs/tiny.toml --nproc 4 --top 4 --out sweep
    python -m lab site                        the course as web pages in site/ (`make site`)
"""

from __future__ import annotations

import sys

COMMANDS = {
    "doctor": ("lab.doctor", "report versions, devices, backends and extras, with fixes"),
    "train": ("lab.train", "train a model with the parallelisms a config asks for"),
    "calc": ("lab.calc.cli", "cost models: params, memory, flops, comms (collectives), bubble (pipelines), inference"),
    "release": ("lab.grading.release", "write exercises/ (or one assignment's hand-out) from solutions/"),
    "grade": ("lab.grading.grade", "grade notebooks in sandboxes: CSV, Gradescope results.json, feedback"),
    "gradescope": ("lab.grading.gradescope", "write an assignment's Gradescope setup.sh and run_autograder"),
    "check": ("lab.grading.learner", "check a saved exercise notebook, as lab.check() does in JupyterLab"),
    "serve": ("lab.serve", "an offline batch of requests through lab.inference's engine: throughput, latency"),
    "checkpoint": ("lab.checkpoint", "inspect a DCP checkpoint, or convert it to one plain state_dict file"),
    "launch": ("lab.distributed.slurm", "write the sbatch script that runs lab.train on N nodes of G GPUs (Slurm)"),
    "sweep": ("lab.sweep", "run the search's top layouts (or given ones) as short runs: predicted vs measured"),
    "site": ("lab.site", "the course as static web pages (site/) from the chapters the tests executed"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<10} {help_text}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"python -m lab: error: unknown command {argv[0]!r}; valid commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
