"""Run on every rank of an (emulated) cluster: time a torch.distributed all-to-all of a fixed size between the ranks
and write rank 0's median to argv[1] as JSON."""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
world = dist.get_world_size()
per_peer = int(sys.argv[2]) if len(sys.argv) > 2 else 4 << 20
x = torch.zeros(world * per_peer // 4)
y = torch.empty_like(x)
times = []
for i in range(4):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(y, x)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"seconds": statistics.median(times[1:]), "bytes_per_peer": per_peer}, f)
dist.destroy_process_group()
