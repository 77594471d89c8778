"""The units the morph manager swaps, behind one protocol: a decoder layer (full <-> INT4, its LayerSlot) and the
tied embedding / LM head (full <-> INT8, its HeadSlot). The manager keeps each unit's key (the layer index, or
HEAD_UNIT: its name in the manifest's swap order) in its state and asks the unit for everything else, so it has
no branch on which kind it moves."""

from __future__ import annotations

from typing import Protocol

from .fragments import FragmentStore
from .head import HeadSlot
from .layers import LayerSlot
from .manifest import HEAD_UNIT, Manifest
from .precision import Precision


class SwapUnit(Protocol):
    key: int | str  # its name in the swap order
    kind: str  # "layer" or "lm_head": what the decode-speed calibration measures once per kind
    name: str  # for logs
    down: str  # the precision it swaps down to

    @property
    def bound(self):
        """The form bound now (weights with .nbytes)."""

    def down_bytes(self) -> int:
        """Bytes staged for its swap down: the manifest's size of its quantized fragment (an upper bound)."""

    def load(self, down: bool):
        """Its swapped-down or full form, read from its fragment (any thread)."""

    def bind(self, weights, down: bool) -> str:
        """Rebind it to that form (engine thread, between iterations); the old form is dropped. Returns the
        precision bound."""

    def decode(self, weights, x, xi) -> None:
        """The matrix products one decode step runs through `weights` (x: [batch, hidden]; xi: [batch,
        intermediate]): what the calibration times."""


class LayerUnit:
    kind = "layer"
    down = Precision.INT4

    def __init__(self, slot: LayerSlot, store: FragmentStore, manifest: Manifest, up: Precision = Precision.FULL):
        self.slot, self.store, self.manifest = slot, store, manifest
        self.up = up  # the unswapped form: full, or the GGUF's own Q4_1 blocks (policy q4_1)
        self.key = slot.index
        self.name = f"layer {slot.index}"

    @property
    def bound(self):
        return self.slot.weights

    def down_bytes(self) -> int:
        return self.manifest.fragment(self.key, Precision.INT4)["bytes"]

    def load(self, down: bool):
        return self.store.load_layer(self.key, Precision.INT4 if down else self.up)

    def bind(self, weights, down: bool) -> str:
        precision = Precision.INT4 if down else self.up
        self.slot.bind(weights, precision)
        return precision

    def decode(self, weights, x, xi) -> None:
        weights.qkv(x), weights.o(x), weights.gate_up(x), weights.down(xi)


class HeadUnit:
    kind = "lm_head"
    down = Precision.INT8
    key = HEAD_UNIT
    name = "the lm_head table"

    def __init__(self, head: HeadSlot, store: FragmentStore, manifest: Manifest):
        self.head, self.store, self.manifest = head, store, manifest

    @property
    def bound(self):
        return self.head.table

    def down_bytes(self) -> int:
        return self.manifest.head_fragment(Precision.INT8)["bytes"]

    def load(self, down: bool):
        return self.store.load_head(Precision.INT8 if down else Precision.FULL)

    def bind(self, weights, down: bool) -> str:
        precision = Precision.INT8 if down else Precision.FULL
        self.head.bind(weights, precision)
        return precision

    def decode(self, weights, x, xi) -> None:
        weights.linear(x)
