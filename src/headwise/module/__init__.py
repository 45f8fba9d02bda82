"""``MultiHeadAttention`` as parts: the layer (``layer``), one file per path (``dense``,
``packed``, ``cached``, ``fused``, ``context_parallel``), the plan that chooses among them
(``plan``), the memo of repeated calls (``memo``), the checks (``checks``), the stages
around the kernel (``projections``), the q, k, v weights in adjacent memory (``qkv``), the
dispatch report (``report``) and the conversions to and from ``torch.nn.MultiheadAttention``
(``torch_mha``).
"""

from headwise.module.layer import MultiHeadAttention
from headwise.module.plan import Plan

__all__ = ["MultiHeadAttention", "Plan"]
