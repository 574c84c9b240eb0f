"""tau's verify pass on a target whose cache cannot be cropped (Qwen3.5/3.6's Gated DeltaNet):
the whole sequence is re-read each step; the seconds of one such pass with every position's
logits (before) against only the last block's (`logits_to_keep = len(draft) + 1`, now).

A tiny random `qwen3_5` text model with the real Qwen3.6 tokenizer (248,320 vocabulary, which
makes the LM head the cost), from ../shared/fixtures/qwen36-tokenizer.

    python benchmarks/bench_tau_verify.py [--seq 1024] [--block 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO.parent / "shared" / "fixtures" / "qwen36-tokenizer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="tokens before the block")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch

    from dflash_etl.models.target import Target, TargetSpec
    from dflash_etl.models.tiny_model import build_tiny_qwen3_5

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3_5(Path(tmp) / "model", tokenizer_dir=TOKENIZER,
                                   hidden_size=64, layers=4)
        target = Target(TargetSpec(model=str(model), layers="1", device="cpu"))
        row = [1000 + (7 * i) % 5000 for i in range(args.seq + args.block)]

        def once(keep: int) -> float:
            start = time.perf_counter()
            target.forward([row], logits=True, logits_keep=keep)
            return time.perf_counter() - start

        once(args.block)  # warm-up
        times: dict[int, list[float]] = {0: [], args.block: []}
        for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
            for keep in times:
                times[keep].append(once(keep))
        full, kept = min(times[0]), min(times[args.block])
    print(f"{os.cpu_count()} cores, Python {platform.python_version()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; tiny qwen3_5 (hidden 64, "
          f"4 layers, vocab 248320), {len(row)} tokens, block {args.block}")
    print(f"every position's logits: {full:.3f} s; the last block's only: {kept:.3f} s "
          f"({full / kept:.1f}x)")


if __name__ == "__main__":
    main()
