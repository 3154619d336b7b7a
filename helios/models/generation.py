"""Generation with a key/value cache on the device: ``model.generate`` and ``model.stream``.

The prompt runs once through the model (the prefill), writing every layer's keys and values
into a cache of ``[batch, kv_heads, prompt + max_new_tokens, head_dim]`` tensors per layer;
each later token runs alone (a decode step): its keys and values are written at its position
and its query attends to the cache.  The logits of the last position come back to the host,
where the next token is chosen (greedy at ``temperature=0``, else temperature, top-k and top-p
as transformers' logits warpers apply them, then a draw from a numpy generator seeded by
``seed``).

The decode step is captured once with :mod:`helios.graph` and replayed for every later token,
as helios-train replays a training step: its inputs are the token ids ``[batch, 1]`` and the
position ``[1]`` (int64 tensors refilled at each replay); what depends on the position is
computed on the device from it (the rotary rows or the learned position row, the slot the new
keys and values land in, and the mask of the keys attended), so the recorded commands are the
same for every step.  For that the captured step writes each layer's new keys and values
with one row scatter each (the rows at the position, found on the device; the rest of the
cache is not touched) and attends over the whole cache with an additive mask (the keys beyond
the position count for nothing: matmul, mask add, the scaled softmax kernel, matmul).  An
earlier form wrote the keys with a select over the whole cache and a copy back: that read and
wrote every layer's cache twice a step and took three quarters of GPT-2's decode step at a
512-token context (bench/README.md, "generation with the KV cache").  Where a capture is
refused (``capture=False``, or a device or op the graph cannot repeat), each step runs
eagerly: keys written into the cache's slice at the position, attention over the filled part.
The two give the same tokens (tested).

A model provides ``_kv_layout()`` ((layers, kv heads, head dim)), ``_max_positions()`` (None
where any length works), ``_prepare_generation(length)`` (host uploads the step needs, done
before a capture) and ``_decode(idx, pos, kv)`` (the logits [B, V] of idx's last position,
keys and values through ``kv.attend``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

import helios.functional as F
from helios import _kernels as K
from helios import dtypes as dt
from helios.autograd.tape import no_grad
from helios.creation import arange, tensor, zeros
from helios.errors import ShapeError
from helios.tensor import Tensor

__all__ = ["GenerationMixin", "KVCache", "attention", "sample_next"]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(D) [+ mask]) v for q [B, Hq, T, D] and k, v [B, Hk, S, D] with Hk
    dividing Hq (grouped-query attention: query head h reads key/value head h // (Hq / Hk), as
    transformers' repeat_kv pairs them).  One query per row (a decode step) folds each group
    of query heads into the query length, so no key or value is repeated."""
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    if Hq % Hk:
        raise ShapeError(f"attention: {Hq} query heads are not a multiple of {Hk} key/value heads")
    if Hq != Hk and T == 1 and not causal:
        y = _masked_attention(F.reshape(q, (B, Hk, Hq // Hk, D)), k, v, mask)
        return F.reshape(y, (B, Hq, 1, D))
    if Hq == Hk and not causal:
        return _masked_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=Hq != Hk)


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v over as many heads in k, v as in q.  With a float32
    additive ``mask`` of zeros and -infs (the captured decode step's), the scale is applied in
    the softmax kernel after the mask is added (attention_softmax): (s + m) / sqrt(D) is
    s / sqrt(D) + m for such m, one kernel fewer than the dense path's scale, add and softmax."""
    if mask is None or not (q.dtype is k.dtype is v.dtype is mask.dtype is dt.float32):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = F.matmul(q, F.transpose(k, -2, -1)) + mask
    return F.matmul(F.attention_softmax(scores, 1.0 / math.sqrt(q.shape[-1])), v)


def lm_loss(logits: Tensor, targets, device) -> Tensor:
    """Mean cross entropy of [B, T, V] ``logits`` against ``targets`` ([B, T] ids: a Tensor, or an
    array sent to ``device``), the trainer's ``model(idx, targets) -> (logits, loss)`` loss."""
    B, T = logits.shape[:2]
    if not isinstance(targets, Tensor):
        targets = tensor(np.asarray(targets, np.int64), dtype=dt.int64, device=device)
    return F.cross_entropy(F.reshape(logits, (B * T, -1)), F.reshape(targets, (B * T,)))


class KVCache:
    """The keys and values of one generation, ``[B, Hk, S, D]`` per layer, and how the forward
    running now writes and reads them (see the module docstring).

    Eager forwards cover positions ``start .. start + T - 1``: a prefill (``start`` 0, causal
    over its own keys) or one token.  Between :meth:`begin_step` and :meth:`end_step` (a
    captured decode step) the position is a device tensor: ``rows`` says where its keys and
    values go and ``keep`` is the additive mask [S] of the keys it attends (0 up to the
    position, -inf after it).  The rows after the position hold zeros (the cache starts as
    zeros and is written in position order), so their scores are finite and the mask's -inf
    takes them out of the softmax."""

    def __init__(self, n_layer: int, batch: int, n_kv_head: int, length: int, head_dim: int, dtype, device):
        self.length = length
        self.k = [zeros(batch, n_kv_head, length, head_dim, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [zeros(batch, n_kv_head, length, head_dim, dtype=dtype, device=device) for _ in range(n_layer)]
        self.start = 0
        self.rows: Tensor | None = None
        self.keep: Tensor | None = None
        # constants of the cache's shape, made before any capture: each key's position, the
        # first row of each (batch, head) pair in a cache seen as [B * Hk * S, D], and the
        # source order of the scatter that writes one row into each pair
        self._positions = arange(length, dtype=dt.int64, device=device)
        self._row0 = arange(0, batch * n_kv_head * length, length, dtype=dt.int64, device=device)
        self._order = arange(batch * n_kv_head, dtype=dt.int32, device=device)

    def begin_step(self, pos: Tensor) -> None:
        """Make the next forwards one-token decode steps at ``pos`` (int64 [1] on the device, so
        that a captured step replays for any position): the rows they write and the mask of the
        keys they attend are computed from it on the device."""
        self.rows = self._row0 + pos  # one row per (batch, head) pair, ascending
        self.keep = F.where(F.le(self._positions, pos), 0.0, -math.inf).to(self.k[0].dtype)

    def end_step(self) -> None:
        """Back to eager forwards (positions from ``start``)."""
        self.rows = self.keep = None

    def _write_row(self, cache: Tensor, new: Tensor) -> None:
        """cache[:, :, pos] = new ([B, Hk, 1, D]) at the device position of ``rows``: one
        kernel writing B * Hk rows of D values, the rest of the cache untouched (a select
        over the whole cache would cost a read and a write of all of it, every layer, every step)."""
        B, Hk, S, D = cache.shape
        src = F.reshape(F.contiguous(new), (B * Hk, D))
        K.scatter_rows(F.reshape(cache, (B * Hk * S, D)), self.rows, self._order, src, "replace")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this forward's ``k``, ``v`` ([B, Hk, T, D]) for ``layer`` and return the attention
        of ``q`` ([B, Hq, T, D]) over every key cached up to its position."""
        ck, cv = self.k[layer], self.v[layer]
        if self.rows is not None:  # captured decode step: one token, position on the device
            self._write_row(ck, k)
            self._write_row(cv, v)
            return attention(q, ck, cv, mask=self.keep)
        T, s = q.shape[2], self.start
        if s + T > self.length:
            raise ShapeError(f"KVCache: positions {s}..{s + T - 1} do not fit a cache of {self.length}")
        ck[:, :, s:s + T] = k
        cv[:, :, s:s + T] = v
        if s == 0:  # prefill: the new keys are all the keys
            return attention(q, k, v, causal=T > 1)
        if T != 1:
            raise ShapeError(f"KVCache: after the prefill tokens come one at a time, got {T}")
        return attention(q, ck[:, :, :s + 1], cv[:, :, :s + 1])


def _as_ids(ids) -> np.ndarray:
    """Prompt ids as an int64 array [B, T] (a 1-D prompt is one row)."""
    arr = ids.numpy() if isinstance(ids, Tensor) else np.asarray(ids)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0 or arr.shape[0] == 0:
        raise ShapeError(f"generate: ids must be [batch, T] (or [T]) with T >= 1, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"generate: ids must be integers, got {arr.dtype}")
    return arr.astype(np.int64)


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
                rng: np.random.Generator) -> np.ndarray:
    """The next token of each row of ``logits`` [B, V]: the argmax at ``temperature`` 0 (the
    first of equal maxima), else a draw from softmax(logits / temperature) restricted, in
    transformers' order, to the ``top_k`` largest logits (ties at the k-th kept) and then to
    the smallest set of most likely tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int64)
    x = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(x, axis=-1, kind="stable")  # ascending, as transformers sorts
        xs = np.take_along_axis(x, order, -1)
        p = np.exp(xs - xs[:, -1:])
        cum = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token always stays
        x = x.copy()
        np.put_along_axis(x, order, np.where(drop, -np.inf, xs), -1)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    u = rng.random(x.shape[0])
    cum = np.cumsum(p, axis=-1)
    return np.minimum((cum < u[:, None] * cum[:, -1:]).sum(-1), x.shape[-1] - 1).astype(np.int64)


class GenerationMixin:
    """``generate`` and ``stream`` for a causal language model (see the module docstring)."""

    #: why the last generation ran its decode steps eagerly (None: they were captured and replayed)
    generation_eager_reason: str | None = None

    def generate(self, ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | list[int] | None = None, seed: int | None = None,
                 *, capture: bool = True):
        """The prompt ``ids`` ([B, T] or [T]; a list, array or int64 Tensor) followed by up to
        ``max_new_tokens`` new tokens per row: [B, T + n], a Tensor on the model's device when
        ``ids`` is a Tensor, else a numpy int64 array.  ``temperature=0`` is greedy; otherwise
        tokens are drawn after ``top_k`` / ``top_p`` filtering from a generator seeded by
        ``seed``.  A row that produced ``eos_token_id`` (one id or a list) is padded with it
        afterwards, and generation stops early once every row has; n is the number of steps
        taken.  ``capture=False`` runs every decode step eagerly instead of replaying a
        captured one (the same tokens)."""
        rows = [step for step in self.stream(ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed,
                                             capture=capture)]
        prompt = _as_ids(ids)
        out = np.concatenate([prompt] + [r[:, None] for r in rows], axis=1) if rows else prompt
        if isinstance(ids, Tensor):
            return tensor(out if ids.ndim == 2 else out[0], dtype=dt.int64, device=ids.device)
        return out if np.ndim(ids) == 2 else out[0]

    def stream(self, ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, eos_token_id: int | list[int] | None = None, seed: int | None = None,
               *, capture: bool = True) -> Iterator[np.ndarray]:
        """:meth:`generate` one step at a time: yields each step's new tokens (int64 [B]) as soon
        as they are chosen (what ``helios-sample`` prints as it goes)."""
        prompt = _as_ids(ids)
        B, T0 = prompt.shape
        n = int(max_new_tokens)
        if n < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"generate: top_k must be >= 1 or None, got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p}")
        if n == 0:
            return
        limit = self._max_positions()
        if limit is not None and T0 + n - 1 > limit:
            raise ValueError(f"generate: a prompt of {T0} tokens and {n} new ones need {T0 + n - 1} positions; "
                             f"this model has {limit}")
        vocab = self._vocab_size()
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise ValueError(f"generate: token ids must be in [0, {vocab}), got {int(prompt.min())}..{int(prompt.max())}")
        eos = None if eos_token_id is None else np.asarray(
            [eos_token_id] if np.ndim(eos_token_id) == 0 else list(eos_token_id), np.int64)
        rng = np.random.default_rng(seed)
        n_layer, n_kv, head_dim = self._kv_layout()
        w = next(iter(self.parameters()))
        device, dtype = w.device, w.dtype
        length = T0 + n - 1  # the last new token is never fed back
        was_training = getattr(self, "training", False)
        self.eval()
        done = np.zeros(B, bool)
        graph = None
        try:
            with no_grad():
                self._prepare_generation(length)
                kv = KVCache(n_layer, B, n_kv, max(length, 1), head_dim, dtype, device)
                logits = self._decode(tensor(prompt, dtype=dt.int64, device=device),
                                      tensor(np.arange(T0), dtype=dt.int64, device=device), kv)
                step_fn = None
                self.generation_eager_reason = "capture=False" if not capture else None
                for i in range(n):
                    tok = sample_next(logits.numpy().astype(np.float32), temperature, top_k, top_p, rng)
                    if eos is not None:
                        tok = np.where(done, eos[0], tok)
                        done |= np.isin(tok, eos)
                    yield tok
                    if i == n - 1 or (eos is not None and done.all()):
                        break
                    pos = T0 + i
                    if capture and self.generation_eager_reason is None:
                        if step_fn is None:
                            step_fn, graph, logits = self._capture_decode(kv, tok, pos, device)
                            if graph is not None:
                                continue
                        else:
                            step_fn(tok, pos)
                            continue
                    kv.start = pos
                    logits = self._decode(tensor(tok[:, None], dtype=dt.int64, device=device),
                                          tensor(np.array([pos]), dtype=dt.int64, device=device), kv)
        finally:
            if graph is not None:
                graph.release()
            self.train(was_training)

    def _capture_decode(self, kv: KVCache, tok: np.ndarray, pos: int, device):
        """Capture the decode step at ``pos`` (it runs); returns (replay(tok, pos), graph, logits),
        or (None, None, None) with ``generation_eager_reason`` set where the capture is refused."""
        from helios import graph as hgraph

        B = tok.shape[0]
        idx_t = tensor(tok[:, None], dtype=dt.int64, device=device)
        pos_t = tensor(np.array([pos]), dtype=dt.int64, device=device)
        try:
            with hgraph.capture(inputs=(idx_t, pos_t), device=device) as g:
                kv.begin_step(pos_t)
                logits = self._decode(idx_t, pos_t, kv)
        except hgraph.GraphCaptureError as e:
            self.generation_eager_reason = str(e)
            return None, None, None
        finally:
            kv.end_step()

        def replay(t: np.ndarray, p: int) -> None:
            g.replay(t.reshape(B, 1), np.array([p], np.int64))

        return replay, g, logits

    def _vocab_size(self) -> int:
        raise NotImplementedError
