"""`megamoe train` checkpoint sets, for real (gloo processes running train.main):

- a set torn by a kill between two ranks' renames is detected; the previous complete set is resumed from, and
  continues exactly as the uninterrupted run; with no complete set left the resume is refused, naming the files;
- a checkpoint resumes at another expert-parallel size (2 -> 1, 2 -> 4, 4 -> 2) with the same next-step loss as a
  resume at the saved size on the same world (every expert's weights and Adam state carried by logical id);
- bad checkpoints and mismatched models are argparse errors before the corpus is read or the model built.
"""
import json
import os
import shutil

import pytest

from conftest import run_distributed
from megamoe_plugin import train

TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
        "--batch-size", "4", "--corpus-bytes", "300000", "--threads", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--log-interval", "1", "--moe-every", "1", "--steps", "8"]


def _worker(rank, world, argv, out):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_WORLD_SIZE=str(world))   # as torchrun sets them
    res = train.main(argv)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({h["step"]: h["loss"] for h in res.history}, f)


def _run(tmp_path, world, ep, *argv, cache):
    out = str(tmp_path / f"losses{len(os.listdir(tmp_path))}.json")
    flags = [*TINY, "--corpus-cache", cache, "--moe-expert-parallel-size", str(ep), *argv]
    run_distributed(_worker, world, flags, out)
    with open(out) as f:
        return {int(k): v for k, v in json.load(f).items()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.mark.slow
def test_torn_set_falls_back_to_the_previous_complete_one_or_is_refused(tmp_path, cache, single_process, capfd):
    ck = str(tmp_path / "ck")
    full = _run(tmp_path, 2, 2, "--save", ck, "--save-interval", "2", "--exit-interval", "6", cache=cache)
    # now: ck.rank{0,1} (step 6), their .prev (step 4), ck.manifest.json (6) and .prev (4)
    assert json.load(open(ck + ".manifest.json"))["step"] == 6
    assert json.load(open(ck + ".manifest.json.prev"))["step"] == 4
    # a kill between the two ranks' renames of the step-6 save: rank 1 still has its step-4 file, the manifest
    # of step 6 was never written
    shutil.copy(ck + ".rank1.prev", ck + ".rank1")
    os.remove(ck + ".manifest.json")
    resumed = _run(tmp_path, 2, 2, "--resume", ck, cache=cache)
    out = capfd.readouterr().out
    assert "resuming from the previous complete one, step 4" in out and "resumed from" in out, out[-2000:]
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), (resumed, full)
    # no complete set left: refused before anything runs, naming the file that does not match
    shutil.copy(ck + ".rank0", ck + ".rank0.prev")       # rank 0's step-4 copy is gone too
    with pytest.raises(SystemExit):
        train.main([*TINY, "--corpus-cache", cache, "--resume", ck])
    err = capfd.readouterr().err
    assert "no complete checkpoint set" in err and "ck.rank0" in err and "missing or differ" in err, err


@pytest.mark.slow
def test_resharding_across_expert_parallel_sizes_keeps_the_next_step(tmp_path, cache, single_process, capfd):
    ck2, ck4 = str(tmp_path / "ck2"), str(tmp_path / "ck4")
    _run(tmp_path, 2, 2, "--save", ck2, "--exit-interval", "4", cache=cache)
    # two steps after each resume: the first loss checks the weights, the second the Adam state too
    same = _run(tmp_path, 2, 2, "--resume", ck2, "--exit-interval", "6", cache=cache)       # no reshard
    to_one = _run(tmp_path, 2, 1, "--resume", ck2, "--exit-interval", "6", cache=cache)     # 2 -> 1
    assert "resharding the step-4 checkpoint from expert-parallel size 2 to 1" in capfd.readouterr().out
    world4 = _run(tmp_path, 4, 2, "--resume", ck2, "--exit-interval", "6", cache=cache)     # no reshard
    to_four = _run(tmp_path, 4, 4, "--resume", ck2, "--exit-interval", "6", "--save", ck4, cache=cache)  # 2 -> 4
    four = _run(tmp_path, 4, 4, "--resume", ck4, cache=cache)                                # no reshard
    to_two = _run(tmp_path, 4, 2, "--resume", ck4, cache=cache)                              # 4 -> 2
    for got, want, steps in ((to_one, same, (5, 6)), (to_four, world4, (5, 6)), (to_two, four, (7, 8))):
        assert sorted(got) == list(steps)
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert len({round(same[6], 6), round(world4[6], 6), round(four[8], 6)}) == 3    # three distinct situations


def test_bad_checkpoints_are_argparse_errors_before_anything_is_built(tmp_path, single_process, capsys,
                                                                     monkeypatch):
    import megamoe_plugin.train as t
    built = []
    monkeypatch.setattr(t, "build_corpus", lambda *a, **k: built.append(1))
    ck = str(tmp_path / "ck.pt")
    open(ck, "wb").write(b"\x00" * 100)                         # garbage, no manifest
    cases = [(["--resume", ck], "not a readable checkpoint"),
             (["--resume", str(tmp_path / "none.pt")], "no complete checkpoint set"),
             (["--moe-placement", "nope"], "--moe-placement='nope': unknown policy"),
             (["--moe-placement", "no_such_module:Policy"], "cannot import it"),
             (["--moe-placement", "flexmoe", "--moe-placement-spare-slots", "0"], "needs spare vExpert slots"),
             (["--moe-placement", "shadow", "--moe-placement-profile", "nope.json"], "unknown hardware profile")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            t.main([*TINY, *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err, (argv, err)
    assert not built                                             # nothing was read or built for any of them


def test_a_checkpoint_of_another_model_is_refused_before_the_corpus(tmp_path, single_process, capsys, monkeypatch):
    ck = str(tmp_path / "ck.pt")
    train.main([*TINY, "--steps", "1", "--save", ck])
    import megamoe_plugin.train as t
    built = []
    monkeypatch.setattr(t, "build_corpus", lambda *a, **k: built.append(1))
    for argv, needle in ((["--hidden", "32"], "--hidden: checkpoint 64, now 32"),
                         (["--moe-num-experts", "4"], "--moe-num-experts: checkpoint 8, now 4")):
        with pytest.raises(SystemExit):
            t.main([*TINY, "--resume", ck, *argv])
        err = capsys.readouterr().err
        assert "the checkpoint does not match this model" in err and needle in err, err
    assert not built
