"""The differences between the megatron-core releases the adapter supports (0.16.1 through 0.19.x), in one place.

Every difference is found by a feature test on the installed megatron-core, never by its version string:

- how an ``mlp`` spec is written and built: 0.16's ``ModuleSpec(module=MoELayer, submodules=MoESubmodules(...))``
  built by ``build_module``, or 0.19's ``functools.partial(MoELayer, submodules=...)`` called directly by
  ``TransformerLayer`` (``mlp(config=, pg_collection=, is_mtp_layer=, name=)``);
- which keyword arguments a Megatron constructor takes (``is_mtp_layer`` since 0.17, ``name`` since 0.18);
- whether ``megatron.legacy`` (fused kernels, removed in 0.19) exists.

The rest of the adapter asks these helpers instead of testing versions itself.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Any, Optional


def spec_parts(spec) -> tuple:
    """``(class, submodules, params, style)`` of a layer or mlp spec: a ``ModuleSpec`` ("spec"), a
    ``functools.partial`` of a class ("partial") or a bare class ("class")."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if isinstance(spec, ModuleSpec):
        return spec.module, spec.submodules, dict(spec.params or {}), "spec"
    if isinstance(spec, functools.partial):
        kw = dict(spec.keywords)
        return spec.func, kw.pop("submodules", None), kw, "partial"
    return spec, None, {}, "class"


def spec_submodules(spec):
    """The ``submodules`` of a ``ModuleSpec`` or of a ``partial(cls, submodules=...)`` (None for a bare class)."""
    return spec_parts(spec)[1]


def make_spec(cls, submodules, params: dict, style: str):
    """A spec for ``cls`` written in ``style`` (as ``spec_parts`` reports it), so a substitute is built by Megatron
    the same way as what it replaces."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if style == "partial":
        return functools.partial(cls, submodules=submodules, **params)
    return ModuleSpec(module=cls, submodules=submodules, params=params)


def accepted_kwargs(fn, kwargs: dict) -> dict:
    """The items of ``kwargs`` that ``fn`` (a class or callable) accepts by name; all of them when it takes
    ``**kwargs``."""
    target = fn.__init__ if isinstance(fn, type) else fn
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def build_mlp(spec, config, layer_number: Optional[int] = None, pg_collection=None, **extra) -> Any:
    """Build an ``mlp`` spec (an MoE layer's, typically) the way this megatron-core's ``TransformerLayer`` would,
    outside a transformer layer: ``build_module`` for a ``ModuleSpec``, a direct call for a partial or class. Keyword
    arguments the target does not take (``is_mtp_layer``, ``name`` on older releases) are left out."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    kwargs = {"config": config, "layer_number": layer_number, "pg_collection": pg_collection, **extra}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if isinstance(spec, ModuleSpec):
        return build_module(spec, **accepted_kwargs(spec.module, kwargs))
    cls = spec.func if isinstance(spec, functools.partial) else spec
    return spec(**accepted_kwargs(cls, kwargs))


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported (its parent packages exist and it is found), without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# what a Megatron optimizer calls to collect the gradients its norm (and so clipping) is computed from:
# ``get_main_grads_for_grad_norm()`` up to 0.16, ``get_grads_for_grad_norm(grad_norm_group=None)`` from 0.19 on
GRAD_NORM_METHODS = ("get_grads_for_grad_norm", "get_main_grads_for_grad_norm")


def grad_norm_method(optimizer) -> Optional[str]:
    """The name of ``optimizer``'s grad-norm gradient collector (``GRAD_NORM_METHODS``), or None."""
    return next((m for m in GRAD_NORM_METHODS if hasattr(optimizer, m)), None)


def wrap_grads_for_norm(optimizer, transform) -> bool:
    """Make ``optimizer``'s grad-norm collector return ``transform(grads)`` instead of ``grads`` (whatever arguments
    Megatron passes it). False when the optimizer has none."""
    name = grad_norm_method(optimizer)
    if name is None:
        return False
    original = getattr(optimizer, name)

    @functools.wraps(original)
    def collect(*args, **kwargs):
        return transform(original(*args, **kwargs))

    setattr(optimizer, name, collect)
    return True
