"""Criteria that add the MoE aux losses to fairseq's task loss and log per-layer expert statistics.

``moe_cross_entropy`` and ``moe_label_smoothed_cross_entropy`` wrap fairseq's ``cross_entropy`` and
``label_smoothed_cross_entropy``. As on fairseq's moe branch, the layers' aux losses (balance/topology loss and
z-loss, already weighted by --moe-gate-loss-wt / --moe-z-loss-coeff) are combined over the MoE layers
(``--moe-gate-loss-combine-method average|sum``) and scaled by the sample size, because fairseq's task loss is a
sum over tokens. The logged ``loss``/``nll_loss``/``ppl`` stay the task's own (comparable with dense models);
``moe_aux`` is the aux loss per sample. Per MoE layer (``enc<i>``/``dec<i>``, 1-based layer numbers) the logs get
``moe_bal_<layer>`` (FlexMoE balance ratio over expert-parallel devices, paper 001 Eq. 6), ``moe_drop_<layer>``
(fraction of token->expert assignments dropped) and ``moe_load_<layer>`` (busiest expert's load over the mean).
The raw counts travel in the logging output (summed over ranks by fairseq) as ``_moe_<layer>_e<j>``.
"""
# no "from __future__ import annotations": fairseq reads the dataclass field types at run time

import re
from dataclasses import dataclass, field
from typing import Dict, List

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (LabelSmoothedCrossEntropyCriterion,
                                                             LabelSmoothedCrossEntropyCriterionConfig)

from ..stats import layer_summary
from .layers import moe_ffns

COMBINE = ("average", "sum")
_KEY = re.compile(r"^_moe_(.+)_e(\d+)$")


def moe_aux_and_logs(model, combine: str) -> tuple:
    """(combined aux loss tensor, logging entries) of the MoE layers' last forward."""
    layers = [m for m in moe_ffns(model) if m.routing is not None]
    if not layers:
        return None, {}
    aux = sum(m.aux_loss for m in layers)
    if combine == "average":
        aux = aux / len(layers)
    logs: Dict[str, torch.Tensor] = {}
    for m in layers:
        r = m.routing
        for e, c in enumerate(r.counts.detach().unbind(0)):
            logs[f"_moe_{m.label}_e{e}"] = c
        logs[f"_moe_{m.label}_drop"] = r.dropped.detach()
        logs[f"_moe_{m.label}_asg"] = r.expert_ids.numel()
        logs[f"_moe_{m.label}_ep"] = m.ep.size           # divided by the number of summed outputs below
        logs[f"_moe_{m.label}_n"] = 1
        m.moe.last_routing = None   # read once: a layer LayerDrop skips next time must not report this step again
    return aux, logs


def add_moe_loss(model, loss, sample_size, logging_output, combine: str, reduce: bool):
    aux, logs = moe_aux_and_logs(model, combine)
    if aux is None:
        return loss
    if reduce:
        loss = loss + aux * sample_size
    logging_output["moe_aux_loss"] = aux.detach() * sample_size
    logging_output.update(logs)
    return loss


def reduce_moe_metrics(logging_outputs: List[dict]) -> None:
    def total(key):
        return sum(float(log.get(key, 0)) for log in logging_outputs)

    sample_size = total("sample_size")
    if any("moe_aux_loss" in log for log in logging_outputs):
        metrics.log_scalar("moe_aux", total("moe_aux_loss") / max(sample_size, 1.0), sample_size, round=4)
    experts: Dict[str, Dict[int, float]] = {}
    for key in sorted({k for log in logging_outputs for k in log}):
        m = _KEY.match(key)
        if m:
            experts.setdefault(m.group(1), {})[int(m.group(2))] = total(key)
    for label, by_id in sorted(experts.items()):
        counts = torch.tensor([by_id[e] for e in sorted(by_id)], dtype=torch.float64)
        n = max(total(f"_moe_{label}_n"), 1.0)
        ep = max(int(round(total(f"_moe_{label}_ep") / n)), 1)
        s = layer_summary(counts, total(f"_moe_{label}_drop"), total(f"_moe_{label}_asg"), None, ep, int(n))
        metrics.log_scalar(f"moe_bal_{label}", s["balance_ratio"], 1, round=3)
        metrics.log_scalar(f"moe_drop_{label}", s["dropped_fraction"], 1, round=3)
        metrics.log_scalar(f"moe_load_{label}", s["expert_max_over_mean"], 1, round=3)


@dataclass
class MoECrossEntropyCriterionConfig(CrossEntropyCriterionConfig):
    moe_gate_loss_combine_method: str = field(
        default="average", metadata={"help": "Combine the MoE layers' aux losses: average | sum."})


@dataclass
class MoELabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    moe_gate_loss_combine_method: str = field(
        default="average", metadata={"help": "Combine the MoE layers' aux losses: average | sum."})


def _check_combine(value: str) -> str:
    if value not in COMBINE:
        raise ValueError(f"megamoe-plugin: --moe-gate-loss-combine-method={value!r}: must be average or sum")
    return value


class MoELossMixin:
    """Adds the MoE aux loss to a fairseq criterion's loss and the MoE metrics to its logs (``self.combine``)."""

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        loss = add_moe_loss(model, loss, sample_size, logging_output, self.combine, reduce)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moe_metrics(logging_outputs)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


@register_criterion("moe_cross_entropy", dataclass=MoECrossEntropyCriterionConfig)
class MoECrossEntropyCriterion(MoELossMixin, CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, moe_gate_loss_combine_method="average"):
        super().__init__(task, sentence_avg)
        self.combine = _check_combine(moe_gate_loss_combine_method)


@register_criterion("moe_label_smoothed_cross_entropy", dataclass=MoELabelSmoothedCrossEntropyCriterionConfig)
class MoELabelSmoothedCrossEntropyCriterion(MoELossMixin, LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moe_gate_loss_combine_method="average"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.combine = _check_combine(moe_gate_loss_combine_method)
