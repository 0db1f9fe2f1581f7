"""The built-in placement policies ``--moe-placement flexmoe`` and ``--moe-placement shadow``: what runs in the
after-step hook (hooks.py) on every rank between two optimizer steps.

Each run, for every MoE layer of this rank (in model order):

1. the last steps' routing: the [E] counts this rank's training forwards sent (``PlacementRuntime.step_counts``),
   all-gathered over the expert-parallel group into [P, E] and summed over the expert-data-parallel group, so
   every expert-parallel group of the job plans from the same numbers and keeps the same placement (its slots are
   reduced together); in the same collective, the counts of the planners' window, the last
   ``--moe-placement-plan-steps`` steps (``PlacementRuntime.recent``; 3 for flexmoe: the last steps' hot experts
   predict the next interval's better than the whole interval's while the routing drifts), from which the planners
   decide and their predicted saving is priced;
2. the decision, deterministic, on every rank:
   * ``flexmoe``: ``FlexMoEPlanner`` (paper 001 Alg. 1-2: balance-ratio trigger ``--moe-placement-threshold``,
     Expand the hottest per-vExpert load, Shrink the coldest, keep a change only when the cost model predicts a
     gain net of its transfer, then Migrate for cheaper synchronisation; at most ``--moe-placement-max-moves``);
   * ``shadow``: ``ShadowPlanner`` (paper 003 Alg. 1 with Eqs. 7-8): the experts to shadow in the next steps;
   * ``eplb``: ``EPLBPlanner`` (DeepSeek's EPLB, eplb.py): a whole new slot table from the moving-average load,
     reached by Expand / Shrink / Migrate, kept only when the cost model predicts a gain net of the moves;
   the ranks of an expert-parallel group check that they agree (one tiny all-reduce);
3. execution: ``apply_placement`` moves parameters + optimizer state point to point and prepares the replica
   groups (collective over the default group: every rank calls it, with or without moves); the shadowed experts'
   copies for the next forwards are broadcast asynchronously right away (``--moe-placement-prefetch``), so they
   overlap the next batch and the layers below instead of waiting in the layer's forward;
4. the pay-off guard (guard.py, ``--moe-placement-guard``): once the steps after a change are measured (a window
   of at least 3 steps; no new change meanwhile), a change whose median step is slower than the median before it is
   undone, and the policy pauses; a placement whose steps run slower than the original placement's goes back
   there, and after two such returns the policy stops for the run;
5. an idle policy backs off (``_back_off``): at the original placement, each run that changed nothing skips the
   next 1, 2, 4, ... runs (at most ``IDLE_GAP_STEPS`` steps apart), so a policy with nothing to do costs the steps
   almost nothing.

The measurements behind these choices are in docs/history/ (the guard's and policies' design notes).

The cost model is the hardware profile ``--moe-placement-profile`` at the expert-parallel size, with the layer's real
shape: ``auto`` (the default) calibrates the running job's own process groups at the first run (a second or two,
cached per cluster; ``perfmodel.autoprofile``) and again when the measured step times drift away from the
predictions; a named profile or the JSON that ``megamoe perf calibrate`` writes overrides it.

``metrics`` after a run (floats; layer means for ratios, sums for counts): ``balance_ratio`` (Eq. 6 of the last
steps' routing under the placement they ran with), ``balance_ratio_next`` (the same counts under the new
placement), ``token_efficiency`` (kept / routed assignments), ``expert_efficiency`` (useful expert rows / (P x
the busiest rank's rows)), ``replicas`` (vExperts beyond one per expert, shadow copies included), ``shadowed``,
``moves``, ``bytes_moved`` (model-state bytes sent by the group's ranks), ``changes_kept`` / ``changes_undone``
(the guard's verdicts so far; ``verdicts_inconclusive``: verdicts that found a loss within the steps' noise and
waited for more steps; ``returned_to_start``: undos that went back to the original placement;
``guard_stopped``: 1 once the guard stopped the policy for the run; ``verdict_drift_s``: how far the last verdict
moved the steps before the change for the routing's drift, ``PayoffGuard.check``), ``predicted_step_s`` (the cost model's MoE-layer time of one step with the last
steps' mean counts under the placement they ran with, summed over layers), ``predicted_static_step_s`` (the same
counts under static contiguous experts: the two give the model's predicted saving per step), ``shadow_wait_s``
(seconds per step the forwards waited for the shadowed experts' prefetched copies, ``--moe-placement-prefetch``, plus
the backward passes' ends for their overlapped gradient reduces, ``--moe-placement-overlap-sync``: the part of
shadowing's communication not hidden behind other work) and ``shadow_exposure`` (with both on, that wait over the
model's Eq. 8 broadcast + reduce time, the share the model now charges), ``sync_wait_s`` (seconds per step the
backward passes' ends waited for the overlapped replica all-reduces, ``--moe-placement-overlap-sync``) and ``sync_exposure`` (that wait
over the model's Eq. 9 time of the replicas that ran: the share of replica sync the model now charges, so
1 - ``sync_exposure`` is the measured hidden fraction), ``move_wait_s`` (the seconds the slowest rank spent
blocking on the previous run's moves; ``move_wait_total_s`` summed over the run),
``measured_step_s`` (wall time per optimizer step since the previous run, the whole training step),
``step_noise`` (the relative spread of a step under the original placement from one step to the next, the
slowest rank's) and
``realisation`` (the share of its predicted savings the model delivered in the guard's verdicts so far,
``PayoffGuard.realisation``) and ``required_gain`` (the fraction of the MoE layers' predicted time a change had to
save at this run: 5%, or what the pay-off guard can tell from that noise, ``PayoffGuard.resolvable_gain``, divided
by the realisation).
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

# change the placement (shadow an expert, keep a FlexMoE plan or an EPLB table) only when the model predicts it
# saves at least this fraction of the layer step, transfers included: the calibrated model's error on a step is
# about 10% (docs/cluster.md), so smaller predicted gains are within its error
MIN_PREDICTED_GAIN = 0.05
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
        from ..perfmodel.autoprofile import DriftWatch  # load order: perfmodel.cost imports placement.state, whose package imports this module
        from ..perfmodel.profiles import get_profile  # load order: perfmodel.cost imports placement.state, whose package imports this module
        if cfg.placement_profile != "auto":
            try:
                self.profile = get_profile(cfg.placement_profile)
            except ValueError as e:
                raise ConfigError(f"{flag('placement_profile')}={cfg.placement_profile!r}: {e}") from None
        self.drift = DriftWatch() if cfg.placement_profile == "auto" else None
        self.calibrations = 0
        self.metrics_extra: Dict[str, float] = {}      # step_noise, required_gain of the last run
        self._min_gain = MIN_PREDICTED_GAIN             # what the planners must predict at this run
        self.sync_exposure = 1.0                        # share of replica sync the steps wait for (measured)
        self.shadow_exposure = 1.0                      # share of the shadows' broadcast + reduce waited for
        # their evidence: [seconds waited, the model's seconds], summed over runs
        self._exposure_evidence = {"sync_exposure": [0.0, 0.0], "shadow_exposure": [0.0, 0.0]}
        self._cost_models: Dict[tuple, object] = {}
        self._planners: Dict[tuple, object] = {}
        self.metrics: Dict[str, float] = {}
        self.runs = 0
        self.total_moves = 0
        self.total_bytes = 0
        self.total_move_wait = 0.0                    # seconds the slowest rank spent on moves, so far
        self._clock: Optional[float] = None
        self._last_iteration: Optional[int] = None
        self._checked_optimizer = False
        self.guard = PayoffGuard(cfg.placement_guard)
        self._held_steps = 0                          # steps of runs skipped while held (their counts add up)
        self._idle_runs = 0                           # consecutive runs at the original placement with no change
        self._idle_skip = 0                           # runs still to skip after them (``_back_off``)

    def _cm(self, bank, num_experts: int, num_ranks: int):
        key = (bank.hidden_size, bank.ffn_hidden_size, num_experts, num_ranks, bank.w1.element_size())
        if key not in self._cost_models:
            from ..perfmodel.cost import LayerShape  # load order: perfmodel.cost imports placement.state, whose package imports this module
            shape = LayerShape(bank.hidden_size, bank.ffn_hidden_size, num_experts,
                               bytes_per_element=bank.w1.element_size())
            self._cost_models[key] = self.profile.cost_model(shape, world_size=num_ranks)
            self._cost_models[key].sync_exposure = self.sync_exposure
            self._cost_models[key].shadow_exposure = self.shadow_exposure
        return key, self._cost_models[key]

    def _learn_sync_exposure(self, layers, sync_wait: Optional[float]) -> None:
        """``--moe-placement-overlap-sync``: the share of the replicas' gradient all-reduces the steps waited for,
        measured: the seconds per step the backward passes' ends waited for them (the slowest rank's), over the
        cost model's Eq. 9 time of the replicated experts the steps ran with, summed over every run that had
        replicas. Every cost model prices replica sync at that share from then on (``CostModel.sync_exposure``);
        1 (all of it) until measured, and always without overlap. Job-wide inputs: the same on every rank."""
        if not self.cfg.placement_overlap_sync or sync_wait is None:
            return
        predicted = 0.0
        for layer in layers:
            rt = layer.plan.placement
            m = rt.state.multiplicity().to(torch.float64)
            m[list(rt.shadowed)] = 0.0
            _, cm = self._cm(layer.experts_bank, rt.num_experts, rt.ep.size)
            predicted += cm.replica_sync_time(m)
        self._record_exposure("sync_exposure", sync_wait, predicted)

    def _learn_shadow_exposure(self, layers, shadow_wait: Optional[float]) -> None:
        """With the shadows' broadcasts prefetched (``--moe-placement-prefetch``) and their gradient reduces
        overlapped (``--moe-placement-overlap-sync``), every wait on them is timed: the share of Eq. 8's
        communication the steps waited for is the seconds per step waited (the slowest rank's) over the cost
        model's broadcast + reduce time of the experts the steps shadowed, summed over every run that shadowed.
        Every cost model prices shadowing's communication at that share from then on (``CostModel.
        shadow_exposure``); 1 until measured, and always where a part of it runs synchronously."""
        if not (self.cfg.placement_overlap_sync and self.cfg.placement_prefetch) or shadow_wait is None:
            return
        predicted = 0.0
        for layer in layers:
            rt = layer.plan.placement
            if rt.shadowed:
                _, cm = self._cm(layer.experts_bank, rt.num_experts, rt.ep.size)
                predicted += cm.shadow_sync_time(rt.shadowed, rt.state.multiplicity().to(torch.float64))
        self._record_exposure("shadow_exposure", shadow_wait, predicted)

    def _record_exposure(self, name: str, waited: float, predicted: float) -> None:
        """Add one run's evidence to exposure ``name`` (cumulative waited over cumulative modelled, at most 1) and
        set it on every cost model; a run with nothing modelled is no evidence."""
        if predicted <= 0:
            return
        evidence = self._exposure_evidence[name]
        evidence[0] += waited
        evidence[1] += predicted
        value = min(1.0, evidence[0] / evidence[1])
        setattr(self, name, value)
        for cm in self._cost_models.values():
            setattr(cm, name, value)

    def decide(self, key, cm, rt, counts):
        raise NotImplementedError

    def _required_gain(self, layers, all_counts, every: int, step_s: Optional[float],
                       noise: Optional[float]) -> float:
        """The fraction of a layer's predicted time a change must save: MIN_PREDICTED_GAIN, or more where the
        guard could not tell the saving from the steps' noise (guard.resolvable_gain, a fraction of the whole step,
        turned into one of the MoE layers' predicted time through ``step_s``: the job's median step of the last
        window, which an evaluation or the policy's own run does not move), divided by the share of its predicted
        savings the model has delivered on this run (``guard.realisation``). ``noise``: the job's
        ``guard.step_noise``, so every rank plans with the same threshold."""
        step_gain = self.guard.resolvable_gain(every, noise)
        moe_s = 0.0
        for layer, counts in zip(layers, all_counts):
            rt, bank = layer.plan.placement, layer.experts_bank
            _, cm = self._cm(bank, rt.num_experts, rt.ep.size)
            moe_s += cm.layer_time(counts, rt.state.placement()).total
        need = step_gain * step_s / moe_s if (step_s and moe_s > 0) else 0.0
        realisation = self.guard.realisation()
        self.metrics_extra = {"step_noise": noise or 0.0, "realisation": realisation,
                              "required_gain": min(max(MIN_PREDICTED_GAIN, need) / realisation, 0.95)}
        return self.metrics_extra["required_gain"]

    def _back_off(self, acted: bool, layers, every: int) -> None:
        """A run that changed nothing at the original placement (nothing replicated or shadowed, no change pending)
        makes the policy skip the next 1, 2, 4, ... runs, up to IDLE_GAP_STEPS steps between runs; any change
        resets it. A skipped run costs the step nothing (no collective, no planning: counts add up for the next),
        while a run costs a few all-reduces and the planner's search, which a rank capped at a fixed speed pays
        in full (measured at 512 tokens per rank: an idle shadowing policy planning every step ran 8% slower
        than static). The same on every rank: every input is job-wide."""
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

    def _predicted_saving(self, layers, plan_counts, before_s: float) -> float:
        """The cost model's saving per step of the change this run made: the layers' predicted time with the
        counts the planners planned from under the placement they ran with (``before_s``), less the same under
        the new one (slot table and shadow set)."""
        return before_s - self._placement_time(layers, plan_counts, [(m.plan.placement.state,
                                                                      m.plan.placement.shadowed) for m in layers])

    def observe_step(self, seconds: float) -> None:
        """One training step's duration, from the after-step hook (the pay-off guard's measurements)."""
        self.guard.observe(seconds)

    def _ensure_profile(self, layers) -> None:
        """--moe-placement-profile auto: calibrate this job at the expert shape of its first MoE layer (collective:
        every rank runs the policies at the same step), or again after a drift."""
        if self.profile is not None:
            return
        bank = next((m.experts_bank for m in layers if getattr(m.plan, "placement", None) is not None), None)
        if bank is None:
            return
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        from ..perfmodel.autoprofile import auto_profile  # load order: perfmodel.cost imports placement.state, whose package imports this module
        self.profile = auto_profile(bank.hidden_size, bank.ffn_hidden_size, bank.w1.dtype,
                                    refresh=self.calibrations > 0,
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
        hold = verdict == WAIT or (undo is None and self.guard.paused())
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
        # the slowest rank's: every decision taken from it (re-calibrating on drift) must be the same on every rank
        guarded = self.guard.enabled
        sync_wait = sum(m.plan.placement.take_sync_wait() for m in layers) / steps
        shadow_wait = sum(m.plan.placement.take_shadow_wait() for m in layers) / steps
        move_wait = sum(m.plan.placement.take_move_wait() for m in layers)
        measured, baseline, noise, sync_wait, shadow_wait, move_wait = job_max_many([
            measured, self.guard.baseline(every) if guarded else None,
            self.guard.step_noise() if guarded else None, sync_wait, shadow_wait, move_wait])
        self.guard.job_noise = noise
        changes, rows, decisions = [], [], []
        before = [(m.plan.placement.state.copy(), tuple(m.plan.placement.shadowed)) for m in layers]
        # the counts of the steps since the last run, as one step's: the cost model prices one step, against
        # which a move's one-off transfer is amortised over the interval
        self._held_steps = 0
        if not gathered:
            gather()                                                                            # one collective
        all_counts, plan_counts = gathered[0]
        self._learn_sync_exposure(layers, sync_wait)
        self._learn_shadow_exposure(layers, shadow_wait)
        self.total_move_wait += move_wait or 0.0
        self._min_gain = self._required_gain(layers, all_counts, every, baseline, noise)
        static_pred = plan_before = 0.0
        for i, (layer, counts, plan) in enumerate(zip(layers, all_counts, plan_counts)):
            rt = layer.plan.placement
            bank = layer.experts_bank
            dropped = rt.take_dropped() / steps
            key, cm = self._cm(bank, rt.num_experts, rt.ep.size)
            before_loads = rt.state.rank_loads(counts, rt.shadowed)
            predicted = self._placement_time([layer], [counts], [(rt.state, rt.shadowed)])
            plan_before += predicted if plan is counts else \
                self._placement_time([layer], [plan], [(rt.state, rt.shadowed)])
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
        for m in layers:
            m.plan.placement.drop_prefetch()          # the last prefetch's broadcasts, complete on every rank
        for rt, _, _, _, _, _, shadow in rows:
            if shadow is not None:
                rt.set_shadowed(shadow)
        if any(m.plan.placement.shadowed for m in layers) and (self.cfg.placement_prefetch
                                                                 or self.cfg.placement_overlap_sync):
            group_cache().ensure([g for m in layers for g in m.plan.placement.needed_groups()])
            if self.cfg.placement_prefetch:
                for m in layers:
                    m.plan.placement.prefetch_shadows(m.experts_bank)
        changed = any(moves or (shadow is not None and set(shadow) != set(old[1]))
                      for (_, _, _, _, _, moves, shadow), old in zip(rows, before))
        self._back_off(changed or undo is not None, layers, every)
        if changed and undo is None:
            self.guard.record(baseline, time.perf_counter() - now, every, [m.plan.placement for m in layers],
                              [b[0] for b in before], [b[1] for b in before],
                              predicted_s=self._predicted_saving(layers, plan_counts, plan_before),
                              before_model_s=sum(row[4] for row in rows))
        self._report(rows, sent, measured)
        if rows:
            self.metrics["predicted_static_step_s"] = static_pred
            self.metrics.update(self.metrics_extra)
            self.metrics["shadow_wait_s"] = shadow_wait
            self.metrics["shadow_exposure"] = self.shadow_exposure
            self.metrics["sync_wait_s"] = sync_wait
            self.metrics["sync_exposure"] = self.sync_exposure
            self.metrics["move_wait_s"] = move_wait
            self.metrics["move_wait_total_s"] = self.total_move_wait
        if self.drift is not None and self.drift.observe(measured, self.metrics.get("predicted_step_s", 0.0)):
            self.profile = None               # the model no longer matches this cluster: measure it again
            self.drift.reset()
        self._clock, self._last_iteration = time.perf_counter(), ctx.iteration
        self.runs += 1

    def _report(self, rows, sent: int, measured: Optional[float]) -> None:
        if not rows:
            self.metrics = {}
            return
        bal, bal_next, exp_num, exp_den = [], [], 0.0, 0.0
        replicas = shadowed = moves = 0
        predicted = 0.0
        routed = kept = 0.0
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
                                                 max_moves=self.cfg.placement_max_moves,
                                                 horizon=float(self.cfg.placement_every),
                                                 min_gain=MIN_PREDICTED_GAIN)
        self._planners[key].min_gain = self._min_gain
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
            self._planners[key] = EPLBPlanner(cm, horizon=float(self.cfg.placement_every),
                                              min_gain=MIN_PREDICTED_GAIN, equal_within=MIN_PREDICTED_GAIN)
        self._planners[key].min_gain = self._min_gain
        return self._planners[key].plan(rt.state, counts), None
