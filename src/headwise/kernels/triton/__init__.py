"""FlashAttention-2 in Triton: one fused GPU kernel for padding, causal, window, GQA, ALiBi.

The algorithm is :mod:`headwise.kernels.chunked` (read that first), written as Triton
kernels so each tile lives in registers and shared memory, not in PyTorch tensors:

* forward: one program per (query block, head, batch) walks the key tiles with an online
  softmax (running max ``m``, running sum ``l``, running output ``acc``, all fp32) and
  saves the output and the log-sum-exp of every row;
* backward ``delta``: ``rowsum(dO * O)`` per row, the softmax backward's constant;
* backward ``dk, dv``: one program per (key block, kv head, batch) walks the query tiles
  of the G query heads that share that kv head, so grouped-query attention needs neither
  a copy of k/v nor atomics;
* backward ``dq``: one program per (query block, head, batch) walks the key tiles again.

What makes it headwise's and not the Triton tutorial's:

* Key padding masks in any pattern (right or left padding, holes): the mask becomes a
  float key bias ``(B|1, Sk)`` (``-inf`` = padding) and, per batch row, a sorted list of
  the key tiles holding at least one real key. The forward and ``dq`` loops walk only that
  list, so a fully padded tile is never loaded, let alone multiplied. A ``dk, dv`` program
  whose key tile is fully padded skips its query loop and writes zeros.
* Bottom-right causal alignment (query ``i`` sees key ``j <= i + Sk - S``), a sliding
  window (also ``j > i + Sk - S - window``) and ALiBi (``-slope_h * |i + Sk - S - j|``):
  the loop bounds skip tiles that are fully blocked, and only the tiles that straddle a
  boundary pay for the position mask.
* FlexAttention's ``mask_mod`` (the causal / window rule ANDed in) through a tile map at
  (128, 128) map tiles, built per call on the host (:mod:`~headwise.kernels.triton.tile_maps`): per (b, h) and
  map row (column, for dkdv) the partial tiles, then the full ones; empty tiles are not
  listed, so never visited; full tiles run with no mask at all; only the partial tiles'
  pairs are evaluated, packed 32 to an int32 word, and loaded with their tile. Every kernel
  tile divides the map tile, so forward, dq and dkdv share one map, each walking a map tile
  as several of its own. States of size 1 in b or h broadcast (stride 0); a user's
  :class:`headwise.masks.TileMap` of the call's shape at that block is read as is. A key
  tile that is all padding is empty for its batch row. A ``score_mod`` is refused: a
  Python function cannot run in the precompiled kernel, and a bias score_mod would need
  a dense bias, where the kernel reads one bias per key.
* A row that may attend nothing gets output 0 and log-sum-exp ``+inf``, so backward's
  ``p = exp2(s - lse)`` is 0 there and no NaN appears, forward or backward.
* ``return_lse``: the saved log-sum-exp is the caller's, in natural units (``-inf`` for a
  dead row). Its gradient ``g`` needs no kernel of its own: ``d lse_i / d s_ij = p_ij``, so
  ``ds = p (dp - delta + g)`` and the delta kernel stores ``delta - g`` (nothing on a dead
  row); dq, dk, dv and the sinks' gradient then read it as before.
* Logit soft-capping: each tile's product becomes ``softcap * tanh(q k^T * scale / softcap)``
  before the bias and ALiBi; backward multiplies the scores' gradient by ``1 - tanh^2``.
  ``tanh`` is built from ``exp2`` (Triton's interpreter has no libdevice), with a short
  series near 0 so small scores keep their relative precision.
* Attention sinks: after the key tiles the head's sink logit joins the running max and
  sum as one more column with no value, so the saved log-sum-exp already includes it;
  backward's ``p`` and ``delta`` are then the sink-aware ones, and the sinks' gradient
  ``-sum over rows of delta * exp(sink - lse)`` is summed on the host.
* Scores are kept in base 2 (``qk_scale = scale * log2(e)``), as in the tutorial: one
  ``exp2`` per score. The key bias and the ALiBi slopes are converted on the host.

Inputs are fp16, bf16 (fp32 accumulation) or fp32 (IEEE matmuls unless
``torch.set_float32_matmul_precision`` allows TF32). The kernels run under
``torch.library.custom_op`` with fake implementations, so ``torch.compile`` traces around
them, and on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (slow; for
tests). Triton is imported on first use only: ``import headwise`` never needs it.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim, BD the power of two >= max(D, 16) that a tile spans, BM / BN
the rows / columns of one tile, T key tiles per row, MAP_M / MAP_N the rows / columns of
one map tile of a mask_mod, nq / nk the map tiles along S / Sk, P partial map tiles.

The parts, one file each:

* :mod:`~headwise.kernels.triton.tiles`: the device code forward and backward share (a
  tile's loads, stores and scores; the bounds of a walk over tiles);
* :mod:`~headwise.kernels.triton.forward` and :mod:`~headwise.kernels.triton.backward`: the
  kernels; :mod:`~headwise.kernels.triton.jit` makes them Triton's on first use;
* :mod:`~headwise.kernels.triton.configs`: tile sizes; :mod:`~headwise.kernels.triton.tile_maps`:
  the live key tiles and a mask_mod's tile map, built on the host;
* :mod:`~headwise.kernels.triton.launch`: the custom ops, their autograd and
  :func:`triton_attention`;
* :mod:`~headwise.kernels.triton.support`: where the kernel runs and what it refuses;
  :mod:`~headwise.kernels.triton.stages`: explain mode's words; this package: the ``KERNEL``.
"""

from __future__ import annotations

from headwise.kernels.registry import Kernel
from headwise.kernels.triton.launch import triton_attention
from headwise.kernels.triton.stages import triton_stages
from headwise.kernels.triton.support import _available, _refuses

__all__ = ["KERNEL", "triton_attention"]

KERNEL = Kernel(
    name="triton",
    fn=triton_attention,
    summary=("FlashAttention-2 in Triton: key padding, causal, window, GQA, ALiBi, softcap, sinks, mask_mod "
             "(a tile map: empty tiles skipped, bits for partial ones); skips padded tiles"),
    native_gqa=True,
    fused=True,
    available=_available,
    refuses=_refuses,
    stages=triton_stages,
    forward_ad=False,  # an op or autograd.Function without a forward derivative
    functorch=False,  # an autograd.Function without setup_context, reads of values
)
