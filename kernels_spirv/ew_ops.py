"""The elementwise op table: the one place an elementwise op's name, code and GLSL live.

Each :class:`Op` names one elementwise op of the ``ew_unary`` / ``ew_binary`` kernels: its
kind (``unary``: one tensor and the scalars ``p0``, ``p1``; ``binary``: two tensors and the
scalar ``alpha``; ``compare``: two tensors, a bool result), and its GLSL per storage family:

* ``glsl``: the float expression (float32, float16 and bfloat16 tensors compute in float32),
  in terms of ``x`` (unary) or ``x``, ``y`` (binary), and the scalars ``p0``, ``p1``, ``alpha``;
  None: the op has no float form.
* ``int_glsl``: the expression on int32 / int64 tensors (``CT`` is the integer type, the
  scalars arrive as ``CT``); None: floats only (an integer unary input is converted to float
  first, by helios._kernels.unary).
* ``bool_glsl``: the expression on bool (u8) tensors, as ``uint``; binary ops only.

A comparison has one expression for every dtype (``x``, ``y`` of the compute type ``CT``:
float for the float dtypes), given in all three fields.

An op's code (the kernels' specialization constant 0) is its position among the ops of its
kind, so codes are never written down by hand.  :func:`generate` turns the table into
``glsl/ew_ops.gen.glsl``: the op switch of each section (``fop``/``iop``/``bop``/``cop``), and
the GLSL helper functions the expressions call; ``ew_unary.comp`` and ``ew_binary.comp``
include it.  build.py regenerates the file before compiling (and a test checks the committed
file equals what :func:`generate` writes now).  helios._kernels takes UNARY, BINARY, COMPARE
and INT_UNARY from here, and the run-time elementwise fusion compiler (helios.elementwise_jit)
reads each op's float expression from here to generate its fused kernels.

Adding an elementwise op is: one entry here (then ``python kernels_spirv/build.py``), one
forward (helios.functional, calling ``K.unary(name, ...)`` / ``K.binary(name, ...)``), one
backward next to it, and one parity test against PyTorch.  Nothing else: the kernels' switch,
the host's op codes and the fusion compiler all follow the table.

This file must not import helios: build.py (and setup.py through it) loads it by path
before the package exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GEN_NAME = "ew_ops.gen.glsl"
GEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "glsl", GEN_NAME)


@dataclass(frozen=True)
class Op:
    """One elementwise op: name, kind, and its GLSL expression per storage family."""

    name: str
    kind: str  # "unary" | "binary" | "compare"
    glsl: str | None  # float expression (None: no float form)
    int_glsl: str | None = None  # int32 / int64 expression (None: floats only)
    bool_glsl: str | None = None  # bool (u8) expression, binary ops only
    comment: str = ""  # why the expression is what it is (copied into the GLSL)

    @property
    def dtypes(self) -> tuple:
        """The storage families the op supports: some of "float", "int", "bool"."""
        return tuple(k for k, e in (("float", self.glsl), ("int", self.int_glsl), ("bool", self.bool_glsl)) if e)


_NAN = "uintBitsToFloat(0x7FC00000u)"

OPS: tuple[Op, ...] = (
    # -- unary: x, scalars p0 and p1 --------------------------------------------------------
    Op("neg", "unary", "-x", "-x"),
    Op("exp", "unary", "exp(x)"),
    Op("log", "unary", f"x < 0.0 ? {_NAN} : x == 0.0 ? uintBitsToFloat(0xFF800000u) : log(x)",
       comment="log, sqrt and inversesqrt are undefined in GLSL for x < 0 (and log, inversesqrt at 0): "
               "the IEEE results are spelled out, so no device returns something else there"),
    Op("sqrt", "unary", f"x < 0.0 ? {_NAN} : x == 0.0 ? x : sqrt(x)"),
    Op("rsqrt", "unary", f"x < 0.0 ? {_NAN} : x == 0.0 ? 1.0 / x : inversesqrt(x)"),
    Op("tanh", "unary", "tanh_safe(x)"),
    Op("sigmoid", "unary", "sigmoid_f(x)"),
    Op("relu", "unary", "isnan(x) ? x : (x < 0.0 ? 0.0 : x)",
       comment="NaN stays NaN: GLSL's max may drop it, and a driver may turn the bare select into max "
               "(NVIDIA's did: relu(NaN) was 0), so NaN is tested for first"),
    Op("gelu_tanh", "unary", "gelu_tanh(x)"),
    Op("gelu", "unary", "gelu_erf(x)"),
    Op("abs", "unary", "abs(x)", "abs(x)"),
    Op("add_s", "unary", "x + p0", "x + p0"),
    Op("mul_s", "unary", "x * p0", "x * p0"),
    Op("pow_s", "unary", "pow_scalar(x, p0)"),
    Op("rsub_s", "unary", "p0 - x", "p0 - x"),
    Op("rdiv_s", "unary", "p0 / x"),
    Op("clamp", "unary", "(x != x || p0 != p0 || p1 != p1) ? x + p0 + p1 : min(max(x, p0), p1)",
       "min(max(x, p0), p1)", comment="NaN in, NaN out; lo > hi gives hi, as PyTorch"),
    Op("sin", "unary", "sin_c(x)"),
    Op("cos", "unary", "cos_c(x)"),
    Op("div_s", "unary", "x / p0"),
    # -- binary: x, y, scalar alpha (add and sub: x +- alpha * y) ---------------------------------
    Op("add", "binary", "x + alpha * y", "x + y", "x | y"),
    Op("sub", "binary", "x - alpha * y", "x - y", "x ^ y"),
    Op("mul", "binary", "x * y", "x * y", "x & y"),
    Op("div", "binary", "x / y", "(y == CT(0)) ? CT(0) : x / y"),
    Op("pow", "binary", "pow_c(x, y)", "ipow(x, y)"),
    Op("maximum", "binary", "(x != x || y != y) ? x + y : max(x, y)", "max(x, y)", "max(x, y)",
       comment="NaN propagates, as in torch.maximum"),
    Op("minimum", "binary", "(x != x || y != y) ? x + y : min(x, y)", "min(x, y)", "min(x, y)"),
    Op("gelu_tanh_bwd", "binary", "y * gelu_tanh_grad(x)", comment="(x, grad) -> grad * gelu'(x)"),
    Op("gelu_bwd", "binary", "y * gelu_erf_grad(x)"),
    Op("sigmoid_bwd", "binary", "y * x * (1.0 - x)", comment="(sigmoid output, grad)"),
    Op("tanh_bwd", "binary", "y * (1.0 - x * x)", comment="(tanh output, grad)"),
    Op("relu_bwd", "binary", "x > 0.0 ? y : 0.0", comment="(relu input, grad)"),
    Op("and", "binary", None, "x & y", "x & y"),
    Op("or", "binary", None, "x | y", "x | y"),
    Op("xor", "binary", None, "x ^ y", "x ^ y"),
    Op("div_trunc", "binary", "trunc(x / y)", "(y == CT(0)) ? CT(0) : x / y", comment='div(rounding_mode="trunc")'),
    Op("div_floor", "binary", "div_floor_f(x, y)", "idiv_floor(x, y)", comment='div(rounding_mode="floor")'),
    # -- compare: x, y -> bool ----------------------------------------------------------------------
    Op("eq", "compare", "x == y", "x == y", "x == y"),
    Op("ne", "compare", "x != y", "x != y", "x != y"),
    Op("lt", "compare", "x < y", "x < y", "x < y"),
    Op("le", "compare", "x <= y", "x <= y", "x <= y"),
    Op("gt", "compare", "x > y", "x > y", "x > y"),
    Op("ge", "compare", "x >= y", "x >= y", "x >= y"),
)


def codes(kind: str) -> dict[str, int]:
    """Op name -> code (its position among the ops of ``kind``) for "unary", "binary" or "compare"."""
    return {op.name: i for i, op in enumerate(o for o in OPS if o.kind == kind)}


def by_name(kind: str) -> dict[str, Op]:
    """Op name -> :class:`Op` for the ops of ``kind``."""
    return {op.name: op for op in OPS if op.kind == kind}


# GLSL the float expressions call that common.glsl does not have: sin and cos with their own
# range reduction (the generated include carries them, so a fused kernel gets them too).
FLOAT_HELPERS = """\
// sin and cos with their own range reduction: GLSL's are only specified on [-pi, pi] (lavapipe's
// lose every digit past |x| ~ 1e8, a GPU's may be far coarser), so x is reduced to r in
// [-pi/4, pi/4] and a quadrant q by Payne-Hanek against the bits of 2/pi (integer arithmetic,
// exact: no reliance on a fused fma, which drivers may split) and r goes through Cephes'
// sinf/cosf polynomials (about 2 ulp over the whole float range).
const uint TWO_OVER_PI[8] = uint[8](0u, 0xA2F9836Eu, 0x4E441529u, 0xFC2757D1u, 0xF534DDC0u, 0xDB629599u,
                                    0x3C439041u, 0xFE5163ABu);  // a zero word, then 224 bits of 2/pi

