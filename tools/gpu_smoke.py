"""Quick end-to-end smoke check of common patterns on the available device (CPU or CUDA)."""
import torch, sys, traceback
import commfuse
from commfuse import config
config.fallback_on_error = False
torch.manual_seed(0)
DEV = 'cuda' if torch.cuda.is_available() else 'cpu'
def check(name, f, *args, grad=False, dynamic=False, **tol):
    torch._dynamo.reset()
    try:
        cf = torch.compile(f, backend="commfuse", dynamic=dynamic)
        if grad:
            a1 = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
            a2 = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
            o1 = f(*a1); o2 = cf(*a2)
            torch.testing.assert_close(o2, o1, **tol)
            g = torch.randn_like(o1)
            o1.backward(g); o2.backward(g)
            for x, y in zip(a1, a2):
                if x.grad is not None: torch.testing.assert_close(y.grad, x.grad, **tol)
        else:
            torch.testing.assert_close(cf(*args), f(*args), **tol)
        print("OK  ", name)
    except Exception as e:
        print("FAIL", name, type(e).__name__, str(e).split("\n")[0][:300])
        if "-v" in sys.argv: traceback.print_exc()
x = torch.randn(16, 64, device=DEV)
check("relu_sum", lambda x: (x.relu() + 1).sum(-1), x)
check("softmax", lambda x: torch.softmax(x, -1), x)
check("softmax_bwd", lambda x: torch.softmax(x, -1), x, grad=True)
check("layernorm", lambda x, w, b: torch.nn.functional.layer_norm(x, (64,), w, b), x, torch.randn(64, device=DEV), torch.randn(64, device=DEV), grad=True)
check("gelu", lambda x: torch.nn.functional.gelu(x), x, grad=True)
check("transpose_add", lambda x: x + x.t().contiguous().t() * 2, torch.randn(32, 32, device=DEV))
check("mm", lambda a, b: (a @ b).relu(), torch.randn(8, 16, device=DEV), torch.randn(16, 4, device=DEV), grad=True)
check("amax0", lambda x: x.amax(0), x)
check("mean_keepdim", lambda x: x.mean((0, 1), keepdim=True), x)
check("argmax", lambda x: x.argmax(-1), x)
check("long_red", lambda x: x.sum(-1), torch.randn(4, 6000, device=DEV))
check("split_red", lambda x: x.sum(), torch.randn(100000, device=DEV), atol=1e-3, rtol=1e-4)
check("var", lambda x: torch.var_mean(x, -1), x)
check("cat", lambda a, b: torch.cat([a, b * 2], 1), torch.randn(4, 3, device=DEV), torch.randn(4, 5, device=DEV))
check("pad", lambda a: torch.nn.functional.pad(a, (1, 2, 0, 1), value=3.0), torch.randn(4, 3, device=DEV))
check("embedding", lambda w, i: torch.nn.functional.embedding(i, w), torch.randn(10, 8, device=DEV), torch.randint(0, 10, (4, 5), device=DEV), grad=False)
check("gather", lambda x, i: torch.gather(x, 1, i), torch.randn(4, 6, device=DEV), torch.randint(0, 6, (4, 3), device=DEV))
check("ce", lambda x, t: torch.nn.functional.cross_entropy(x, t), torch.randn(8, 10, device=DEV), torch.randint(0, 10, (8,), device=DEV))
check("bf16", lambda x: (x * 2).sum(-1), torch.randn(8, 32, dtype=torch.bfloat16, device=DEV), atol=1e-2, rtol=1e-2)
check("dyn", lambda x: (x.relu() + 1).sum(-1), torch.randn(5, 32, device=DEV), dynamic=True)
check("int", lambda a, b: (a // b, a % b), torch.randint(-10, 10, (20,), device=DEV), torch.randint(1, 5, (20,), device=DEV))
check("empty", lambda a: a * 2, torch.randn(0, 4, device=DEV))
check("zerod", lambda a: a * 2 + 1, torch.tensor(3.0, device=DEV))
