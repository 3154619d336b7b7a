"""helios-plan --html: a self-contained page, checked in headless Chromium as helios-report's is."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest
from helios.schedule.plan.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=90, check=False)


def _problems(page, tmp_path) -> list[str]:
    r = _chromium(["--virtual-time-budget=3000", "--dump-dom", f"file://{page}"], tmp_path)
    problems = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    if 'data-rendered="ok"' not in r.stdout:
        problems.append("page did not finish rendering (sentinel script did not run)")
    return problems + re.findall(r'<div class="js-error">(.*?)</div>', r.stdout)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.html"
    assert main(["--params", "7e9", "--gpu", "h100-sxm", "--gpus", "64", "--show", "10", "--html", str(path)]) == 0
    return path


def test_page_is_self_contained_with_both_charts(page) -> None:
    html = page.read_text()
    for cid in ("chart-memory", "chart-time", "table-plans", "assumptions"):
        assert f'id="{cid}"' in html
    assert html.count("<svg") == 2 and "<title>" in html
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched from the network
    # ten plans drawn in each chart: ten bar groups per chart
    assert html.count('<g class="bar">') == 20


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_renders_in_headless_chromium_without_errors(page, tmp_path) -> None:
    assert _problems(page, tmp_path) == []
    shot = tmp_path / "plan.png"
    r = _chromium([f"--screenshot={shot}", "--window-size=1100,2400", f"file://{page}"], tmp_path)
    assert shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1100, 2400)
    assert len(png) > 40_000  # two charts of coloured bars; a blank page compresses to a few KB
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("</main>", "<script>notDefinedAnywhere();</script></main>"))
    assert any("notDefinedAnywhere" in p for p in _problems(broken, tmp_path))
