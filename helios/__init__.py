"""Helios: a deep-learning compute stack written from scratch.

    import helios as hl
    print(hl.devices())
    a = hl.randn(512, 256, seed=0)
    c = (a @ hl.ones(256, 128)).gelu().softmax(dim=-1)
    c.numpy()
"""

from helios.errors import (  # noqa: F401
    CheckpointError,
    CommError,
    DeviceError,
    DTypeError,
    HeliosError,
    InPlaceError,
    OutOfMemoryError,
    ShapeError,
)
from helios.dtypes import DType, bfloat16, finfo, float16, float32, int32, int64  # noqa: F401
from helios.dtypes import bool_ as bool  # noqa: F401,A001
# PyTorch's short names (torch.long, torch.float, torch.half, torch.int): model code spells them so
from helios.dtypes import float16 as half, float32 as float, int32 as int, int64 as long  # noqa: F401,A001,E402
from helios.runtime import current_device, device, devices, set_device, synchronize  # noqa: F401
from helios.tensor import Tensor  # noqa: F401
from helios import functional  # noqa: F401  (attaches Tensor methods)
from helios.functional import (  # noqa: F401
    add, argmax, argmin, cat, chunk, clamp, clone, contiguous, cross_entropy, div, dropout, embedding, eq,
    expand, flatten, full_like, ge, gelu, gt, index_select, layer_norm, le, log_softmax, logical_and,
    logical_not, logical_or, lt, masked_fill, matmul, max, maximum, mean, min, minimum, mul, ne, neg, ones_like,
    permute, pow, relu, reshape, softmax, split, square, squeeze, stack, std, sub, sum,
    transpose, tril, triu, unsqueeze, var, where, zeros_like,
)
from helios.functional import (  # noqa: F401  (indexing, sorting, scans, products: PyTorch's torch.* names)
    addmm, amax, amin, argsort, baddbmm, bmm, cumprod, cumsum, einsum, flip, gather, index_add, mm, movedim, msort,
    multinomial, norm, outer, repeat_interleave, roll, scatter, scatter_add, sort, t, tile, topk,
)
from helios.creation import (  # noqa: F401
    arange, empty, from_numpy, full, normal, ones, rand, rand_like, randint, randn, randn_like, tensor, uniform, zeros,
)
from helios.random import get_rng_state, manual_seed, set_rng_state  # noqa: F401
from helios.autograd.tape import enable_grad, is_grad_enabled, no_grad  # noqa: F401
from helios import profile  # noqa: F401,E402
from helios import nn  # noqa: F401,E402  (helios.nn.functional too, as torch.nn.functional)
from helios.serialization import load, save  # noqa: F401,E402
from helios.complex import complex64, polar, view_as_complex, view_as_real  # noqa: F401,E402  (rotary embeddings)
from helios import amp  # noqa: F401,E402  (mixed precision: amp.GradScaler)
from helios.amp import autocast  # noqa: F401,E402
from helios import graph  # noqa: F401,E402  (step capture and replay: hl.graph.capture)

__version__ = "0.1.0"

# exp, log, sqrt, rsqrt, tanh, sigmoid, abs, sin, cos: the public unary ops of the op table (torch.exp, ...)
globals().update({name: getattr(functional, name) for name in functional.PUBLIC_UNARY})
