"""Run on every rank of an (emulated) cluster: time a torch.distributed all-to-all-v in which rank 0 sends a fixed
number of bytes to the last rank and nothing else moves (one direction of one link), and write rank 0's median
to argv[1] as JSON.

One direction per link on purpose: a gloo all-to-all that saturates both directions of the same connection runs at
either the full or half the shaped rate, run by run (gloo's, not the network's: two TCP streams, or one TCP
connection carrying both directions, reach the full rate both ways on the same links; docs/cluster.md)."""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
n = (int(sys.argv[2]) if len(sys.argv) > 2 else 4 << 20) // 4
ins = [n if rank == 0 and r == world - 1 else 0 for r in range(world)]
outs = [n if rank == world - 1 and r == 0 else 0 for r in range(world)]
x, y = torch.zeros(sum(ins)), torch.empty(sum(outs))
times = []
for i in range(7):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(y, x, outs, ins)
    times.append(time.perf_counter() - t0)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"seconds": statistics.median(times[1:]), "bytes_per_peer": n * 4}, f)
dist.destroy_process_group()
