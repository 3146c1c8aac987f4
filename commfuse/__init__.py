"""commfuse: a torch.compile backend for distributed PyTorch with first-class collectives."""
import os as _os
import sys as _sys


def _checkout_subpackages() -> None:
    """An installed commfuse holds `lowering` and `codegen` inside it (pyproject's package-dir). A
    source checkout on PYTHONPATH keeps them beside it: map `commfuse.lowering` and
    `commfuse.codegen` to those folders, and to nothing else: ahead of other finders, since an
    editable install's would map them to the installed tree's folders."""
    import importlib.abc
    import importlib.util
    here = _os.path.dirname(__file__)
    top = _os.path.dirname(here)
    folders = {f"{__name__}.{name}": _os.path.join(top, name) for name in ("lowering", "codegen")}
    if any(_os.path.isdir(_os.path.join(here, name.rsplit(".", 1)[1])) for name in folders) or \
            not all(_os.path.isfile(_os.path.join(d, "__init__.py")) for d in folders.values()):
        return

    class CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            folder = folders.get(fullname)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                fullname, _os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])

    if not any(type(f).__name__ == "CheckoutFinder" for f in _sys.meta_path):
        _sys.meta_path.insert(0, CheckoutFinder())


_checkout_subpackages()

from . import config  # noqa: E402
from .runtime.loader import _interpret_triton_library  # noqa: E402


def _select_triton_mode() -> None:
    """Interpret Triton without CUDA, unless TRITON_INTERPRET says. Triton reads it as it decorates
    @jit functions: re-wrap its own if imported (also if the program set it after that import)."""
    if config.triton_interpret is False:
        return
    if "TRITON_INTERPRET" not in _os.environ:
        import torch
        if not config.triton_interpret and torch.cuda.is_available():
            return
        _os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in _sys.modules and _sys.modules["triton"].knobs.runtime.interpret:
        _interpret_triton_library()


_select_triton_mode()

from .runtime.symm import comm_report  # noqa: E402  (after the Triton mode is chosen)
from . import collectives as _collectives  # noqa: E402,F401  (the algorithm registry, which checks config.comm.algorithm)

__all__ = ["config", "commfuse_backend"]


def commfuse_backend(gm, example_inputs, **kwargs):
    from .backend import commfuse_backend as _backend  # `import commfuse` stays light: the compiler loads at the first compile
    return _backend(gm, example_inputs, **kwargs)


def _register() -> None:
    """The entry point registers `backend="commfuse"` once installed; importing commfuse does too
    (e.g. when it is used from a source tree on PYTHONPATH)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    if "commfuse" not in _BACKENDS:
        register_backend(name="commfuse")(commfuse_backend)


_register()

from . import dump as _dump  # noqa: E402

_dump.register_torch_logging()  # TORCH_LOGS="+commfuse", "output_code" (torch reads it at its import)
