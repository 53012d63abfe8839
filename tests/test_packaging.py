"""Packaging: environment.yml (conda, for clusters) and pyproject.toml list the same dependencies; CI
and the README use the make targets; the docs' relative links resolve."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _normalise(req: str) -> str:
    """A requirement's name and extras, not its version: `mlflow[auth]>=3.0` -> `mlflow[auth]` (an extra
    installs more packages, so a file without it installs less)."""
    name, extras = re.match(r"\s*([\w.-]+)\s*(?:\[([^\]]*)\])?", req).groups()
    extras = sorted(e.strip().lower() for e in (extras or "").split(",") if e.strip())
    name = name.lower().replace("_", "-")
    return f"{name}[{','.join(extras)}]" if extras else name


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_normalise(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_normalise(r) for r in extra}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_block = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {_normalise(r) for r in pip_block}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"


def test_ci_and_readme_use_the_make_targets():
    assert "make test" in (ROOT / ".ci/run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_relative_links_in_the_docs_point_at_files_that_exist():
    """README.md's summaries link to docs/*.md; a moved or renamed file must not leave a dead link."""
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("results/**/README.md"),
             ROOT / "slurm" / "README.md", ROOT / "repro" / "eval" / "README.md"]
    links = [(page, target) for page in pages
             for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
             if not target.startswith(("http://", "https://", "mailto:"))]
    assert any(target.startswith("docs/") for _, target in links)  # the README's summaries link out
    dead = [f"{page.relative_to(ROOT)} -> {target}" for page, target in links if not (page.parent / target).exists()]
    assert not dead, dead
