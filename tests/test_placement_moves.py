"""Moves behind the next step (placement/moves.py): which batches must run in order, blocking."""
from megamoe_plugin.placement.moves import chained
from megamoe_plugin.placement.state import Move


def test_a_batch_that_reads_or_refills_a_slot_it_receives_into_is_chained():
    into_r1_s2 = Move("expand", 0, 0, 1, 0, 2, 8)                 # rank 0 slot 0 -> rank 1 slot 2
    # independent moves, and a slot freed by one move and refilled by a later one: posted together
    assert not chained([into_r1_s2, Move("migrate", 3, 1, 0, 1, 2, 8)])
    assert not chained([Move("migrate", 3, 1, 0, 1, 2, 8), Move("expand", 2, 0, 1, 0, 1, 8)])
    assert not chained([into_r1_s2, Move("shrink", 1, 0, None, 1, None, 0)])
    # a later move reads, frees or overwrites rank 1 slot 2 before its rows have arrived: in order, blocking
    assert chained([into_r1_s2, Move("migrate", 0, 1, 2, 2, 3, 8)])
    assert chained([into_r1_s2, Move("shrink", 0, 1, None, 2, None, 0)])
    assert chained([into_r1_s2, Move("expand", 5, 3, 1, 0, 2, 8)])
    # a move within one rank (shared weights) receives nothing
    assert not chained([Move("expand", 0, 1, 1, 0, 2, 0), Move("shrink", 0, 1, None, 2, None, 0)])
