"""commfuse: a torch.compile backend for distributed PyTorch with first-class collectives."""
import os as _os

from . import config


def _select_triton_mode() -> None:
    """Choose Triton's interpreter on machines without CUDA. It is read when triton's own @jit
    functions are decorated, so if triton is already imported, re-wrap those too."""
    if "TRITON_INTERPRET" in _os.environ or config.triton_interpret is False:
        return
    if not config.triton_interpret:
        import torch
        if torch.cuda.is_available():
            return
    _os.environ["TRITON_INTERPRET"] = "1"
    import sys
    if "triton" in sys.modules:
        from .runtime.loader import _interpret_triton_library
        _interpret_triton_library()


_select_triton_mode()

__all__ = ["config", "commfuse_backend"]


def commfuse_backend(gm, example_inputs, **kwargs):
    from .backend import commfuse_backend as _backend
    return _backend(gm, example_inputs, **kwargs)


def _register() -> None:
    """The entry point registers `backend="commfuse"` once installed; importing commfuse does too
    (e.g. when it is used from a source tree on PYTHONPATH)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    if "commfuse" not in _BACKENDS:
        register_backend(name="commfuse")(commfuse_backend)


_register()


def comm_report() -> dict:
    """Symmetric pool bytes per process group and device in this process (also logged)."""
    from .runtime.symm import comm_report as _report
    return _report()