float reduce_pio2(float x, out int q) {
    float ax = abs(x);
    float r;
    if (ax <= 0.78539816) {
        r = ax;
        q = 0;
    } else {
        // ax = m * 2^e; ax * 2/pi mod 4 = (m * P) * 2^-94 mod 4, P the 96 bits of 2/pi from
        // weight 2^(1-e) on (earlier bits add multiples of 4, later ones less than 2^-68).
        uint bits = floatBitsToUint(ax);
        int e = int(bits >> 23) - 150;
        uint m = (bits & 0x7FFFFFu) | 0x800000u;
        int p0 = e + 30;
        int wi = p0 >> 5;
        int sh = p0 & 31;
        uint w0 = TWO_OVER_PI[wi], w1 = TWO_OVER_PI[wi + 1], w2 = TWO_OVER_PI[wi + 2];
        if (sh != 0) {
            w0 = (w0 << sh) | (w1 >> (32 - sh));
            w1 = (w1 << sh) | (w2 >> (32 - sh));
            w2 = (w2 << sh) | (TWO_OVER_PI[wi + 3] >> (32 - sh));
        }
        uint h0, l0, h1, l1;
        umulExtended(m, w2, h0, l0);
        umulExtended(m, w1, h1, l1);
        l1 += h0;
        h1 += (l1 < h0) ? 1u : 0u;
        uint l2 = m * w0 + h1;
        q = int(l2 >> 30);
        uint fh = (l2 << 2) | (l1 >> 30);  // the fraction's top 64 of 94 bits
        uint fl = (l1 << 2) | (l0 >> 30);
        bool up = (fh & 0x80000000u) != 0u;  // fraction >= 1/2: r = (f - 1) * pi/2 in the next quadrant
        if (up) {
            fh = ~fh;
            fl = ~fl + 1u;
            if (fl == 0u) fh += 1u;
            q += 1;
        }
        float f = 0.0;
        if (fh != 0u) {
            int lz = 31 - findMSB(fh);
            uint top = lz == 0 ? fh : (fh << lz) | (fl >> (32 - lz));
            f = ldexp(float(top), -32 - lz);
        } else if (fl != 0u) {
            int lz = 31 - findMSB(fl);
            f = ldexp(float(fl << lz), -64 - lz);
        }
        r = fma(f, 1.5707964, f * -4.371139e-08);
        if (up) r = -r;
    }
    if (x < 0.0) {
        r = -r;
        q = -q;
    }
    q &= 3;
    return r;
}

