"""The built-in placement policies ``--moe-placement flexmoe | shadow | eplb``: what runs in the after-step hook
(hooks.py) on every rank between two optimizer steps, for every MoE layer of this rank:

1. the routing since the last run: each rank's [E] counts all-gathered over the expert-parallel group into [P, E]
   and summed over the expert-data-parallel group (every group plans from the same numbers and keeps the same
   placement), with the counts of the planners' window (``PlacementRuntime.recent``) in the same collective;
2. the decision, deterministic on every rank: ``FlexMoEPlanner`` (paper 001 Alg. 1-2, at most
   ``FLEXMOE_MAX_MOVES`` per layer), ``ShadowPlanner`` (paper 003 Alg. 1, Eqs. 7-8) or ``EPLBPlanner`` (DeepSeek's
   EPLB), each on the cost model of ``--moe-placement-profile`` (``auto``: the job calibrated at its first run),
   each keeping a change only when it is predicted to save ``_required_gain`` of the MoE layers' time; the ranks of
   a group check that they agree;
3. execution (``apply_placement``: moves with their optimizer state, point to point; the replica groups);
4. the pay-off guard (guard.py) judges each change on the measured steps after it, and an idle policy backs off
   (``_back_off``).

``metrics`` after a run are listed in docs/placement.md ("Metrics").
"""
from __future__ import annotations

import time
import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError, MoEConfig, flag
from ..parallel import comm_device
from .guard import WAIT, PayoffGuard, job_max_many
from .hooks import StepContext, register_placement_policy
from .optim_state import check_optimizer_supported
from .runtime import apply_placement, group_cache
from .eplb import EPLBPlanner
from .flexmoe import FlexMoEPlanner
from .shadow import ShadowPlanner
from .state import PlacementState

__all__ = ["EPLBPolicy", "FlexMoEPolicy", "ShadowPolicy", "gather_counts"]

MIN_PREDICTED_GAIN = 0.05    # the least predicted saving, a fraction of the MoE layers' time, worth a change
FLEXMOE_MAX_MOVES = 4         # Expand / Shrink / Migrate per layer and run
IDLE_GAP_STEPS = 8            # the longest gap, in steps, between two runs of a policy that keeps changing nothing


def gather_counts(runtimes, recent: bool = False):
    """Collective over the layers' expert-parallel (then expert-data-parallel) group: each layer's [P, E] float64
    counts of the training forwards since the last call, source rank x expert, all layers in one all-gather (and
    one all-reduce): a placement run costs two collectives however many MoE layers the model has. With ``recent``: a pair, those
    and the layers' [P, E] counts of their last closed steps (``PlacementRuntime.recent``), in the same
    collectives."""
    if not runtimes:
        return ([], []) if recent else []
    rt0 = runtimes[0]
    dev = comm_device(rt0.ep.group if rt0.ep.size > 1 else rt0.edp_group)
    rows = [rt.take_step_counts().to(dev, torch.float64) for rt in runtimes]
    if recent:
        rows += [rt.recent_counts().to(dev, torch.float64) for rt in runtimes]
    mine = torch.stack(rows)                                                                 # [L or 2L, E]
    parts = [mine]
    if rt0.ep.size > 1:
        parts = [torch.empty_like(mine) for _ in range(rt0.ep.size)]
        dist.all_gather(parts, mine.contiguous(), group=rt0.ep.group)
    counts = torch.stack(parts, 1)                                                           # [L, P, E]
    if rt0.edp_group is not None and dist.is_initialized() and dist.get_world_size(rt0.edp_group) > 1:
        dist.all_reduce(counts, group=rt0.edp_group)
    counts = list(counts.cpu())
    return (counts[:len(runtimes)], counts[len(runtimes):]) if recent else counts


def _static_placement(rt):
    """The layer's placement without the policy: contiguous blocks of experts, one slot each, nothing shadowed."""
    return PlacementState(rt.num_experts, rt.ep.size, rt.slots_per_rank, max_replicas_per_rank=1).placement()


