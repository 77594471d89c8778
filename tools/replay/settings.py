"""The comparison's fixed settings (server parameters, policies, the default and quick workloads; docs/replay.md
says why each) and the one SLO every run of a comparison is judged by."""

from __future__ import annotations

from tools.replay import metrics as rm

DEFAULT_POLICIES = "full,balanced,int4,int4:15,accuracy,performance"  # the key pair first, back to back
# NOTE: the server settings of the comparison, explicit (docs/replay.md says why each). The full-precision pool
# (512 tokens, 32 blocks) holds about four of the default window's requests; each swapped layer buys 16 blocks,
# so balanced's 20 layers make it x11 and int4's 30 x16. Two torch threads (both cores); on a machine shared
# with other work the second stalls at every barrier for a core another process holds, so num_threads=1 can
# be faster there (no committed run compares the two). Every --param overrides or adds to these.
DEFAULT_PARAMS = {
    "max_tokens_in_paged_kv_cache": "512",
    "block_size": "16",
    "max_batch_size": "32",
    "max_num_tokens": "256",
    "max_queue_size": "256",
    "num_threads": "2",
    "metrics_interval_s": "0.25",
    "drain_timeout_s": "2",
}
# The default window: seconds 2160-2310 of the Azure code trace (idle, a 50 s burst, a 50 s lull, a denser 30 s
# burst, idle), thinned to 32 requests and with lengths scaled to what this 2-core CPU serves (prompts ~100
# tokens, outputs ~30: prefill runs at ~100 tokens/s here when the machine is shared).
DEFAULT_WORKLOAD = {
    "window_start": 2160.0,
    "window": 150.0,
    "rate_scale": 0.04,
    "prompt_scale": 0.04,
    "prompt_clip": "16:160",
    "output_scale": 2.0,
    "output_clip": "16:64",
}
QUICK_WORKLOAD = {
    "window_start": 180.0,
    "window": 20.0,
    "rate_scale": 0.05,
    "prompt_scale": 0.05,
    "prompt_clip": "32:128",
    "output_scale": 1.0,
    "output_clip": "8:16",
}
QUICK = {"policies": "full,balanced", "probes": 2, "drain_s": 30.0}


def slo_of(args, *results) -> rm.Slo:
    """--ttft-slo-ms (args.slo_s), or --slo-multiple x the median unloaded TTFT of the probes at the start of
    these runs; --tpot-slo-ms (args.tpot_slo_s) when given."""
    probes = [t for res in results for t in res.unloaded_ttft_s]
    ttft = args.slo_s if args.slo_s is not None else rm.default_ttft_slo(probes, args.slo_multiple)
    return rm.Slo(ttft, args.tpot_slo_s)