float sin_poly(float r) {
    float s = r * r;
    return fma(r * s, fma(s, fma(s, -1.9515295891e-4, 8.3321608736e-3), -1.6666654611e-1), r);
}

float cos_poly(float r) {
    float s = r * r;
    return fma(s * s, fma(s, fma(s, 2.443315711809948e-5, -1.388731625493765e-3), 4.166664568298827e-2), fma(-0.5, s, 1.0));
}

float sin_c(float x) {
    if (isinf(x) || isnan(x)) return uintBitsToFloat(0x7FC00000u);
    if (x == 0.0) return x;  // keeps -0
    int q;
    float r = reduce_pio2(x, q);
    float v = (q & 1) == 0 ? sin_poly(r) : cos_poly(r);
    return (q & 2) == 0 ? v : -v;
}

float cos_c(float x) {
    if (isinf(x) || isnan(x)) return uintBitsToFloat(0x7FC00000u);
    int q;
    float r = reduce_pio2(x, q);
    float v = (q & 1) == 0 ? cos_poly(r) : sin_poly(r);
    return ((q + 1) & 2) == 0 ? v : -v;
}
"""

# GLSL the integer expressions call (CT: the integer compute type the including kernel defines).
INT_HELPERS = """\
// floor division: the truncating quotient, one less where the remainder is nonzero and the
// signs differ (division by zero gives 0)
CT idiv_floor(CT x, CT y) {
    CT r = (y == CT(0)) ? CT(0) : x / y;
    if (y != CT(0) && x - r * y != CT(0) && ((x < CT(0)) != (y < CT(0)))) r -= CT(1);
    return r;
}

