"""Megatron-core integration of megamoe_plugin.

Submodules (imported on demand, so importing this package stays cheap and does not
pull in megatron-core):

- ``cpu_compat``: ``install_cpu_shims()`` patches, at runtime, the CUDA assumptions of
  megatron-core 0.16.1 so that its MoE code (and later ``pretrain_gpt.py`` with gloo)
  runs on a CPU-only torch build.
- ``peer``: ``build_megatron_moe_layer(...)`` returns megatron-core's own ``MoELayer``
  (single-process gloo group, TP=PP=EP=1) plus helpers to load expert/router weights,
  used as the reference ("peer") implementation to compare and time against.
"""
