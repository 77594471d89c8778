"""The GPU check (python -m tools.gpu_check; docs/gpu-check.md): the CUDA path against the CPU reference, its decode
speed beside the bandwidth floor, and morphing at an 8B model's shape, in one run that fits a short GPU lease.

Modules, each one concept:
    shapes      the model shapes (tiny, SmolLM2-135M, Llama-3.1-8B) and each section's workload at them
    synth       a random-weight fragment set of a shape, drawn on the device (full and INT4 fragments)
    reference   the model in plain fp32 torch on the CPU, from the fragment files
    device      the device's name, copy bandwidth, peak memory
    harness     engines on the device: build, placement of their tensors, bytes a step reads, outputs
    exactness   engine vs reference: logits within tolerance, greedy tokens equal
    decode      tok/s by batch, full and all-INT4, with the floor
    swaps       every layer swapped down and restored while decoding
    burst       full vs balanced at equal memory on a small KV pool
    report      the time budget, the sections, the JSON
"""
