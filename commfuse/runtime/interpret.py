"""Whether Triton runs kernels in its interpreter (CPU tensors). Free of torch and of the package:
triton_helpers reads it, and compile workers load that without either."""
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