// integer power by squaring; a negative exponent gives 1 for base 1, +-1 for base -1, else 0
// (what PyTorch computes)
CT ipow(CT x, CT y) {
    CT r = CT(1);
    if (y < CT(0)) {
        r = (x == CT(1)) ? CT(1) : (x == CT(-1)) ? (((y & CT(1)) != CT(0)) ? CT(-1) : CT(1)) : CT(0);
    } else {
        CT base = x, e = y;
        while (e > CT(0)) {
            if ((e & CT(1)) != CT(0)) r *= base;
            base *= base;
            e >>= CT(1);
        }
    }
    return r;
}
"""


def _ladder(ops: list[tuple[int, Op, str]], comments: bool = True, indent: str = "    ") -> list[str]:
    """``if (OP == code) r = expr;`` lines, one per op (with ``comments``, each op's comment above it)."""
    out = []
    first = True
    for code, op, expr in ops:
        if comments and op.comment:
            out.append(f"{indent}// {op.name}: {op.comment}")
        out.append(f"{indent}{'if' if first else 'else if'} (OP == {code}) r = {expr};  // {op.name}")
        first = False
    return out


def _section(kind: str, field: str) -> list[tuple[int, Op, str]]:
    return [(code, op, getattr(op, field)) for code, op in
            enumerate(o for o in OPS if o.kind == kind) if getattr(op, field)]


def generate() -> str:
    """The text of glsl/ew_ops.gen.glsl for the current table.

    Sections, each compiled where its macro is defined before the include (the kernel's
    ``OP`` specialization constant and push block ``p`` in scope):
    EW_UNARY_FLOAT (``float fop(float x)``), EW_UNARY_INT (``CT iop(CT x)``),
    EW_BINARY_FLOAT (``float fop(float x, float y)``), EW_BINARY_INT (``CT iop(CT x, CT y)``),
    EW_BINARY_BOOL (``uint bop(uint x, uint y)``), EW_COMPARE (``bool cop(CT x, CT y)``: one
    expression for every dtype, CT being float for the float ones);
    EW_FLOAT_HELPERS alone gives the helper functions (the fusion compiler's kernels)."""
    L = ["// GENERATED by kernels_spirv/ew_ops.py (generate()) from its OPS table; build.py rewrites it.",
         "// Do not edit: change the table and run `python kernels_spirv/build.py`.",
         "",
         "#if defined(EW_UNARY_FLOAT) || defined(EW_FLOAT_HELPERS)",
         FLOAT_HELPERS.rstrip("\n"),
         "#endif",
         "",
         "#if defined(EW_BINARY_INT)",
         INT_HELPERS.rstrip("\n"),
         "#endif",
         "",
         "#ifdef EW_UNARY_FLOAT",
         "float fop(float x) {",
         "    float p0 = p.p0, p1 = p.p1;",
         "    float r = x;"]
    L += _ladder(_section("unary", "glsl"))
    L += ["    return r;", "}", "#endif", "",
          "#ifdef EW_UNARY_INT",
          "// integer unary ops stay exact; the scalars are truncated to the integer type",
          "CT iop(CT x) {",
          "    CT p0 = CT(p.p0), p1 = CT(p.p1);",
          "    CT r = x;"]
    L += _ladder(_section("unary", "int_glsl"), comments=False)
    L += ["    return r;", "}", "#endif", "",
          "#ifdef EW_BINARY_FLOAT",
          "float fop(float x, float y) {",
          "    float alpha = p.alpha;",
          "    float r = x;"]
    L += _ladder(_section("binary", "glsl"))
    L += ["    return r;", "}", "#endif", "",
          "#ifdef EW_BINARY_INT",
          "// integer division truncates (SPIR-V SDiv); by zero it gives 0",
          "CT iop(CT x, CT y) {",
          "    CT r = x;"]
    L += _ladder(_section("binary", "int_glsl"), comments=False)
    L += ["    return r;", "}", "#endif", "",
          "#ifdef EW_BINARY_BOOL",
          "// bools: add is or, sub is xor, mul is and",
          "uint bop(uint x, uint y) {",
          "    uint r = 0u;"]
    L += _ladder(_section("binary", "bool_glsl"), comments=False)
    L += ["    return r;", "}", "#endif", "",
          "#ifdef EW_COMPARE",
          "bool cop(CT x, CT y) {",
          "    bool r = false;"]
    L += _ladder(_section("compare", "glsl"))
    L += ["    return r;", "}", "#endif", ""]
    return "\n".join(L)


def write(path: str = GEN_PATH) -> bool:
    """Write :func:`generate`'s text to ``path`` when it differs from the file's; True if written.

    Unchanged text leaves the file (and its mtime, which makes every kernel stale) alone."""
    text = generate()
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


if __name__ == "__main__":
    print(("wrote " if write() else "unchanged: ") + GEN_PATH)
