"""Training runs for `megamoe reproduce tamoe | fastermoe`: `megamoe train` inside ``fork_processes`` workers, and
the time to a target loss.

``train_interleaved_in_workers`` trains several configurations interleaved: every run advances one evaluation
interval at a time (``--exit-interval`` with ``--save`` / ``--resume``, which continues the run exactly), in a
rotating order, so a shared machine's slow phases hit all runs alike; only the training steps are timed (the
trainer's own ``train_seconds``: start-up, checkpoints and evaluations excluded). ``train_in_workers`` runs one
configuration straight through.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["train_in_workers", "train_interleaved_in_workers", "warm_up_in_workers", "time_to_target",
           "common_target"]


def _flag(flags: Sequence[str], name: str) -> str:
    return flags[len(flags) - 1 - list(reversed(flags)).index(name) + 1]


def train_in_workers(rank: int, flags: List[str], log_path: str, trace_path: str) -> Optional[dict]:
    """Inside ``fork_processes`` workers (collective): ``megamoe train`` with ``flags`` plus a routing trace;
    rank 0's log goes to ``log_path``. Rank 0 returns evals [(step, valid loss)], per-log-line training seconds
    (tokens/s turned back into time, evaluation excluded), the merged routing counts [S, L, P, E] and the wall
    time of the whole call; the other ranks None."""
    from .. import train
    from ..stats import load_trace
    t0 = time.perf_counter()
    with open(log_path if rank == 0 else os.devnull, "w") as f, contextlib.redirect_stdout(f):
        res = train.main(list(flags) + ["--trace", trace_path])
    dist.barrier()
    if rank:
        return None
    world = dist.get_world_size()
    tokens_per_step = int(_flag(flags, "--batch-size")) * int(_flag(flags, "--seq-len")) * world
    elapsed, prev, seconds = 0.0, res.start_step, {}
    for h in res.history:
        elapsed += (h["step"] - prev) * tokens_per_step / max(h["tokens_per_s"], 1e-9)
        seconds[h["step"]] = elapsed
        prev = h["step"]
    trace = load_trace(trace_path)
    return {"evals": [(int(e["step"]), float(e["loss"])) for e in res.evals], "train_seconds": seconds,
            "counts": trace["counts"].tolist(), "wall_s": time.perf_counter() - t0,
            "tokens_per_step": tokens_per_step, "log": log_path}


def warm_up_in_workers(rank: int, flags: List[str], steps: int = 3) -> None:
    """Inside ``fork_processes`` workers (collective): a few silent steps of ``megamoe train`` with ``flags`` so
    that one-time costs (allocator, kernel selection, connections) do not land in the first timed run."""
    from .. import train
    with open(os.devnull, "w") as f, contextlib.redirect_stdout(f):
        train.main(list(flags) + ["--steps", str(steps), "--eval-interval", "0", "--eval-batches", "1",
                                  "--log-interval", str(steps)])
    dist.barrier()


def time_to_target(run: dict, target: float):
    """(steps, training seconds) at the first evaluation whose validation loss is <= target; (None, None) if none."""
    for step, loss in run["evals"]:
        if loss <= target + 1e-12:
            secs = run["train_seconds"].get(step, run["train_seconds"].get(str(step)))
            return step, secs
    return None, None


def common_target(runs: Sequence[dict]) -> float:
    """The worse run's best validation loss: every run reaches it."""
    return max(min(loss for _, loss in r["evals"]) for r in runs)


def train_interleaved_in_workers(rank: int, runs: Dict[str, List[str]], log_paths: Dict[str, str],
                                 tmp: str) -> Optional[Dict[str, dict]]:
    """Inside ``fork_processes`` workers (collective): every run of ``runs`` (name -> ``megamoe train`` flags, the
    same ``--steps`` and ``--eval-interval``) trained in chunks of one evaluation interval, chunk i of every run
    before chunk i+1 of any, the order rotating by one run per chunk (module docstring). Rank 0 returns, per run,
    what ``train_in_workers`` returns: evals [(step, loss)], training seconds at each evaluation (the trainer's own
    step timing), the routing counts [S, L, P, E] of all chunks, the wall time spent in the run's calls."""
    from .. import train
    from ..stats import load_trace
    names = list(runs)
    every = int(_flag(runs[names[0]], "--eval-interval"))
    total = int(_flag(runs[names[0]], "--steps"))
    for name, flags in runs.items():
        if int(_flag(flags, "--eval-interval")) != every or int(_flag(flags, "--steps")) != total:
            raise ValueError(f"run {name}: every interleaved run needs --steps {total} --eval-interval {every}")
    out = {n: {"evals": [], "train_seconds": {}, "counts": [], "wall_s": 0.0, "log": log_paths[n]} for n in names}
    trained_s = dict.fromkeys(names, 0.0)           # training seconds of each run's chunks so far
    for chunk in range((total + every - 1) // every):
        for name in names[chunk % len(names):] + names[:chunk % len(names)]:
            ckpt, trace = os.path.join(tmp, f"ckpt_{name}"), os.path.join(tmp, f"trace_{name}_{chunk}")
            argv = list(runs[name]) + ["--exit-interval", str(every), "--save", ckpt, "--trace", trace]
            if chunk:
                argv += ["--resume", ckpt]
            t0 = time.perf_counter()
            with open(log_paths[name] if rank == 0 else os.devnull, "a") as f, contextlib.redirect_stdout(f):
                res = train.main(argv)
            dist.barrier()
            r = out[name]
            r["wall_s"] += time.perf_counter() - t0
            if rank:
                continue
            for e in res.evals:
                step = int(e["step"])
                r["evals"].append((step, float(e["loss"])))
                r["train_seconds"][step] = trained_s[name] + res.eval_train_seconds[step]
            trained_s[name] += res.train_seconds
            r["counts"].append(torch.as_tensor(load_trace(trace)["counts"]))
    if rank:
        return None
    world = dist.get_world_size()
    for name, r in out.items():
        flags = runs[name]
        r["counts"] = torch.cat(r["counts"]).tolist()
        r["tokens_per_step"] = int(_flag(flags, "--batch-size")) * int(_flag(flags, "--seq-len")) * world
    return out
