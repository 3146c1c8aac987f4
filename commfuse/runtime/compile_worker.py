"""A compile worker of runtime/precompile.py, run as a script: `python compile_worker.py`.

It imports triton and nothing of torch or of the commfuse package: starting a worker costs
Triton's import only (torch's takes seconds on a cold machine, once per worker, on the CPUs the
compiling process needs). From a generated module it runs the kernels' part, above `HOST_CODE`,
which needs only triton and the helpers file beside this one.
"""
import importlib.util
import os
import pickle
import sys
import types

HOST_CODE = "# ---- host code: compile workers run only the kernels above ----"


def _helpers() -> None:
    """`from commfuse.runtime import triton_helpers`, answered without importing the package."""
    name = "commfuse.runtime.triton_helpers"
    if name in sys.modules:
        return
    here = os.path.dirname(__file__)
    package, runtime = types.ModuleType("commfuse"), types.ModuleType("commfuse.runtime")
    package.__path__, runtime.__path__ = [], [here]  # its own imports (`.interpret`) come from here
    package.runtime = runtime
    sys.modules.setdefault("commfuse", package)
    sys.modules.setdefault("commfuse.runtime", runtime)
    spec = importlib.util.spec_from_file_location(name, os.path.join(here, "triton_helpers.py"))
    helpers = importlib.util.module_from_spec(spec)
    sys.modules[name] = runtime.triton_helpers = helpers
    spec.loader.exec_module(helpers)


def kernels(path: str, module_name: str) -> dict:
    """The kernels of the generated module at `path`: its code above HOST_CODE, run under the
    module's own file name (Triton reads a kernel's source from it) and name."""
    _helpers()
    with open(path) as f:
        source = f.read().split(HOST_CODE, 1)[0]
    namespace = {"__name__": module_name, "__file__": path}
    exec(compile(source, path, "exec"), namespace)
    return namespace


def _use(settings: dict) -> None:
    """Triton's settings as the submitting process has them (precompile.triton_settings): any
    difference gives another cache key, and the launch would compile its kernel again."""
    env = settings["env"]
    for k in [k for k in os.environ if k.startswith("TRITON_") and k != "TRITON_INTERPRET" and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    if settings["ptxas_version"] is not None:
        from triton.backends.nvidia import compiler
        compiler.get_ptxas_version = lambda *args, **kwargs: settings["ptxas_version"]


def serve() -> None:
    """Compiles each job read from stdin into Triton's cache, answers None or why not."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to stderr, not into the replies
    from triton.compiler import ASTSource, compile as triton_compile
    try:  # where the CUDA backend builds a C launcher per kernel signature (3.6; 3.9 has one generic
        from triton.backends.nvidia import driver  # launcher), build it too: it is cached beside the kernel
        launcher = driver.CudaLauncher if hasattr(driver, "make_launcher") else None
    except ImportError:
        launcher = None
    modules = {}
    while True:
        try:
            path, module_name, target, settings, (name, signature, constexprs, attrs, options) = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            _use(settings)
            if path not in modules:
                modules[path] = kernels(path, module_name)
            kernel = triton_compile(ASTSource(modules[path][name], signature, constexprs, attrs), target=target,
                                    options=options)
            if launcher is not None and target.backend == "cuda":
                launcher(kernel.src, kernel.metadata)
            reply = None
        except Exception as e:
            reply = f"{name}: {type(e).__name__}: {e}"
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    serve()
