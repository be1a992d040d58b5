"""No ignore rule matches a file the suite or the package needs.

A rule like `runs/` (meant for the clone's run folders) also matches `tests/runs/`: a new test there
is never committed, passes where it was written, and a fresh clone never runs it. So every file and
every folder under the source roots is asked of git's own ignore matching, and for each folder a
file that does not exist yet (a new test, module, script or config) is asked too.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.one_lane

SOURCE_ROOTS = ("h3train", "tests", "scripts", "configs", "docs", "docker")
# What a build or a run leaves beside the sources, which are meant to be ignored.
GENERATED = ("__pycache__", ".pytest_cache", ".ruff_cache")
NEW_FILES = ("test_anything.py", "new_module.py", "new_config.yaml", "new_page.md")


def _probes() -> list[str]:
    """Every file and folder under the source roots, and a new file of each kind in every folder."""
    paths: list[str] = []
    for name in SOURCE_ROOTS:
        top = ROOT / name
        if not top.is_dir():
            continue
        for path in [top, *sorted(top.rglob("*"))]:
            if any(part in GENERATED or part.endswith(".egg-info") for part in path.parts) or path.suffix == ".pyc":
                continue
            rel = path.relative_to(ROOT).as_posix()
            paths.append(rel)
            if path.is_dir():
                paths += [f"{rel}/{new}" for new in NEW_FILES]
    return paths


def ignored(paths: list[str]) -> list[str]:
    """The `paths` (relative to the checkout) an ignore rule matches, each with the rule: `file:line:rule`."""
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--stdin"],
        cwd=ROOT,
        input="\n".join(paths) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    # Exit 1: nothing matched; 0: something did; anything else is git failing.
    assert done.returncode in (0, 1), done.stderr
    return [line for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout (git check-ignore)"
)
def test_no_ignore_rule_matches_a_source_file() -> None:
    probes = _probes()
    assert "tests/runs/test_anything.py" in probes
    hits = ignored(probes)
    assert not hits, "ignore rules match files the suite or the package needs:\n" + "\n".join(hits[:20])


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout (git check-ignore)"
)
def test_the_run_folders_stay_ignored() -> None:
    """The anchored rules still keep what a run writes in the clone out of the repository."""
    outputs = ["runs/default/metrics.jsonl", "outputs/x.mp4", "demo_out/a", "stand_in/model", ".venv/bin/python"]
    assert len(ignored(outputs)) == len(outputs)
