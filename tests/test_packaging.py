"""The install files agree with each other, and the README's commands exist."""

import re
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from lab.config import tomllib  # the standard library's, or tomli on Python 3.10

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for deps in project["optional-dependencies"].values():
        lines += [d for d in deps if not d.startswith("ultrascale-lab")]
    reqs = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in reqs if r.marker is None or r.marker.evaluate()}


def _environment_requirements() -> dict[str, Requirement]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    reqs = [Requirement(line) for line in pip_section if not line.startswith("-e")]
    assert "-e .[all]" in pip_section, "environment.yml must install the package itself with all extras"
    return {r.name.lower(): r for r in reqs}


def test_environment_yml_lists_what_pyproject_lists():
    project, env = _pyproject_requirements(), _environment_requirements()
    assert sorted(project) == sorted(env)
    for name, req in project.items():
        if name != "torch":  # environment.yml pins the CPU wheel; pyproject accepts any torch >= 2.5
            assert str(req.specifier) == str(env[name].specifier), name
    assert env["torch"].specifier.contains("2.13.0") and project["torch"].specifier.contains("2.13.0")


def test_readme_commands_are_make_targets():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("course", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert "make test" in (ROOT / ".ci" / "run").read_text()
