"""Run Triton's front end (Python AST -> TTIR, for an sm_90 target) on the kernels of dumped
`output_code.py` files, on a machine without a GPU. Triton's interpreter, which runs the kernels on
CPU, takes Python's control flow as it is; the compiler does not (a variable an `if` redefines with
another type, a loop-carried value that changes shape). This catches those errors before a GPU run.

    python bench/triton_front_end.py DUMP_DIR/rank0/*/output_code.py [--only cf_mm_]

Run it in a process of its own (not under TRITON_INTERPRET=1). Kernels that call
commfuse.runtime.triton_helpers are skipped (the helpers are not loaded here).
"""
import argparse
import linecache
import os
import re
import sys
import types

DTYPES = {"torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32", "torch.float64": "*fp64",
          "torch.int32": "*i32", "torch.int64": "*i64", "torch.int8": "*i8", "torch.uint8": "*u8", "torch.bool": "*i1"}


def check(path: str, only: str) -> list[str]:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    src = open(path).read()
    kernels = src.split("\n# ---- host code", 1)[0].replace("from commfuse.runtime import triton_helpers",
                                                              "triton_helpers = None")
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    mod = types.ModuleType("kernels")
    exec(compile(kernels, path, "exec"), mod.__dict__)
    target = GPUTarget("cuda", 90, 32)
    backend, out, seen = CUDABackend(target), [], set()
    for name, specs, consts in re.findall(r"^\s*\((cf_\w+), \((.*?),?\), dict\((.*)\)\),$", src, re.M):
        if name in seen or not name.startswith(only) or "triton_helpers." in src.split(f"def {name}(", 1)[1].split("\n@", 1)[0]:
            continue
        seen.add(name)
        fn, cdict = getattr(mod, name), dict(kv.split("=") for kv in consts.split(", "))
        values = iter(s.strip() for s in specs.split(",") if s.strip())
        sig, constexprs = {}, {}
        for i, p in enumerate(fn.arg_names):
            if p in cdict:
                sig[p], constexprs[(i,)] = "constexpr", eval(cdict[p])
            else:
                v = next(values)
                sig[p] = DTYPES.get(v) or ("fp32" if "." in v else "i32")
        opts = backend.parse_options({k: int(cdict[k]) for k in ("num_warps", "num_stages") if k in cdict})
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        try:
            ASTSource(fn, sig, constexprs).make_ir(target, opts, backend.get_codegen_implementation(opts),
                                                   backend.get_module_map(), ctx)
            out.append(f"ok      {name}")
        except Exception as e:  # noqa: BLE001  (the report is the point)
            out.append(f"FAILED  {name}: {str(e).strip().splitlines()[-1]}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--only", default="cf_", help="kernel name prefix (e.g. cf_mm_)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the front end needs Triton's JIT functions")
    failed = False
    for path in args.paths:
        for line in check(path, args.only):
            print(f"{path}: {line}")
            failed |= line.startswith("FAILED")
    sys.exit(1 if failed else 0)
