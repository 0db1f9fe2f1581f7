"""DynaMoE in the megatron-core example trainer, for real: 2 gloo processes started as torchrun starts them, EP=2, capacity dispatch
with --moe-plugin-capacity-policy dynamic and the assignment cache keyed by the trainer's sample indices over
repeated epochs (--epoch-samples); a resumed run restores the capacities in force."""
import os
import re

import pytest
import torch

from test_megatron_trainer import cache, run  # noqa: F401  (fixture and launcher)

DYN = ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0", "--global-batch-size", "8",
       "--moe-plugin-capacity-policy", "dynamic", "--moe-plugin-assignment-cache",
       "--moe-plugin-assignment-cache-min-epoch", "2", "--moe-plugin-assignment-cache-on", "0.5",
       "--moe-plugin-assignment-cache-off", "0.3", "--epoch-samples", "32", "--log-interval", "4"]
FRAG = re.compile(r"iteration\s+(\d+)/\d+ .*cf ([0-9.]+) drop ([0-9.]+) recompiles (\d+) cache (on|off)")


@pytest.mark.one_release             # DynaMoE's capacities and cache are the plugin's own logic
def test_dynamic_capacity_and_cache_in_the_megatron_trainer(cache, tmp_path):
    save = str(tmp_path / "ckpt")
    losses, out = run(2, [*DYN, "--train-iters", "40", "--save", save, "--save-interval", "20"], cache)
    rows = {int(i): (float(cf), float(d), int(r), c) for i, cf, d, r, c in FRAG.findall(out)}
    assert sorted(rows) == list(range(4, 41, 4)), out[-3000:]
    assert all(v == v and v < 10 for v in losses.values()) and losses[40] < losses[4]
    assert rows[40][2] > 0                                   # capacities were recompiled
    assert rows[4][3] == "off" and rows[40][3] == "on"       # caching switched on after epoch 1 (min epoch 2)
    # both ranks saved the same capacities (decisions agree job-wide)
    per_rank = [torch.load(os.path.join(save, "iter_0000020", f"extra_rank{r}.pt"), weights_only=True)["dynamic"]
                for r in (0, 1)]
    caps = per_rank[0]["capacity"]
    assert caps == per_rank[1]["capacity"] and all(c is not None for c in caps.values())
    assert per_rank[0]["cache"]["tables"] and per_rank[0]["cache_policy"]["history"]
    # resume at 20: the restored capacities are those in force, the run continues with dynamic capacity
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("20")
    losses2, out2 = run(2, [*DYN, "--train-iters", "24", "--load", save], cache)
    assert "at iteration 20" in out2 and 24 in losses2
    resumed = {int(i): (int(r), c) for i, _, _, r, c in FRAG.findall(out2)}
    assert resumed[24][0] >= per_rank[0]["recompilations"] > 0      # the policy's state came back
    assert resumed[24][1] == ("on" if per_rank[0]["cache"]["active"] else "off")
