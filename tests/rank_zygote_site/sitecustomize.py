"""Test runs only (tests/rank_zygote.py): a rank, a launcher or dplaunch's command line asks the
suite's fork servers to run it.

Any other sitecustomize further on the path (the suite profiler's tracer, the distribution's own)
runs as well, in every process that does not hand itself over."""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

# the variables are rank_zygote.SOCKET_VARIABLE and PARENT_VARIABLE, written out: every Python
# process of a test run passes here, and only what the servers serve (rank_zygote.MODULES,
# SCRIPTS) or the child of a served process loads rank_zygote.py
_parent = _os.environ.get("SUITE_RANK_ZYGOTE_PARENT")
if (_parent and _parent.partition(":")[0] == str(_os.getppid())) or (
    _os.environ.get("SUITE_RANK_ZYGOTE")
    and any(
        _argument.startswith(("dplaunch.train", "accelerate.", "torch.distributed.run"))
        or _argument.endswith("pipeline_driver.py")
        or _argument == "dplaunch"
        for _argument in _sys.orig_argv
    )
):
    _spec = _util.spec_from_file_location(
        "tests.rank_zygote", _os.path.join(_os.path.dirname(__file__), "..", "rank_zygote.py")
    )
    _zygote = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_zygote)
    if _parent:  # a served process's child: a stand-in takes its place under the waiting process
        _zygote.ask_for_stand_in(_parent)
    if _os.environ.get("SUITE_RANK_ZYGOTE"):
        _zygote.hand_over(_os.environ["SUITE_RANK_ZYGOTE"])  # returns only if refused

_here = _os.path.dirname(_os.path.abspath(__file__))
_spec = _machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
)
if _spec is not None:
    _module = _util.module_from_spec(_spec)
    _sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
