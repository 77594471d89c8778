"""plugins/: the C++ CPU kernels against the torch ops they replace."""
