"""The tied embedding / LM head as one swappable unit, like a layer slot: bound to its full-precision table or to
its INT8 fragment (plugins/int8_linear.py), rebound between iterations by the morph manager.

The table is read twice per step: looked up for the new tokens' embeddings and multiplied whole for the logits
of the rows that sample. In INT8 the lookup dequantizes the rows it reads, so the full table can be dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins import skinny_gemm

from .errors import FragmentError
from .precision import HEAD_FULL, Precision


def head_mode(setting: str, manifest) -> str:
    """lm_head_precision checked against the fragment set: int8 and dynamic need its tied INT8 table."""
    if setting != HEAD_FULL and not manifest.head_swappable():
        raise FragmentError(
            f"lm_head_precision={setting}: the fragment set in {manifest.dir} has no INT8 table for a tied "
            "embedding / LM head (python -m engines.build_fragments --lm-head-int8 builds it)"
        )
    return setting


class DenseTable:
    """The full-precision table [vocab, hidden]: the compute dtype, or fp16 storage widened by the kernels."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_gemm.linear(x, self.weight)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class HeadSlot:
    """The embedding table and the LM head. Tied (one table for both) is the swappable case; an untied model's
    separate LM head stays dense in `untied` and the unit is not swappable."""

    def __init__(self, table, untied: DenseTable | None = None, precision: str = Precision.FULL):
        self.table = table
        self.untied = untied
        self.precision = precision

    @property
    def swappable(self) -> bool:
        return self.untied is None

    def bind(self, table, precision: str):
        """Rebind to another form of the table (engine thread, between iterations); returns the old one."""
        if not self.swappable:
            raise RuntimeError("the LM head is not tied to the embedding: it is not a swappable unit")
        old, self.table, self.precision = self.table, table, precision
        return old

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.lookup(ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return (self.untied or self.table).linear(h)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + (self.untied.nbytes if self.untied is not None else 0)
