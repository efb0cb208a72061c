"""What a call launches under Triton's interpreter, for the tests that pin a decode path's launches: every
Triton kernel (by name) and every torch op that would be a kernel on the GPU (views and allocations aside,
and not the ops a Triton launch makes inside the interpreter). Imported by scripts that tests run in a
fresh interpreter (tests/interpreted.py): ``log.clear()``, then ``with Ops(): ...``, then read ``log``."""

from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

log: list[str] = []
_paused = [False]
_run = InterpretedFunction.run


def _counted(self, *args, **kwargs):
    log.append("triton:" + self.fn.__name__)
    _paused[0] = True
    try:
        return _run(self, *args, **kwargs)
    finally:
        _paused[0] = False


class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not _paused[0] and not func.is_view and not name.startswith(("empty", "lift_fresh")):
            log.append(name)
        return func(*args, **(kwargs or {}))


InterpretedFunction.run = _counted
