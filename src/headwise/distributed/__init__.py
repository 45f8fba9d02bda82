"""Attention across processes (context parallelism) over ``torch.distributed``: exact, every mask.

Each rank holds a shard of the sequence; :func:`attention` computes exact attention of
its queries over every rank's keys, by one of two methods:

* ``"ring"``: K/V blocks (with their Hkv heads) travel around the ranks while each rank
  computes; partial results merge by log-sum-exp (:mod:`headwise.distributed.ring`).
* ``"ulysses"``: two all-to-alls trade the sequence split for a head split, and any
  local kernel attends (:mod:`headwise.distributed.ulysses`).

In every process, after ``torch.distributed.init_process_group(...)``::

    import headwise.distributed as hwd
    x_local = hwd.shard(x, dim=1, layout="zigzag")              # (B, S_l, E)
    y = hwd.attention(q, k, v, is_causal=True, method="ring")   # (B, H, S_l, D)
    full = hwd.unshard(y, dim=2)                                # (B, H, S, D) on every rank

Every rank validates its inputs, then one small all-gather of metadata checks that the
ranks agree (shapes, dtype, layout, flags, ALiBi slopes, shard lengths) in ``attention``,
``shard``, ``unshard`` and ``global_positions``; any problem raises on every rank before any
data moves (a rank that refused its own inputs raises its error, the others an error naming
it and its message), so a mistake never hangs the group.

Legend: B batch, H query heads, Hkv key/value heads, S / Sk global query / key length,
S_l / Sk_l this rank's lengths, D head dim, N world size.

One file per part: ``attend`` (:func:`attention`'s entry and its choice of method),
``arguments`` (its checks, agreed by every rank), ``agreement`` (the ranks' metadata exchange
and refusals), ``method`` (:func:`choose_method`, :class:`ContextParallel`), ``sharding``
(:func:`shard`, :func:`unshard`, the positions), ``layout`` (which positions each rank holds),
``ring`` and ``ulysses`` (the two methods).
"""

from headwise.distributed.attend import attention
from headwise.distributed.layout import LAYOUTS
from headwise.distributed.method import METHODS, ContextParallel, MethodChoice, choose_method
from headwise.distributed.sharding import global_length, global_positions, positions, shard, unshard

__all__ = ["ContextParallel", "MethodChoice", "METHODS", "LAYOUTS", "attention", "choose_method",
           "global_length", "global_positions", "positions", "shard", "unshard"]
