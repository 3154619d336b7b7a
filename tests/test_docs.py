"""The documentation runs as written: every ```python block of README.md and docs/*.md, and every
script in examples/, runs in a fresh subprocess (no state shared between blocks) and must exit 0.

A block that is not meant to run alone (a fragment, a command's output) is fenced as ```text or
plain ```, which this test does not collect.  Shell blocks (```bash) are not run here: the
commands they show are covered by their own tests (test_train.py, test_plan.py, ...).  Each run
gets a temporary working directory, so files a snippet writes (a checkpoint, a trace) land there.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FENCE = re.compile(r"^```(\S*)\s*$")
TIMEOUT = 180  # seconds per run; each takes a few on lavapipe


def code_blocks(path: str) -> list[tuple[str, int, str]]:
    """(info string, first line number, text) of every fenced block of the markdown file ``path``."""
    out, info, start, lines = [], None, 0, []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            m = FENCE.match(line.rstrip("\n"))
            if info is None:
                if m:
                    info, start, lines = m.group(1), n + 1, []
            elif line.rstrip() == "```":
                out.append((info, start, "".join(lines)))
                info = None
            else:
                lines.append(line)
    assert info is None, f"{path}: a code block opened at line {start - 1} is never closed"
    return out


def python_blocks() -> list:
    return [pytest.param(text, id=f"{path}:{line}") for path in DOCS for info, line, text in code_blocks(path)
            if info == "python"]


def _run(argv: list[str], cwd, what: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.vulkan
@pytest.mark.parametrize("code", python_blocks())
def test_python_block_runs(code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    _run([sys.executable, str(script)], tmp_path, "the block")


EXAMPLES = {  # script -> (arguments, what its output must say)
    "train_gpt.py": (["--steps", "30"], "validation loss"),
    "capture_replay.py": ([], "losses identical bit for bit"),
    "profile_trace.py": (["--out", "trace.json"], "trace written to"),
}


@pytest.mark.vulkan
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name, tmp_path):
    args, says = EXAMPLES[name]
    r = _run([sys.executable, os.path.join(ROOT, "examples", name), *args], tmp_path, f"examples/{name}")
    assert says in r.stdout, r.stdout[-3000:]
    if name == "profile_trace.py":
        assert (tmp_path / "trace.json").stat().st_size > 0


@pytest.mark.vulkan
@pytest.mark.multiproc
def test_multi_rank_example_runs(tmp_path):
    helios_run = os.path.join(os.path.dirname(sys.executable), "helios-run")
    r = _run([helios_run, "--nproc-per-node", "2", os.path.join(ROOT, "examples", "multi_rank.py"), "--steps", "3"],
             tmp_path, "helios-run ... examples/multi_rank.py")
    assert "replicas identical" in r.stdout, r.stdout[-3000:]


def test_every_example_is_run_here():
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.py")))
    assert names == sorted([*EXAMPLES, "multi_rank.py"]), "add the new example to tests/test_docs.py"


def test_docs_have_python_blocks_and_fences_close():
    counts = {path: sum(info == "python" for info, _, _ in code_blocks(path)) for path in DOCS}
    assert counts["README.md"] >= 1 and sum(counts.values()) >= 10, counts


def test_quickstart_is_the_two_commands():
    """The project's rule: two commands on a fresh Debian/Ubuntu machine, and CI runs the second."""
    blocks = [text for info, _, text in code_blocks("README.md") if info == "bash"]
    first = [line.split("#")[0].strip() for line in blocks[0].splitlines()]
    assert first == ["./scripts/train.sh", "./scripts/test.sh"], blocks[0]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "./scripts/test.sh" in f.read()


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of the markdown file ``path`` (outside code blocks)."""
    seen: dict[str, int] = {}
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6} ", line):
                slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                yield slug if n == 0 else f"{slug}-{n}"


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_resolve(path):
    """Every relative link of the page names a file or folder of the repository, and its #anchor a heading there."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)  # links inside code blocks are code
    bad = []
    for link in LINK.findall(text):
        if "://" in link or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target)) if target else os.path.join(ROOT, path)
        if not os.path.exists(full):
            bad.append(f"{link} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in set(anchors(full)):
            bad.append(f"{link} (no such heading)")
    assert not bad, f"{path}: broken links: {bad}"


def test_documented_plan_check_output_is_current():
    """docs/planning.md shows `helios-plan --check ...` with its output: the command still prints it (under a second)."""
    shown = [text for info, _, text in code_blocks("docs/planning.md") if info == "text" and text.startswith("$ helios-plan ")]
    assert shown, "docs/planning.md no longer shows a helios-plan run"
    for text in shown:
        command, _, expected = text.partition("\n")
        argv = shlex.split(command[2:])
        helios_plan = os.path.join(os.path.dirname(sys.executable), argv[0])
        r = subprocess.run([helios_plan, *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == (1 if "BREAKS" in expected else 0), r.stderr  # --check exits 1 when a claim breaks
        assert r.stdout == expected, f"docs/planning.md shows another output for {command!r}:\n{r.stdout}"
