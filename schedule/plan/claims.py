"""``helios-plan --check "1e12 params, 400 H100, 17 s/step, 8.4e6 tokens/step"``: which claim breaks which bound.

The text is read as comma- or semicolon-separated phrases.  Recognised (numbers as 1e12,
8.4e6, 1T, 175B, 8M, 6x10^15, 6×10¹⁵):

==========================  =================================================================
``1e12 params``             the model size N (needed by every bound below)
``400 H100`` / ``64 GPUs``  the devices (H100 means the SXM part: the fastest, the kindest bound)
``17 s/step``               step time       >= 6 N x tokens/step / (GPUs x peak)
``8.4e6 tokens/step``       tokens per step (also "8M-token global batch")
``1e5 tokens/s``            throughput      <= GPUs x peak / 6N
``15 GB per GPU``           memory per GPU  >= 16 N / GPUs (weights, gradients, Adam states, fully sharded)
``2e13 tokens``             the token budget
``90 days``                 wall time       >= 6 N x tokens / (GPUs x peak)
``$75M``                    cost            >= GPU-hours at 100 % of peak x --price
``45% MFU``                 utilisation     <= 100 %; with step time and tokens/step: implied MFU
``6e15 x tokens FLOPs``     training FLOPs  = 6 N per token (+ 12 L T h of attention)
``100M-token contexts``     attention       12 L T h FLOPs per token vs 6N; one sequence's layer inputs 2 T h L bytes
==========================  =================================================================

Every bound is at 100 % of the dense peak with nothing else on the critical path, so a
claim that breaks one is impossible, not merely optimistic.  Each claim gets one line:
``BREAKS`` (beyond the bound, and by what factor), ``unlikely`` (within it, but implying a
utilisation above the ~70 % of peak that a large GEMM alone sustains), ``ok`` (and the
utilisation it implies), or ``?`` (a number it needs is missing: which).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .hardware import get_device
from .model import PlanError, fmt_duration, shape_for_params

_SUP = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_NUM = r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:\s*[x×*]\s*10\^?-?\d+)?\s*[kKMBGTP]?)"


def parse_number(text: str) -> float:
    """'8.4e6' -> 8.4e6, '1T' -> 1e12, '6×10¹⁵' -> 6e15, '6x10^15' -> 6e15, '8M' -> 8e6."""
    s = text.translate(_SUP).strip().replace(",", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?:\s*[x×*]\s*10\^?(-?\d+))?\s*([kKMBGTP]?)", s)
    if not m:
        raise PlanError(f"cannot read a number from {text!r}")
    v = float(m.group(1))
    if m.group(2):
        v *= 10.0 ** int(m.group(2))
    if m.group(3):
        v *= _SUFFIX[m.group(3).lower()]
    return v


def _sup_to_caret(s: str) -> str:
    """'10¹⁵' -> '10^15' so the number pattern sees one token."""
    return re.sub(r"10([⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+)", lambda m: "10^" + m.group(1).translate(_SUP), s)


@dataclass
class Verdict:
    claim: str
    status: str  # "ok", "BREAKS", "?"
    text: str
    factor: float | None = None

    def line(self) -> str:
        return f"{self.status:6s} {self.claim}: {self.text}"


_DEVICE_WORDS = {"h100": "h100-sxm", "h200": "h200", "a100": "a100", "mi300x": "mi300x", "mi300": "mi300x"}


def parse_claims(text: str) -> dict:
    """The numbers a claim string states, by kind (see the module docstring)."""
    out: dict = {"phrases": {}}
    s = _sup_to_caret(text)
    for phrase in re.split(r"[;,\n]+(?!\d{3}\b)", s):
        p = phrase.strip()
        if not p:
            continue
        pats = [
            ("params", _NUM + r"\s*(?:-\s*)?(?:params|parameters?|param)\b"),
            ("gpus", r"(\d+)\s*(?:x\s*)?(h100|h200|a100|mi300x?|gpus?|devices?)\b"),
            ("step_s", _NUM + r"\s*s(?:ec(?:onds?)?)?\s*(?:/|per)\s*(?:step|iteration|iter)\b"),
            ("tokens_per_step", _NUM + r"\s*(?:-\s*)?tokens?\s*(?:/|per)\s*(?:step|iteration|iter|batch)\b"),
            ("tokens_per_step", _NUM + r"\s*-?\s*tokens?\s+global\s+batch"),
            ("tokens_per_s", _NUM + r"\s*tokens?\s*(?:/|per)\s*s(?:ec(?:ond)?)?\b"),
            ("mem_per_gpu", _NUM + r"\s*gb\s*(?:/|per)\s*(?:gpu|device|rank)\b"),
            ("flops_per_token", _NUM + r"\s*[x×*]\s*tokens?\b"),
            ("context", _NUM + r"\s*-?\s*tokens?\s+contexts?\b"),
            ("tokens", _NUM + r"\s*tokens?\b(?!\s*(?:/|per|global|contexts?))"),
            ("days", _NUM + r"\s*days?\b"),
            ("cost", r"\$\s*" + _NUM),
            ("mfu", _NUM + r"\s*%\s*(?:mfu|of peak)"),
        ]
        for kind, pat in pats:
            m = re.search(pat, p, re.IGNORECASE)
            if not m or kind in out:
                continue
            if kind == "gpus":
                out["gpus"] = int(m.group(1))
                word = m.group(2).lower()
                if word in _DEVICE_WORDS:
                    out["device"] = _DEVICE_WORDS[word]
            else:
                out[kind] = parse_number(m.group(1))
            out["phrases"][kind] = p
            break
    return out


def _fmt(v: float, unit: str = "") -> str:
    if v == 0:
        return f"0{unit}"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{fmt_g(v)}{unit}"
    return f"{v:.4g}{unit}" if abs(v) < 100 else f"{v:.1f}{unit}"


def fmt_g(v: float) -> str:
    """1e12 -> '1e12', 8.4e6 -> '8.4e6', 127.3 -> '127'."""
    return re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{v:.3g}")


def _factor(r: float) -> str:
    """7.49 -> '7.5x', 1000 -> '1,000x'."""
    return f"{r:,.0f}x" if r >= 100 else f"{r:.2g}x" if r < 10 else f"{r:.1f}x"


# What each needed number is called in a "?" verdict.
_NEEDED = {"params": "the parameter count (e.g. '1e12 params')", "gpus": "the GPU count (e.g. '400 H100')",
           "tokens_per_step": "tokens per step", "tokens": "the token budget (e.g. '2e13 tokens')"}


class _Claims:
    """The parsed claims of one text on one device, and one method per claim kind giving its verdict
    (``check`` calls a kind's method only where the text makes a claim of that kind)."""

    def __init__(self, c: dict, dev, dtype: str, price: float):
        self.c, self.dev, self.price = c, dev, price
        self.peak = dev.peak_for(dtype)
        self.N, self.G, self.ph = c.get("params"), c.get("gpus"), c["phrases"]
        self.fleet = f"{self.G} x {self.peak / 1e12:.1f} TFLOP/s ({dev.name} {dtype} dense peak)" if self.G else ""

    def need(self, *keys: str) -> list[str]:
        """The numbers among ``keys`` the text does not give."""
        return [k for k in keys if self.c.get(k) is None]

    def unknown(self, kind: str, keys: list[str]) -> Verdict:
        """The "?" verdict of a ``kind`` claim that needs the numbers ``keys``."""
        return Verdict(self.ph[kind], "?", "needs " + " and ".join(_NEEDED.get(k, k) for k in keys))

    def util(self, phrase: str, head: str, u: float, what: str) -> Verdict:
        """A claim that implies ``u`` of the fleet's peak: over 1 breaks physics, over the achievable GEMM rate is unlikely."""
        if u > 1:
            return Verdict(phrase, "BREAKS", f"{head}: the claim is {_factor(u)} {what} than the hardware "
                           f"(it implies {100 * u:.0f} % of peak)", u)
        if u > self.dev.achievable:
            return Verdict(phrase, "unlikely", f"{head}: it implies {100 * u:.0f} % of peak for the whole run, above the "
                           f"~{100 * self.dev.achievable:.0f} % a large GEMM sustains before any communication", u)
        return Verdict(phrase, "ok", f"{head}; it implies {100 * u:.0f} % of peak (published large runs reach 40-55 %)", u)

    def step_s(self) -> Verdict:
        k = self.need("params", "gpus", "tokens_per_step")
        if k:
            return self.unknown("step_s", k)
        c, N = self.c, self.N
        flops = 6 * N * c["tokens_per_step"]
        floor = flops / (self.G * self.peak)
        head = (f"6 x {fmt_g(N)} params x {fmt_g(c['tokens_per_step'])} tokens = {fmt_g(flops)} FLOP per step over "
                f"{self.fleet} needs >= {_fmt(floor)} s of compute at 100 % of peak")
        return self.util(self.ph["step_s"], head, floor / c["step_s"], "faster")

    def tokens_per_s(self) -> Verdict:
        k = self.need("params", "gpus")
        if k:
            return self.unknown("tokens_per_s", k)
        cap = self.G * self.peak / (6 * self.N)
        return self.util(self.ph["tokens_per_s"], f"{self.fleet} / 6N caps throughput at {_fmt(cap)} tokens/s",
                         self.c["tokens_per_s"] / cap, "faster")

    def mem_per_gpu(self) -> Verdict:
        k = self.need("params", "gpus")
        if k:
            return self.unknown("mem_per_gpu", k)
        N, G = self.N, self.G
        floor = 16 * N / G
        claim = self.c["mem_per_gpu"] * 1e9
        head = (f"weights, gradients and Adam states are 16 bytes per parameter = {fmt_g(16 * N / 1e12)} TB, "
                f">= {floor / 1e9:.1f} GB per GPU even fully sharded over {G} (weights alone {2 * N / G / 1e9:.1f} GB)")
        if claim < floor:
            return Verdict(self.ph["mem_per_gpu"], "BREAKS", f"{head}: the claim is {_factor(floor / claim)} too small",
                           floor / claim)
        return Verdict(self.ph["mem_per_gpu"], "ok", f"{head}; activations come on top", floor / claim)

    def days(self) -> Verdict:
        k = self.need("params", "tokens", "gpus")
        if k:
            return self.unknown("days", k)
        floor = 6 * self.N * self.c["tokens"] / (self.G * self.peak)
        floor_text = fmt_duration(floor, seconds_digits=1)
        head = f"6 x {fmt_g(self.N)} x {fmt_g(self.c['tokens'])} tokens over {self.fleet} needs >= {floor_text} at 100 % of peak"
        return self.util(self.ph["days"], head, floor / (self.c["days"] * 86400), "faster")

    def cost(self) -> Verdict:
        k = self.need("params", "tokens")
        if k:
            return self.unknown("cost", k)
        hours = 6 * self.N * self.c["tokens"] / self.peak / 3600
        floor = hours * self.price
        head = f">= {fmt_g(hours)} GPU-hours at 100 % of peak x ${self.price:g}/GPU-hour (--price) = ${floor:,.0f}"
        return self.util(self.ph["cost"], head, floor / self.c["cost"], "cheaper")

    def mfu(self) -> Verdict:
        return self.util(self.ph["mfu"], "utilisation is at most 100 % of peak", self.c["mfu"] / 100, "faster")

    def flops_per_token(self) -> Verdict:
        claim, N = self.c["flops_per_token"], self.N
        if N is None:
            return Verdict(self.ph["flops_per_token"], "?", f"{fmt_g(claim)} x tokens is 6N for N = {fmt_g(claim / 6)} "
                           "parameters; needs " + _NEEDED["params"])
        right = 6 * N
        r = claim / right
        st = "BREAKS" if not (0.5 <= r <= 2.0) else "ok"
        what = f"{_factor(r)} too large" if r > 1 else f"{_factor(1 / r)} too small"
        return Verdict(self.ph["flops_per_token"], st, f"training costs 6N = 6 x {fmt_g(N)} = {fmt_g(right)} FLOP per token "
                       f"(+ 12 L T h of attention); {fmt_g(claim)} x tokens is 6N for N = {fmt_g(claim / 6)}: "
                       + (what if st == "BREAKS" else "consistent"), r)

    def context(self) -> Verdict:
        k = self.need("params")
        if k:
            return self.unknown("context", k)
        N, G = self.N, self.G
        T = int(self.c["context"])
        sh = shape_for_params(N, 2048)  # the shape of an N-parameter GPT; the context only changes T below
        attn = 12 * sh.n_layer * T * sh.d_model
        inputs = 2 * T * sh.d_model * sh.n_layer
        total_mem = (G or 1) * self.dev.memory
        head = (f"with {sh.n_layer} layers x {sh.d_model} (a {fmt_g(N)}-param GPT), attention costs 12 L T h = "
                f"{fmt_g(attn)} FLOP per token, {fmt_g(attn / (6 * N))}x the 6N of the weights; one sequence's layer "
                f"inputs alone (full recomputation) are 2 T h L = {fmt_g(inputs / 1e12)} TB")
        st = "BREAKS" if inputs > total_mem else "ok"
        tail = (f", more than the {fmt_g(total_mem / 1e12)} TB of all {G or 1} GPU(s)" if st == "BREAKS"
                else f", within the {fmt_g(total_mem / 1e12)} TB of {G or 1} GPU(s) only if context-parallel over them")
        return Verdict(self.ph["context"], st, head + tail, inputs / total_mem)


# The claim kinds with a bound, in the order their verdicts are listed.
_KINDS = ("step_s", "tokens_per_s", "mem_per_gpu", "days", "cost", "mfu", "flops_per_token", "context")


def check(text: str, gpu: str | None = None, dtype: str = "bf16", price: float = 2.0, seq: int | None = None) -> dict:
    """Each claim of ``text`` against its physical bound: {"facts": ..., "verdicts": [Verdict...]}."""
    c = parse_claims(text)
    if not (set(c) - {"phrases"}):
        raise PlanError(f"--check: no claim recognised in {text!r}; write e.g. "
                        "\"1e12 params, 400 H100, 17 s/step, 8.4e6 tokens/step\"")
    dev = get_device(c.get("device") or gpu or "h100-sxm")
    claims = _Claims(c, dev, dtype, price)
    if claims.G is not None and claims.G < 1:
        raise PlanError(f"--check: {claims.G} GPUs cannot train anything")
    vs = [getattr(claims, kind)() for kind in _KINDS if kind in c]
    facts = {k: v for k, v in c.items() if k != "phrases"}
    facts["device"] = dev.key
    facts["peak_flops"] = claims.peak
    if not vs:
        vs.append(Verdict(text.strip(), "?", "stated no claim with a bound (a step time, throughput, memory, "
                          "duration, cost, MFU, FLOPs formula or context)"))
    return {"facts": facts, "verdicts": vs, "device": dev}
