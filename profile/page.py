"""The pieces of Helios' self-contained HTML pages (helios-report's run page, helios-plan's page):
the inline CSS, the script-error sentinel, the render marker, and the section, card and
empty-chart blocks.  The pages need no network: everything is inline."""

from __future__ import annotations

from html import escape

CSS = """
:root { --fg:#1d2330; --muted:#5b6577; --line:#e3e7ee; --card:#ffffff; --bg:#f5f7fa; --accent:#2b8cbe; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
       font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
header { background:#1d2330; color:#fff; padding:22px 32px 18px; }
header h1 { margin:0 0 4px; font-size:22px; font-weight:600; }
header .sub { color:#c4cad6; font-size:13px; }
main { max-width:1000px; margin:0 auto; padding:20px 24px 40px; }
.cards { display:grid; grid-template-columns:repeat(auto-fit,minmax(150px,1fr)); gap:12px; margin-bottom:18px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
.card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.card .v { font-size:20px; font-weight:600; margin-top:2px; }
.card .n { color:var(--muted); font-size:11px; }
section.chart { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:14px 18px 10px;
                margin:0 0 18px; }
section.chart h2 { font-size:16px; margin:0 0 2px; font-weight:600; }
section.chart p.note { margin:0 0 8px; color:var(--muted); font-size:12.5px; }
.empty { padding:26px; text-align:center; color:var(--muted); border:1px dashed var(--line); border-radius:6px;
         margin:8px 0 12px; }
.chart-svg { width:100%; height:auto; display:block; }
.chart-svg .grid { stroke:#edf0f5; stroke-width:1; }
.chart-svg .axis { stroke:#9aa3b2; stroke-width:1; }
.chart-svg .tick { fill:#5b6577; font-size:11px; }
.chart-svg .axis-label { fill:#5b6577; font-size:12px; }
.chart-svg .bar-label { fill:#1d2330; font-size:12px; font-family:ui-monospace,Menlo,Consolas,monospace; }
.chart-svg .bar-value { fill:#5b6577; font-size:11px; }
.chart-svg g.bar:hover rect { opacity:.8; }
.legend { display:flex; flex-wrap:wrap; gap:6px 16px; margin:4px 0 8px; font-size:12.5px; }
.legend span { display:inline-flex; align-items:center; gap:6px; }
.legend i { width:12px; height:12px; border-radius:2px; display:inline-block; }
table { border-collapse:collapse; width:100%; font-size:12.5px; margin:6px 0 8px; }
th, td { padding:5px 8px; border-bottom:1px solid var(--line); text-align:right; white-space:nowrap; }
th { color:var(--muted); font-weight:600; background:#fafbfc; }
td.l, th.l { text-align:left; }
td.mono { font-family:ui-monospace,Menlo,Consolas,monospace; }
footer { color:var(--muted); font-size:12px; text-align:center; padding:8px 0 24px; }
#js-errors:empty { display:none; }
#js-errors { background:#fde8e8; color:#8a1f1f; padding:8px 12px; border-radius:6px; margin-bottom:12px; }
"""

# The sentinel: any script error on the page becomes visible text; the last script marks the page rendered.
SENTINEL = """<script>
window.addEventListener('error', function (e) {
  var box = document.getElementById('js-errors');
  var li = document.createElement('div'); li.className = 'js-error';
  li.textContent = 'script error: ' + (e.message || e.type);
  if (box) { box.appendChild(li); }
});
</script>"""
DONE = """<script>
(function () {
  var n = document.querySelectorAll('section.chart').length;
  document.body.setAttribute('data-rendered', 'ok');
  document.getElementById('render-status').textContent = 'rendered ' + n + ' charts';
})();
</script>"""


def section(cid: str, title: str, note: str, body: str) -> str:
    """A chart's section: its id, title, a note under the title (HTML), and its body."""
    return (f'<section class="chart" id="{cid}"><h2>{escape(title)}</h2>'
            f'<p class="note">{note}</p>{body}</section>')


def empty(msg: str) -> str:
    """What a chart without data shows instead: ``msg``, saying why."""
    return f'<div class="empty">{escape(msg)}</div>'


def card(k: str, v: str, n: str = "") -> str:
    """A headline card: its label ``k``, value ``v`` and a note ``n`` under it."""
    return f'<div class="card"><div class="k">{escape(k)}</div><div class="v">{escape(v)}</div>' \
           f'<div class="n">{escape(n)}</div></div>'
