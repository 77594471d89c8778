"""The numerics an engine's kernels run with: the INT4 decode kernel's activations, the INT4 prefill path and the
INT8 LM head's activations (EngineConfig.int4_activations, int4_prefill, lm_head_activations).

The C++ kernels and the INT8 table read process-wide switches. An engine resolves its own settings once and puts
them in force before every iteration (a read of three switches when they already are), so a second engine in
the process, or a tool flipping a switch around a live engine, cannot change what this engine computes; a tool
that wants other numerics in a live engine asks it (`LLMEngine.set_kernel_numerics`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plugins import int8_linear, quant_matmul


@dataclass(frozen=True, slots=True)
class KernelNumerics:
    int4_activations: str = "int8"  # int8 | float32
    int4_prefill: str = "auto"  # decode | bfloat16 | float32 | auto
    lm_head_activations: str = "auto"  # int8 | float32 | auto

    def resolved(self) -> "KernelNumerics":
        """`auto` replaced by what it means on this CPU with these activations."""
        if self.int4_activations not in quant_matmul.INT4_ACTIVATIONS:
            raise ValueError(
                f"int4_activations must be one of {sorted(quant_matmul.INT4_ACTIVATIONS)}, "
                f"got {self.int4_activations!r}"
            )
        return KernelNumerics(
            self.int4_activations,
            quant_matmul.resolve_int4_prefill(self.int4_prefill, self.int4_activations),
            int8_linear.resolve_head_activations(self.lm_head_activations),
        )

    @staticmethod
    def in_force() -> "KernelNumerics | None":
        """The switches as they stand; None without the C++ kernels (the INT4 switches then do not exist)."""
        int4_activations, int4_prefill = quant_matmul.int4_activations_in_force(), quant_matmul.int4_prefill_in_force()
        if int4_activations is None or int4_prefill is None:
            return None
        return KernelNumerics(int4_activations, int4_prefill, int8_linear.head_activations())

    def put_in_force(self) -> bool:
        """Sets the switches to these (resolved) numerics unless they already are; True if anything changed."""
        current = self.in_force()
        if current == self:
            return False
        if current is None and int8_linear.head_activations() == self.lm_head_activations:
            return False
        quant_matmul.set_int4_activations(self.int4_activations)
        quant_matmul.set_int4_prefill(self.int4_prefill)
        int8_linear.set_head_activations(self.lm_head_activations)
        return True
