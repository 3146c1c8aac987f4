"""commfuse: a torch.compile backend for distributed PyTorch with first-class collectives."""
import os as _os

from . import config


def _select_triton_mode() -> None:
    """Triton's interpreter must be chosen before triton is imported: do it now."""
    if "TRITON_INTERPRET" in _os.environ or config.triton_interpret is False:
        return
    if config.triton_interpret:
        _os.environ["TRITON_INTERPRET"] = "1"
        return
    import torch
    if not torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"


_select_triton_mode()

__all__ = ["config", "commfuse_backend"]


def commfuse_backend(gm, example_inputs, **kwargs):
    from .backend import commfuse_backend as _backend
    return _backend(gm, example_inputs, **kwargs)
