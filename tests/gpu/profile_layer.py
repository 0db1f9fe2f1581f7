"""Where a GPU layer's time goes: torch.profiler over forward + backward of our dropless layer (and megatron-core's
SequentialMLP beside it) on one of `megamoe bench layer`'s shapes, the CUDA kernels ranked by their total time.

    python tests/gpu/profile_layer.py [CONFIG] [ROUTING]        # default: gpu balanced (bf16)
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe_plugin.bench.layer_inputs import CONFIGS, make_inputs
from megamoe_plugin.bench.ours import megatron_peer, ours


def main(name="gpu", routing="balanced", steps=5):
    c = CONFIGS[name]
    x, wg, w1, w2 = make_inputs(c["H"], c["F"], c["E"], c["k"], c["T"], routing)
    dev, dt = torch.device("cuda"), torch.bfloat16
    runs = {"ours dropless (auto kernel)": ours(x, wg, w1, w2, c["k"], kernel="auto", device=dev, dtype=dt)[0],
            "ours dropless (loop kernel)": ours(x, wg, w1, w2, c["k"], kernel="loop", device=dev, dtype=dt)[0]}
    try:
        runs["megatron-core SequentialMLP"] = megatron_peer(x, wg, w1, w2, c["k"], device=dev, dtype=dt)[0]
    except Exception as e:                      # megatron-core missing: profile ours alone
        print(f"megatron-core SequentialMLP skipped: {type(e).__name__}: {e}")
    for label, step in runs.items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events) / steps / 1e3
        print(f"\n## {label}: config {name} {routing}, bf16, {total:.2f} ms of GPU kernels per forward+backward")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main(*sys.argv[1:3])
