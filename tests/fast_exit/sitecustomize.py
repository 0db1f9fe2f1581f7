"""Test subprocesses only: skip the interpreter's final garbage collections at exit.

The suite starts many Python processes (the ranks of pretrain_gpt.py and fairseq-train, torchrun, the CLI), each
holding torch, megatron-core or fairseq: hundreds of thousands of objects, which the interpreter's collections walk
again and again while it tears its modules down, after the work is done. ``gc.freeze()`` in the last exit handler moves every object
to the permanent generation, which those collections skip; objects are still released by reference counting, files
still flush and close, and every other exit handler has already run. tests/conftest.py puts this directory first on
the ``PYTHONPATH`` the subprocesses inherit; a ``sitecustomize`` it shadows (a distribution's own) still runs.
"""
import atexit
import gc
import os
import sys

atexit.register(gc.freeze)          # registered first, so it runs last

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _path = os.path.join(os.path.abspath(_entry or os.curdir), "sitecustomize.py")
    if os.path.dirname(_path) != _here and os.path.isfile(_path):
        with open(_path) as _f:
            exec(compile(_f.read(), _path, "exec"), {"__name__": "sitecustomize", "__file__": _path})
        break
