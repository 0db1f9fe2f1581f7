"""FlexMoE's Scheduler + Policy Maker (paper 001 §3.3-§3.4, Algorithms 1 and 2) as a pure planner.

``FlexMoEPlanner.plan(state, counts) -> [Move, ...]``: from one layer's global counts [P, E] (the last step's,
as the after-step hook sees them) and its ``PlacementState``, the Expand / Shrink / Migrate primitives to execute
before the next step, in order. The state passed in is not modified (the moves are applied to a copy; the runtime
applies them to its own with ``PlacementState.apply`` after executing them).

Algorithm (all times are ``CostModel`` predictions of one layer's step, Eq. 5 = T_C (Eq. 7 / Eq. 1) + T_A2A (Eq. 8
on the topology) + T_Sync (Eq. 9); see ``perfmodel.cost``):

1. Trigger (Alg. 1 line 3): nothing but step 4 unless the balance ratio (Eq. 6, over ranks after Alg. 3 routing)
   exceeds ``threshold``.
2. Policy Maker step (Alg. 2): cap_e = I_e / n_e per vExpert; e0 = argmax cap_e, e1 = argmin cap_e among the
   experts with more than one vExpert (ties: lowest id). Candidates, in this order:
   a. Expand e0 into a free slot of one of the candidate ranks (the ``candidate_ranks`` least loaded ranks with
      room, then the ``candidate_ranks`` best connected to e0's replicas; all ranks when None), copying its
      states from the replica with the cheapest transfer;
   b. for each rank r holding e1: Shrink e1 on r, then Expand e0 into the freed slot (the paper's pair);
   c. for each rank r holding e1: Shrink e1 on r alone (frees a slot and may save its synchronisation; no cost);
   d. (ours) the most loaded rank after routing, r*: for its ``bottleneck_experts`` vExperts with the most tokens
      there, x: Expand x (as a.), and when x has other replicas, Shrink x on r* and Migrate x from r* to a
      candidate rank. Alg. 2 only looks at per-vExpert loads; with several vExperts per rank the slowest rank
      can be made of an expert that is not the argmax (its own expert + a replica's share), and then no
      candidate of a-c lowers the step time.
   Each candidate's score is t1 + transfer / ``horizon``, where t1 is the predicted step time after it and
   transfer = ``CostModel.move_time(model-state bytes, src, dst)`` of its Expand / Migrate (paper 001
   §3.4 "Expert Adjustment Cost", times the measured share the steps wait for; Shrink costs nothing). The best
   candidate (lowest score, first in the order above on ties) is taken and the step repeats while the balance
   ratio still exceeds the threshold (Alg. 1 lines 3-9) and the move budget lasts.
3. Stop (Alg. 1 line 5, "no beneficial modification"): the paper stops at the first step whose t1 does not beat
   t0. Because the step time is a max over ranks, two equally hot experts make a plateau: expanding either alone
   gains nothing, both together do. So a step that does not beat the best (time + all transfers so far /
   horizon) is still taken up to ``lookahead`` times in a row, and the plan is cut back to its best prefix: the
   moves kept always predict t_after + transfer / horizon < t_before (``lookahead=0`` is the paper's rule).
4. Migrate (Alg. 1 line 11, run on every call): for every expert on several ranks (ascending id), moving one of
   its replicas to a free slot of another rank where its all-reduce group becomes cheaper (Eq. 9 smaller, e.g.
   all replicas on one node); the ``candidate_ranks`` largest synchronisation savings are scored like the above
   (full predicted time + transfer / horizon) and the best kept if it beats t0; repeat.

``min_gain``: a plan (and each Migrate) is kept only when it predicts at least this fraction of the layer's step
saved, transfers included: gains within the cost model's error are not worth a move (the policies use 5%).

``horizon``: the number of steps over which a move's transfer is paid back (1 = it must pay for itself within one
step, the literal "Eq. 5 + move time"; the hook's interval is a natural larger value when the placement is kept
that long). Deterministic: same state + counts -> same moves on every rank.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .state import Move, PlacementState, model_state_bytes, resolve_cost_model

__all__ = ["FlexMoEPlanner", "StaticPlanner"]


class StaticPlanner:
    """Static expert parallelism: never moves anything (the baseline in the simulator)."""

    def plan(self, state, counts) -> List[Move]:
        return []


class FlexMoEPlanner:
    """FlexMoE's policy (module docstring). cost_model: a ``perfmodel.cost.CostModel`` or a factory ``f(num_ranks)
    -> CostModel``. threshold: balance ratio (Eq. 6) above which Expand/Shrink are planned. max_moves: Move records
    per call. horizon: steps transfers are amortised over. candidate_ranks: expansion targets (least loaded, best
    connected) and migrations scored per step; None = all. migrate: run the Migrate phase. lookahead: non-improving
    steps explored past a plateau. bottleneck_experts: vExperts of the most loaded rank given candidates of their
    own (d.; 0 = the paper's a-c). state_bytes: bytes per Expand/Migrate (default ``model_state_bytes(shape)``).
    ``last`` (after ``plan``): triggered, balance_before/after, time_before/after (predicted s, without transfer),
    transfer_time (predicted s of the moves), moves."""

    def __init__(self, cost_model, threshold: float = 1.2, max_moves: int = 16, horizon: float = 1.0,
                 candidate_ranks: Optional[int] = 4, migrate: bool = True, state_bytes: Optional[int] = None,
                 lookahead: int = 4, bottleneck_experts: int = 2, min_gain: float = 0.0):
        if threshold < 1.0:
            raise ValueError(f"threshold must be >= 1 (the balance ratio is >= 1), got {threshold}")
        if max_moves < 0:
            raise ValueError(f"max_moves must be >= 0, got {max_moves}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        if candidate_ranks is not None and candidate_ranks < 1:
            raise ValueError(f"candidate_ranks must be >= 1 or None, got {candidate_ranks}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        self._cost, self._cost_cache = cost_model, {}
        self.threshold, self.max_moves, self.horizon = float(threshold), int(max_moves), float(horizon)
        self.candidate_ranks, self.migrate, self.state_bytes = candidate_ranks, bool(migrate), state_bytes
        self.lookahead, self.bottleneck_experts, self.min_gain = int(lookahead), int(bottleneck_experts), float(min_gain)
        self._sync_cache: Dict[int, Dict[Tuple[int, ...], float]] = {}   # id(cost model) -> group -> Eq. 9
        self.last: dict = {}          # what the last plan() saw and predicted (for logging)

    def cost_model(self, num_ranks: int):
        return resolve_cost_model(self._cost, self._cost_cache, num_ranks)

    # --- the plan ----------------------------------------------------------------------------------------------
    def plan(self, state: PlacementState, counts) -> List[Move]:
        cm = self.cost_model(state.num_ranks)
        c = state._counts(counts)
        nbytes = self.state_bytes if self.state_bytes is not None else model_state_bytes(cm.shape)
        s = state.copy()
        moves: List[Move] = []
        t0 = self._time(cm, s, c)
        ratio0 = s.balance_ratio(c)
        info = {"triggered": ratio0 > self.threshold, "balance_before": ratio0, "time_before": t0,
                "transfer_time": 0.0}
        ratio = ratio0
        # Alg. 1 lines 3-9 with Alg. 2 steps; a step that does not beat the best time so far is still taken up to
        # `lookahead` times in a row (plateaus), and the plan is cut back to its best prefix at the end
        best_len, best_t, best_state, best_transfer, stale = 0, t0, s, 0.0, 0
        transfer_sum = 0.0
        while ratio > self.threshold and len(moves) < self.max_moves:
            cands = self._policy_candidates(cm, s, c, nbytes)
            step = self._best(cm, s, c, cands, self.max_moves - len(moves))
            if step is None:
                break
            score, s, t1, new, transfer = step
            moves += new
            transfer_sum += transfer
            ratio = s.balance_ratio(c)
            if t1 + transfer_sum / self.horizon < best_t * (1.0 - 1e-9):
                best_len, best_t, best_state, best_transfer, stale = len(moves), t1 + transfer_sum / self.horizon, \
                    s, transfer_sum, 0
            else:
                stale += 1
                if stale > self.lookahead:
                    break
        if best_len and best_t > t0 * (1.0 - self.min_gain):     # a predicted gain within the model's error
            best_len, best_state, best_transfer = 0, state.copy(), 0.0
        moves, s = moves[:best_len], best_state
        info["transfer_time"] = best_transfer
        t0 = self._time(cm, s, c)
        if self.migrate:
            while len(moves) < self.max_moves:
                step = self._best(cm, s, c, self._migrate_candidates(cm, s, nbytes), self.max_moves - len(moves))
                if step is None or step[0] >= t0 * (1.0 - max(self.min_gain, 1e-9)):
                    break
                _, s, t0, new, transfer = step
                moves += new
                info["transfer_time"] += transfer
        info.update(balance_after=s.balance_ratio(c), time_after=t0, moves=len(moves))
        self.last = info
        return moves

    # --- candidates ---------------------------------------------------------------------------------------------
    def _policy_candidates(self, cm, s: PlacementState, c: torch.Tensor, nbytes: int):
        """Alg. 2's candidates (a-c of the module docstring), then the bottleneck-rank ones (d): lists of primitive
        calls (kind, expert, rank[, src]) in tie-break order."""
        load_e = c.sum(0)
        n = s.multiplicity().sum(1)
        cap = load_e / n
        e0 = int(torch.argmax(cap))                        # first maximum: lowest id on ties
        if float(load_e[e0]) <= 0:
            return []
        per = s.route(c).sum(0)                            # [E, P] tokens of expert e computed on rank q
        rank_load = per.sum(0)
        out = []
        for r in self._targets(cm, s, e0, rank_load):
            out.append([("expand", e0, r, self._source(cm, s, e0, r, nbytes))])
        multi = [e for e in range(s.num_experts) if e != e0 and n[e] > 1]
        if multi:
            e1 = min(multi, key=lambda e: (float(cap[e]), e))
            for r in s.ranks_of(e1):
                if s.count(e0, r) < s.max_replicas_per_rank:
                    out.append([("shrink", e1, r), ("expand", e0, r, self._source(cm, s, e0, r, nbytes))])
            for r in s.ranks_of(e1):
                out.append([("shrink", e1, r)])
        # (d) the most loaded rank: relieve its heaviest vExperts
        hot = int(torch.argmax(rank_load))
        mine = sorted({e for e in s.slots_of(hot) if e is not None}, key=lambda e: (-float(per[e, hot]), e))
        for x in mine[:self.bottleneck_experts]:
            if float(per[x, hot]) <= 0:
                continue
            targets = self._targets(cm, s, x, rank_load)
            if x != e0:
                for r in targets:
                    out.append([("expand", x, r, self._source(cm, s, x, r, nbytes))])
            if n[x] > 1:
                out.append([("shrink", x, hot)])
                for r in targets:
                    if not s.count(x, r):
                        out.append([("migrate", x, hot, r)])
        return out

    def _targets(self, cm, s: PlacementState, e: int, rank_load: torch.Tensor) -> List[int]:
        room = [r for r in range(s.num_ranks) if s.free_slots(r) and s.count(e, r) < s.max_replicas_per_rank]
        k = self.candidate_ranks
        if k is None or len(room) <= k:
            return sorted(room, key=lambda r: (float(rank_load[r]), r))
        by_load = sorted(room, key=lambda r: (float(rank_load[r]), r))[:k]
        bw = cm.network.bandwidth_matrix()
        holders = s.ranks_of(e)

        def near(r):
            return max(float("inf") if h == r else float(bw[h, r]) for h in holders)

        by_bw = sorted(room, key=lambda r: (-near(r), float(rank_load[r]), r))[:k]
        return by_load + [r for r in by_bw if r not in by_load]

    @staticmethod
    def _source(cm, s: PlacementState, e: int, dst: int, nbytes: int) -> Optional[int]:
        if s.count(e, dst):
            return None                                      # shared weights on dst: nothing to send
        return min(s.ranks_of(e), key=lambda r: (cm.move_time(nbytes, r, dst), r))

    def _migrate_candidates(self, cm, s: PlacementState, nbytes: int):
        """Migrations that shrink an expert's all-reduce cost (Eq. 9), largest saving first."""
        size = cm.shape.expert_param_bytes
        found = []
        free = [r for r in range(s.num_ranks) if s.free_slots(r)]
        for e, group in s.replica_groups():
            before = self._sync(cm, group, size)
            for src in group:
                others = [r for r in group if r != src]
                for dst in free:
                    if dst in group:
                        continue
                    after = self._sync(cm, tuple(sorted(others + [dst])), size)
                    if after < before:
                        found.append((before - after, e, src, dst))
        found.sort(key=lambda x: (-x[0], x[1], x[2], x[3]))
        if self.candidate_ranks is not None:
            found = found[:self.candidate_ranks]
        return [[("migrate", e, src, dst)] for _, e, src, dst in found]

    # --- scoring ------------------------------------------------------------------------------------------------
    def _best(self, cm, s: PlacementState, c: torch.Tensor, candidates, budget: int):
        """The candidate with the lowest score t1 + transfer / horizon (first on ties), applied to a copy of s:
        (score, new state, t1, moves, transfer), or None when there is no candidate within the budget."""
        nbytes = self.state_bytes if self.state_bytes is not None else model_state_bytes(cm.shape)
        best = None
        for cand in candidates:
            if len(cand) > budget:
                continue
            trial = s.copy()            # (kind, expert, rank[, src]) / ("migrate", expert, src, dst), in order
            new = [trial.shrink(*op[1:]) if op[0] == "shrink" else getattr(trial, op[0])(*op[1:], state_bytes=nbytes)
                   for op in cand]
            transfer = sum(cm.move_time(m.nbytes, m.src, m.dst) for m in new if m.communicates)
            t1 = self._time(cm, trial, c)
            score = t1 + transfer / self.horizon
            if best is None or score < best[0]:
                best = (score, trial, t1, new, transfer)
        return best

    def _sync(self, cm, group: Tuple[int, ...], size: int) -> float:
        cache = self._sync_cache.setdefault(id(cm), {})
        if group not in cache:
            cache[group] = cm.sync_time(size, group)
        return cache[group]

    def _time(self, cm, s: PlacementState, c: torch.Tensor) -> float:
        """Eq. 5 of one layer step under s: ``CostModel.layer_time`` (compute + all-to-all + Eq. 9 per replicated
        expert), through ``layer_time_matrix`` with the Eq. 9 terms memoised per group."""
        return cm.layer_time_matrix(c, s.multiplicity(), self._sync_cache.setdefault(id(cm), {})).total
