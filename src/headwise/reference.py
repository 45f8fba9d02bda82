"""The two documents' classes, as written, without their prints.

They are the baselines that tests and benchmarks compare against, so their arithmetic
is kept exactly: the same layers, the same order of operations, the same names. Two
deliberate changes: no ``print`` (library code does not write to stdout), and the
second document's ``assert`` is a ``ValueError`` (asserts vanish under ``python -O``).

Note what the documents' code does with a fully padded query row: ``masked_fill(-inf)``
then ``softmax`` gives NaN. headwise's kernels give zeros there.

Legend: B batch, H heads, S sequence length, D head dim, E (hidden_dim) embed dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MultiHeadAttentionFormal", "MHSA", "to_headwise_state_dict"]


class MultiHeadAttentionFormal(nn.Module):
    """The first document's ``MultiHeadAttentionFormal``.

    Args:
        hidden_dim: E.
        head_num: H.
        attention_dropout: dropout on the attention weights.

    ``forward(x, attention_mask)`` takes x (B, S, E) and a mask already broadcastable to
    (B, H, S, S) (the document passes ``mask.unsqueeze(1).unsqueeze(2).expand(B, H, S, S)``)
    with 0 = padding; returns (B, S, E).
    """

    def __init__(self, hidden_dim: int, head_num: int, attention_dropout: float = 0.1):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.head_num = head_num
        self.head_dim = hidden_dim // head_num  # head_num * head_dim = hidden_dim
        self.q_proj = nn.Linear(hidden_dim, hidden_dim)  # (hidden_dim, head_dim * head_num)
        self.k_proj = nn.Linear(hidden_dim, hidden_dim)
        self.v_proj = nn.Linear(hidden_dim, hidden_dim)
        self.output = nn.Linear(hidden_dim, hidden_dim)
        self.attention_dropout = nn.Dropout(attention_dropout)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        batch_size, seq_len, _ = x.shape  # (B, S, E)
        Q = self.q_proj(x)  # (B, S, E)
        K = self.k_proj(x)
        V = self.v_proj(x)
        # (B, S, E) -> (B, S, H, D) -> (B, H, S, D)
        q_state = Q.view(batch_size, seq_len, self.head_num, self.head_dim).transpose(1, 2)
        k_state = K.view(batch_size, seq_len, self.head_num, self.head_dim).transpose(1, 2)
        v_state = V.view(batch_size, seq_len, self.head_num, self.head_dim).transpose(1, 2)
        # (B, H, S, D) x (B, H, D, S) -> (B, H, S, S)
        atten_weight = torch.matmul(q_state, k_state.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            atten_weight = atten_weight.masked_fill(attention_mask == 0, float("-inf"))
        atten_weight = torch.softmax(atten_weight, dim=-1)
        atten_weight = self.attention_dropout(atten_weight)
        output_mid = torch.matmul(atten_weight, v_state)  # (B, H, S, S) x (B, H, S, D) -> (B, H, S, D)
        output_mid = output_mid.transpose(1, 2).contiguous()  # (B, H, S, D) -> (B, S, H, D)
        output_mid = output_mid.view(batch_size, seq_len, self.hidden_dim)  # -> (B, S, E)
        return self.output(output_mid)


class MHSA(nn.Module):
    """The second document's ``MultiHeadAttention`` (multi-head self-attention, no mask).

    Args:
        embed_dim: E.
        num_heads: H.

    ``forward(x)`` takes x (B, S, E) and returns (B, S, E).
    """

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})")
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.fc_out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        batch_size = x.shape[0]
        Q = self.query(x)  # (B, S, E)
        K = self.key(x)
        V = self.value(x)
        # (B, S, E) -> (B, S, H, D) -> (B, H, S, D)
        Q = Q.view(batch_size, -1, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        K = K.view(batch_size, -1, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        V = V.view(batch_size, -1, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
        # (B, H, S, D) x (B, H, D, S) -> (B, H, S, S)
        energy = torch.matmul(Q, K.permute(0, 1, 3, 2)) / (self.head_dim**0.5)
        attention = F.softmax(energy, dim=-1)
        out = torch.matmul(attention, V)  # (B, H, S, S) x (B, H, S, D) -> (B, H, S, D)
        out = out.permute(0, 2, 1, 3).contiguous()  # (B, H, S, D) -> (B, S, H, D)
        out = out.view(batch_size, -1, self.embed_dim)  # -> (B, S, E)
        return self.fc_out(out)


_NAMES = {
    MultiHeadAttentionFormal: {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
                               "output": "out_proj"},
    MHSA: {"query": "q_proj", "key": "k_proj", "value": "v_proj", "fc_out": "out_proj"},
}


def to_headwise_state_dict(ref: nn.Module) -> dict[str, Tensor]:
    """A reference module's weights under :class:`headwise.MultiHeadAttention`'s names.

    >>> from headwise import MultiHeadAttention
    >>> ref = MHSA(64, 4)
    >>> _ = MultiHeadAttention(64, 4).load_state_dict(to_headwise_state_dict(ref))
    """
    try:
        names = _NAMES[type(ref)]
    except KeyError:
        raise TypeError(
            f"expected MultiHeadAttentionFormal or MHSA, got {type(ref).__name__}"
        ) from None
    out = {}
    for key, value in ref.state_dict().items():
        layer, param = key.split(".", 1)
        out[f"{names[layer]}.{param}"] = value
    return out