def _agree(rt, decision) -> None:
    """The ranks of an expert-parallel group must have planned the same thing."""
    if rt.ep.size == 1:
        return
    h = zlib.crc32(repr(decision).encode()) & 0x7FFFFFFF
    t = torch.tensor([h, -h], dtype=torch.long, device=comm_device(rt.ep.group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.ep.group)
    if int(t[0]) != h or int(t[1]) != -h:
        raise RuntimeError("megamoe-plugin placement: the ranks of an expert-parallel group planned different "
                           "placements from the same counts (non-deterministic planner?)")


class _Policy:
    name = ""

    def __init__(self, cfg: MoEConfig):
        self.cfg = cfg
        self.profile = None                  # "auto": measured at the first run (every rank at the same step)
        from ..perfmodel.profiles import get_profile  # load order: perfmodel.cost imports placement.state, whose package imports this module
        if cfg.placement_profile != "auto":
            try:
                self.profile = get_profile(cfg.placement_profile)
            except ValueError as e:
                raise ConfigError(f"{flag('placement_profile')}={cfg.placement_profile!r}: {e}") from None
        self._min_gain = MIN_PREDICTED_GAIN        # what the planners must predict at this run (_required_gain)
        self._cost_models: Dict[tuple, object] = {}
        self._planners: Dict[tuple, object] = {}
        self.metrics: Dict[str, float] = {}
        self.calibrations = self.runs = self.total_moves = self.total_bytes = 0
        self.total_move_wait = 0.0                    # seconds the slowest rank spent on moves, so far
        self._clock: Optional[float] = None
        self._last_iteration: Optional[int] = None
        self._checked_optimizer = False
        self.guard = PayoffGuard(cfg.placement_guard)
        self._held_steps = 0                          # steps of runs skipped while held (their counts add up)
        self._idle_runs = 0                           # consecutive runs at the original placement with no change
        self._idle_skip = 0                           # runs still to skip after them (``_back_off``)
        self._horizon = float(cfg.placement_every)    # steps a move's transfer is amortised over at this run

    def _cm(self, bank, num_experts: int, num_ranks: int):
        key = (bank.hidden_size, bank.ffn_hidden_size, num_experts, num_ranks, bank.w1.element_size())
        if key not in self._cost_models:
            from ..perfmodel.cost import LayerShape  # load order: perfmodel.cost imports placement.state, whose package imports this module
            shape = LayerShape(bank.hidden_size, bank.ffn_hidden_size, num_experts,
                               bytes_per_element=bank.w1.element_size())
            self._cost_models[key] = self.profile.cost_model(shape, world_size=num_ranks)
        return key, self._cost_models[key]

    def decide(self, key, cm, rt, counts):
        raise NotImplementedError

    def _required_gain(self, layers, all_counts, every: int, step_s: Optional[float],
                       noise: Optional[float]) -> float:
        """The fraction of the MoE layers' predicted time a change must save: MIN_PREDICTED_GAIN, or more where the
        guard could not tell the saving from the steps' noise (``guard.resolvable_gain``, a fraction of the whole
        step, turned into one of the layers' predicted time through ``step_s``, the job's median step of the last
        window). ``noise``: the job's ``step_noise``, so every rank plans with the same threshold."""
        moe_s = self._placement_time(layers, all_counts, [(m.plan.placement.state, ()) for m in layers])
        need = self.guard.resolvable_gain(every, noise) * step_s / moe_s if (step_s and moe_s > 0) else 0.0
        return min(max(MIN_PREDICTED_GAIN, need), 0.95)

    def _back_off(self, acted: bool, layers, every: int) -> None:
        """A run that changed nothing at the original placement (nothing replicated or shadowed, no change pending)
        makes the policy skip the next 1, 2, 4, ... runs, up to IDLE_GAP_STEPS steps between runs; any change
        resets it. A skipped run costs the step nothing (no collective, no planning: counts add up for the next),
        while a run costs a few all-reduces and the planner's search. The same on every rank: every input is
        job-wide."""
        at_origin = (self.guard.pending is None and self.guard.at_origin
                     and not any(m.plan.placement.shadowed or m.plan.placement.state.total_replicas
                                 > m.plan.placement.num_experts for m in layers))
        if acted or not at_origin:
            self._idle_runs, self._idle_skip = 0, 0
            return
        self._idle_runs += 1
        self._idle_skip = min(2 ** (self._idle_runs - 1), max(0, IDLE_GAP_STEPS // max(every, 1) - 1))

    def _placement_time(self, layers, all_counts, placements) -> float:
        """The model's MoE time of one step with these counts under these (slot table, shadow set) per layer."""
        total = 0.0
        for layer, counts, (state, shadow) in zip(layers, all_counts, placements):
            rt = layer.plan.placement
            _, cm = self._cm(layer.experts_bank, rt.num_experts, rt.ep.size)
            total += cm.shadow_layer_time(counts, list(shadow), state.placement()).total if shadow \
                else cm.layer_time(counts, state.placement()).total
        return total

    def early_due(self) -> bool:
        """Whether the hook runs the policy between intervals: the guard's early look (``PayoffGuard.early_due``)."""
        return self.guard.early_due()                # no change is pending with the guard off

    def observe_step(self, seconds: float) -> None:
        """One training step's duration, from the after-step hook (the pay-off guard's measurements)."""
        self.guard.observe(seconds)

    def _ensure_profile(self, layers) -> None:
        """--moe-placement-profile auto: calibrate this job at the expert shape of its first MoE layer (collective:
        every rank runs the policies at the same step)."""
        if self.profile is not None:
            return
        bank = next((m.experts_bank for m in layers if getattr(m.plan, "placement", None) is not None), None)
        if bank is None:
            return
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        from ..perfmodel.autoprofile import auto_profile  # load order: perfmodel.cost imports placement.state, whose package imports this module
        self.profile = auto_profile(bank.hidden_size, bank.ffn_hidden_size, bank.w1.dtype,
                                    log=(lambda t: print(f"megamoe-plugin: {t}", flush=True)) if rank0 else None)
        self._cost_models.clear()
        self._planners.clear()
        self.calibrations += 1

    def __call__(self, ctx: StepContext) -> None:
        if not self._checked_optimizer:
            check_optimizer_supported(ctx.optimizer)
            self._checked_optimizer = True
        every = self.cfg.placement_every
        run_steps = max(int(getattr(ctx, "steps", 1)), 1)      # optimizer steps since the policy last ran
        last = getattr(ctx, "last_step", None)
        left = every if last is None else last - ctx.iteration     # steps a change (or an undo) can pay off in
        if left <= 0:                                  # the run's last step: nothing after it to pay a move back
            self._held_steps += run_steps
            return
        self._horizon = float(min(every, left))        # the planners amortise a move's transfer over these steps
        layers = [m for m in ctx.moe_layers if getattr(m.plan, "placement", None) is not None]
        steps = run_steps + self._held_steps
        gathered = []                                # the counts, when the verdict's drift needed them first

        def gather():
            # one gather a run (it takes the layers' counts): the steps' since the last run, and the planners'
            # window of the last steps (the same when the window is the interval), each as one step's
            counts, recent = gather_counts([m.plan.placement for m in layers], recent=True)
            window = min(len(layers[0].plan.placement.recent), steps) if layers else 0
            counts = [c / steps for c in counts]
            gathered.append((counts, [c / window for c in recent] if 0 < window < steps else counts))

        def old_placement_time(snapshots):
            if not gathered:
                gather()
            return self._placement_time(layers, gathered[0][0], [(state, shadow) for _, state, shadow in snapshots])

        verdict = self.guard.check(every, drift=old_placement_time if self.profile is not None else None)
        undo = verdict if isinstance(verdict, list) else None
        hold = verdict == WAIT or (undo is None and self.guard.paused(every, None if last is None else left))
        if not hold and undo is None and self._idle_skip > 0:
            self._idle_skip -= 1
            hold = True
        if (hold and verdict != WAIT and self.profile is not None and not gathered
                and not any(m.plan.placement.shadowed for m in layers)):
            # held (paused, stopped, or the guard's reference still short) with nothing to keep up to date: no
            # collective at all, so a policy that does not act costs the steps nothing; the layers' counts add up
            # for the next run
            if self.guard.stopped:                    # no later run will read them
                for m in layers:
                    m.plan.placement.take_step_counts()
                    m.plan.placement.take_dropped()
            else:
                self._held_steps += run_steps
            self.runs += 1
            return
        self._ensure_profile(ctx.moe_layers)
        now = time.perf_counter()
        measured = None
        if self._clock is not None and self._last_iteration is not None and ctx.iteration > self._last_iteration:
            measured = (now - self._clock) / (ctx.iteration - self._last_iteration)
        waits = [m.plan.placement.take_waits() for m in layers]          # (sync, shadow, move) per layer
        sync_wait, shadow_wait, move_wait = (sum(w[i] for w in waits) / d for i, d in enumerate((steps, steps, 1)))
        # the slowest rank's: every decision taken from it must be the same on every rank
        measured, baseline, noise, sync_wait, shadow_wait, move_wait = job_max_many([
            measured, self.guard.baseline(every), self.guard.step_noise(), sync_wait, shadow_wait, move_wait])
        self.guard.job_noise = noise
        changes, rows, decisions = [], [], []
        before = [(m.plan.placement.state.copy(), tuple(m.plan.placement.shadowed)) for m in layers]
        # the counts of the steps since the last run, as one step's: the cost model prices one step, against
        # which a move's one-off transfer is amortised over the interval
        self._held_steps = 0
        if not gathered:
            gather()                                                                            # one collective
        all_counts, plan_counts = gathered[0]
        self._min_gain = self._required_gain(layers, all_counts, every, baseline, noise)
        self.total_move_wait += move_wait or 0.0
        static_pred = 0.0
        for i, (layer, counts, plan) in enumerate(zip(layers, all_counts, plan_counts)):
            rt = layer.plan.placement
            bank = layer.experts_bank
            dropped = rt.take_dropped() / steps
            key, cm = self._cm(bank, rt.num_experts, rt.ep.size)
            before_loads = rt.state.rank_loads(counts, rt.shadowed)
            predicted = self._placement_time([layer], [counts], [(rt.state, rt.shadowed)])
            static_pred += cm.layer_time(counts, _static_placement(rt)).total
            if undo is not None:                     # the last change did not pay: put back what was there
                moves, shadow = undo[i][1], list(undo[i][2])
            elif hold:
                moves, shadow = [], None
            else:
                moves, shadow = self.decide(key, cm, rt, plan)
            decisions.append((moves, shadow))
            changes.append((rt, moves, bank))
            rows.append((rt, counts, dropped, before_loads, predicted, moves, shadow))
        if layers:
            _agree(layers[0].plan.placement, decisions)               # one check for every layer's plan
        sent = apply_placement(changes, ctx.optimizer)
        for rt, _, _, _, _, _, shadow in rows:
            if shadow is not None:
                rt.set_shadowed(shadow)
        if self.cfg.placement_overlap_sync and any(m.plan.placement.shadowed for m in layers):
            group_cache().ensure([g for m in layers for g in m.plan.placement.needed_groups()])
        changed = any(moves or (shadow is not None and set(shadow) != set(old[1]))
                      for (_, _, _, _, _, moves, shadow), old in zip(rows, before))
        self._back_off(changed or undo is not None, layers, every)
        if changed and undo is None:
            moved = any(row[5] for row in rows)      # else only the shadow sets changed: undone for free
            self.guard.record(baseline, time.perf_counter() - now, every, [m.plan.placement for m in layers],
                              [b[0] for b in before], [b[1] for b in before],
                              before_model_s=sum(row[4] for row in rows), free_undo=not moved)
        self._report(rows, sent, measured)
        if rows:
            self.metrics["predicted_static_step_s"] = static_pred
            self.metrics["step_noise"] = noise or 0.0
            self.metrics["required_gain"] = self._min_gain
            self.metrics["shadow_wait_s"] = shadow_wait
            self.metrics["sync_wait_s"] = sync_wait
            self.metrics["move_wait_s"] = move_wait
            self.metrics["move_wait_total_s"] = self.total_move_wait
        self._clock, self._last_iteration = time.perf_counter(), ctx.iteration
        self.runs += 1

    def _report(self, rows, sent: int, measured: Optional[float]) -> None:
        if not rows:
            self.metrics = {}
            return
        bal, bal_next = [], []
        replicas = shadowed = moves = 0
        exp_num = exp_den = predicted = routed = kept = 0.0
        for rt, counts, dropped, loads, pred, mv, _ in rows:
            total = float(loads.sum())
            bal.append(float(loads.max()) * rt.ep.size / total if total > 0 else 1.0)
            after = rt.state.rank_loads(counts, rt.shadowed)
            bal_next.append(float(after.max()) * rt.ep.size / total if total > 0 else 1.0)
            kept += float(counts.sum())
            routed += float(counts.sum()) + dropped
            exp_num += total
            exp_den += rt.ep.size * float(loads.max())
            replicas += rt.state.total_replicas - rt.num_experts + len(rt.shadowed) * (rt.ep.size - 1)
            shadowed += len(rt.shadowed)
            moves += len(mv)
            predicted += pred
        rt0 = rows[0][0]
        group_bytes = torch.tensor([float(sent)], dtype=torch.float64, device=comm_device(rt0.ep.group))
        if rt0.ep.size > 1:
            dist.all_reduce(group_bytes, group=rt0.ep.group)
        self.total_moves += moves
        self.total_bytes += int(group_bytes)
        self.metrics = {
            "balance_ratio": sum(bal) / len(bal), "balance_ratio_next": sum(bal_next) / len(bal_next),
            "token_efficiency": kept / routed if routed > 0 else 1.0,
            "expert_efficiency": exp_num / exp_den if exp_den > 0 else 1.0,
            "replicas": float(replicas), "shadowed": float(shadowed), "moves": float(moves),
            "bytes_moved": float(group_bytes), "predicted_step_s": predicted,
            "calibrations": float(self.calibrations),
            "changes_kept": float(self.guard.kept), "changes_undone": float(self.guard.undone),
            "verdicts_inconclusive": float(self.guard.inconclusive),
            "returned_to_start": float(self.guard.returned), "guard_stopped": float(self.guard.stopped),
            "verdict_drift_s": self.guard.last_drift_s,
            "verdict_measured_s": self.guard.last_measured_s, "verdict_reference_s": self.guard.last_reference_s,
        }
        if measured is not None:
            self.metrics["measured_step_s"] = measured


class _ReplicaPolicy(_Policy):
    """A policy that replicates experts into spare vExpert slots (refused without any)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        if cfg.slots_per_rank <= cfg.num_local_experts:
            raise ConfigError(f"{flag('placement')}={self.name} needs spare vExpert slots: "
                              f"{flag('placement_spare_slots')}={cfg.placement_spare_slots} leaves none")


@register_placement_policy("flexmoe")
class FlexMoEPolicy(_ReplicaPolicy):
    """FlexMoE (paper 001): Expand / Shrink / Migrate vExperts from the cost model (module docstring)."""
    name = "flexmoe"

    def decide(self, key, cm, rt, counts):
        if key not in self._planners:
            self._planners[key] = FlexMoEPlanner(cm, threshold=self.cfg.placement_threshold,
                                                 max_moves=FLEXMOE_MAX_MOVES, min_gain=MIN_PREDICTED_GAIN)
        self._planners[key].min_gain, self._planners[key].horizon = self._min_gain, self._horizon
        return self._planners[key].plan(rt.state, counts), None


@register_placement_policy("shadow")
class ShadowPolicy(_Policy):
    """FasterMoE (paper 003 §4.1): shadow the experts Alg. 1 picks from the last steps' counts."""
    name = "shadow"

    def decide(self, key, cm, rt, counts):
        if key not in self._planners:
            self._planners[key] = ShadowPlanner(cm, min_gain=MIN_PREDICTED_GAIN)
        self._planners[key].min_gain = self._min_gain
        return [], ShadowPlanner.plan(self._planners[key], rt.state, counts)


@register_placement_policy("eplb")
class EPLBPolicy(_ReplicaPolicy):
    """DeepSeek's EPLB (placement/eplb.py): redundant experts by load per replica, packed onto nodes then ranks from
    a moving average of the counts; a new table is kept only when the cost model predicts a gain net of its moves."""
    name = "eplb"

    def decide(self, key, cm, rt, counts):
        if key not in self._planners:
            self._planners[key] = EPLBPlanner(cm, min_gain=MIN_PREDICTED_GAIN)
        self._planners[key].min_gain, self._planners[key].horizon = self._min_gain, self._horizon
        return self._planners[key].plan(rt.state, counts), None
