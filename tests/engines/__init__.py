"""engines/: building the fragment sets (HF and GGUF import, AWQ / INT8, Q4_1, the layer order)."""
