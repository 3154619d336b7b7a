"""helios-report: the page holds every chart, needs no network, and renders in headless Chromium cleanly."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
from helios.profile import RunDB, StepTimer, compute_mfu, peak_flops, profile
from helios.profile.report import MAX_BARS, main, render
from helios.profile.rundb import read_run
from test_profile_synth import FakeClock, FakeRuntime, gpt_step

CHARTS = ("chart-waterfall", "chart-mfu", "chart-loss", "chart-top-ops", "chart-launches", "chart-bandwidth")


def make_run(run_dir, steps: int = 30, window: range = range(10, 20), device: str = "NVIDIA GeForce RTX 3080",
             log_profile: bool = True) -> None:
    """A simulated run written the way the training loop will write it."""
    clock = FakeClock()
    rt = FakeRuntime(clock, seed=7)
    timer = StepTimer(clock)
    peak = peak_flops(device, "fp32")
    fpt = 6 * 400_000 + 12 * 2 * 64 * 128
    db = RunDB(run_dir, device=device, dtype="fp32", peak_flops=peak.flops if peak else None,
               peak_label=peak.label if peak else None, flops_per_token=fpt, config={"steps": steps})
    cm = prof = None
    for step in range(steps):
        if step == window.start:
            cm = profile(clock=clock)
            prof = cm.__enter__()
        before = rt.dispatches_total
        timer.start_step()
        gpt_step(rt, timer)
        rec = timer.end_step(step, 256, loss=4 * 0.97 ** step, lr=3e-4, dispatches=rt.dispatches_total - before)
        u = compute_mfu(fpt, rec.tokens_per_s, peak)
        db.log_step(rec, mfu=u, hfu=None if u is None else u * 1.2)
        if step == window.stop - 1:
            cm.__exit__(None, None, None)
            if log_profile:
                db.log_profile(prof.collector, step)
    db.finish()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    make_run(d)
    return d


def test_page_holds_each_chart_and_needs_no_network(run_dir, capsys) -> None:
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(run_dir / "report.html")
    html = (run_dir / "report.html").read_text()
    for cid in CHARTS:
        m = re.search(rf'<section class="chart" id="{cid}">(.*?)</section>', html, re.DOTALL)
        assert m, cid
        assert "<svg" in m.group(1) and 'class="empty"' not in m.group(1), cid
    # No fetches: no src/href to anything, no @import, no external script.
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', html)
    assert "@import" not in html and "<link" not in html
    # Waterfall: one bar group per step, each phase colour present in its legend.
    wf = re.search(r'id="chart-waterfall">(.*?)</section>', html, re.DOTALL).group(1)
    assert wf.count('<g class="bar">') == 30
    for phase in ("forward", "backward", "comm", "idle"):
        assert f"</i>{phase}</span>" in wf
    top = re.search(r'id="chart-top-ops">(.*?)</section>', html, re.DOTALL).group(1)
    assert top.count('class="bar-label"') == 10 and ">matmul<" in top
    assert not [f for f in os.listdir(run_dir) if f.endswith(".tmp")]


def test_sparse_and_unknown_runs_explain_missing_charts(tmp_path) -> None:
    make_run(tmp_path, steps=5, window=range(1, 3), device="Mystery GPU 9000", log_profile=False)
    html = render(read_run(tmp_path))
    assert "MFU is n/a" in html and "n/a" in re.search(r'MFU \(median\).*?class="v">(.*?)<', html, re.DOTALL).group(1)
    assert "No profiled window" in html
    for cid in CHARTS:
        assert f'id="{cid}"' in html


def test_long_runs_are_bucketed(tmp_path) -> None:
    make_run(tmp_path, steps=300, window=range(5, 7))
    html = render(read_run(tmp_path))
    wf = re.search(r'id="chart-waterfall">(.*?)</section>', html, re.DOTALL).group(1)
    assert 0 < wf.count('<g class="bar">') <= MAX_BARS and "mean of 3 per bar" in wf


def test_cli_errors(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert "no run database" in capsys.readouterr().err
    # The installed entry point works the same way.
    r = subprocess.run([sys.executable, "-m", "helios.profile.report", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 2 and "helios-train --out" in r.stderr


# ---------------------------------------------------------------------------- headless Chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=90, check=False)


def _console_errors(stderr: str) -> list[str]:
    # Chromium logs page console messages as "...:CONSOLE(line)] "message", source: ..." on stderr.
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]


def _page_problems(html_path, tmp_path) -> list[str]:
    r = _chromium(["--virtual-time-budget=3000", "--dump-dom", f"file://{html_path}"], tmp_path)
    dom = r.stdout
    problems = _console_errors(r.stderr)
    if 'data-rendered="ok"' not in dom:
        problems.append("page did not finish rendering (sentinel script did not run)")
    problems += re.findall(r'<div class="js-error">(.*?)</div>', dom)
    return problems


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_renders_in_headless_chromium_without_errors(run_dir, tmp_path) -> None:
    assert main([str(run_dir)]) == 0
    page = run_dir / "report.html"
    assert _page_problems(page, tmp_path) == []

    shot = tmp_path / "report.png"
    r = _chromium([f"--screenshot={shot}", "--window-size=1100,3600", f"file://{page}"], tmp_path)
    assert shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    assert (w, h) == (1100, 3600)
    assert len(png) > 50_000  # six charts of coloured shapes; a blank page compresses to a few KB
    assert _console_errors(r.stderr) == []

    # The check can fail: the same page with a broken script is caught.
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("</main>", "<script>notDefinedAnywhere();</script></main>"))
    problems = _page_problems(broken, tmp_path)
    assert any("notDefinedAnywhere" in p for p in problems), problems
