"""Inference deployment (paper 004, Meta's MoE deployment): dynamic gating at inference is the core's dropless path
in eval mode; this package adds expert buffering (a device cache of hot experts backed by CPU memory), the cache
simulator over recorded routing traces (LIFO / FIFO / LRU / LFU and Belady's MIN) and expert load balancing
placements (greedy, anti-correlation) applied as expert permutations."""
