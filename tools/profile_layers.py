"""Profile layer importance (LIS) on corpus text and write the swap order into the manifest.

python -m tools.profile_layers [--fragment-dir DIR] [--corpus FILE] [--samples 2 --seq-len 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engines.build_fragments import default_fragment_dir
from engines.layer_importance import greedy_order
from engines.offline_model import OfflineModel, corpus_tokens
from trtllm_backend.manifest import Manifest, write_manifest
from trtllm_backend.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "corpus" / "austen_novels.txt"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.profile_layers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--fragment-dir", default=str(default_fragment_dir()))
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--if-missing", action="store_true", help="skip when the manifest already has a profiled order")
    args = ap.parse_args(argv)
    manifest = Manifest(args.fragment_dir)
    if args.if_missing and manifest.data.get("swap_order_profile"):
        print(f"[profile] swap order already profiled: {manifest.swap_order()}")
        return 0
    t0 = time.monotonic()
    model = OfflineModel(args.fragment_dir, max_len=args.seq_len)
    # Calibration text from the first half of the corpus; the last 10% is held out for perplexity.
    ids = corpus_tokens(Tokenizer(manifest), Path(args.corpus), 0.0, 0.5, args.samples, args.seq_len)
    order, log = greedy_order(model, ids)
    took = time.monotonic() - t0
    data = Manifest(args.fragment_dir).data  # re-read: other builders write the manifest too
    data["swap_order"] = order
    data["swap_order_profile"] = {
        "method": "LIS = 0.25*LTS + 0.25*LRS + 0.5*MDS(Q), greedy",
        "samples": args.samples,
        "seq_len": args.seq_len,
        "corpus": Path(args.corpus).name,
        "seconds": round(took, 1),
        "rounds": log,
    }
    write_manifest(Path(args.fragment_dir), data)
    print(f"[profile] LIS swap order (first swapped first): {order}")
    print(f"[profile] {args.samples}x{args.seq_len} tokens, {took:.1f} s")
    print(json.dumps(log[:5], indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
