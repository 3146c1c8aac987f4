"""torchvision models that no test of ours is written for, fw + bw against eager (1 GPU; fp32 unless --dtype).

    python bench/heldout_torchvision.py --models densenet121,maxvit_t --out bench/results/heldout_torchvision_h200.json

Per model (random weights, eval mode, batch 2 at 224² (inception_v3: 299²), TF32 off): the
compiled forward and the gradients of sum(y × g) for a fixed random g, against eager in the same
dtype. With `--train-bn`, BatchNorm runs in train mode (batch statistics, running stats updated;
dropout stays off; at batch 2 the batch statistics amplify rounding: compare `--backend inductor`).
fw_err: max |y - eager| / max |eager|, and the same of every float buffer (the running stats,
floored at 1e-3 × the largest); bw_err: the largest over the parameters of max |grad - eager's| / max(max |eager's|,
1e-3 × the largest gradient). `ok`: both below 1e-3.
A compile error raises (COMMFUSE_FALLBACK_ON_ERROR=0) and is recorded with its traceback.
`fallbacks`: aten ops run as externs, convolutions left out (aten's by design).
"""
import argparse
import copy
import glob
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("COMMFUSE_FALLBACK_ON_ERROR", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import commfuse  # noqa: E402,F401
import torch  # noqa: E402
from commfuse import config  # noqa: E402

MODELS = ("densenet121,efficientnet_b0,convnext_tiny,swin_t,vit_b_16,regnet_y_400mf,shufflenet_v2_x1_0,"
          "googlenet,squeezenet1_1,maxvit_t")


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def check(name: str, train_bn: bool = False, backend: str = "commfuse", dtype=torch.float32) -> dict:
    import torchvision
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    kw = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    model = getattr(torchvision.models, name)(weights=None, **kw).cuda().to(dtype).eval()
    if train_bn:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.train()
    ref = copy.deepcopy(model)
    size = 299 if name == "inception_v3" else 224
    x = torch.randn(2, 3, size, size, device="cuda", dtype=dtype)
    dump = tempfile.mkdtemp()
    with config.patch(dump_dir=dump):
        y = torch.compile(model, backend=backend)(x)
        g = torch.randn_like(y)
        (y * g).sum().backward()
    ry = ref(x)
    (ry * g).sum().backward()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    bw = max(((p.grad - q.grad).abs().max() / max(q.grad.abs().max().item(), 1e-3 * gmax)).item()
             for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
    fallbacks = set()
    for f in glob.glob(f"{dump}/rank0/*/summary.json"):
        fallbacks |= set(json.load(open(f)).get("fallback_ops", []))
    fw = _rel(y, ry)
    # running stats (train-mode BatchNorm), with a floor: a running mean that is 0 but for
    # rounding (a channel normalized before) has no relative error worth the name
    floats = [(b, rb) for b, rb in zip(model.buffers(), ref.buffers()) if b.is_floating_point()]
    bmax = max((rb.abs().max().item() for _, rb in floats), default=0.0)
    for b, rb in floats:
        fw = max(fw, ((b - rb).abs().max() / max(rb.abs().max().item(), 1e-3 * bmax)).item())
    return dict(ok=fw < 1e-3 and bw < 1e-3, fw_err=fw, bw_err=bw,
                breaks=sum(torch._dynamo.utils.counters["graph_break"].values()),
                fallbacks=sorted(f for f in fallbacks if "convolution" not in f))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--train-bn", action="store_true", help="BatchNorm in train mode (batch statistics)")
    ap.add_argument("--backend", default="commfuse", help="inductor: the same errors of Inductor's, for scale")
    ap.add_argument("--dtype", default="float32", help="float64: rounding too small for batch statistics to amplify")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    results = {}
    for name in args.models.split(","):
        t0 = time.time()
        try:
            results[name] = check(name, args.train_bn, args.backend, getattr(torch, args.dtype))
        except Exception as e:  # recorded, and the sweep goes on
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:600], tb=traceback.format_exc()[-2500:])
        results[name]["seconds"] = round(time.time() - t0, 1)
        print(name, {k: v for k, v in results[name].items() if k != "tb"}, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


if __name__ == "__main__":
    main()
