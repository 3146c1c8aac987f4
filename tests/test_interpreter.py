"""The CPU path: generated kernels under Triton's interpreter. Random draws whatever was imported
first, threads calling one compiled function, and reductions shaped for the interpreter (few, wide
programs), without numpy's warnings. Values against eager."""
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

from commfuse.runtime.loader import interpreting
from tests.common import compile_and_run

pytestmark = pytest.mark.skipif(not interpreting(), reason="Triton's interpreter")

# triton (and transformers, which imports it) before commfuse, and the backend by name: the entry
# point imports commfuse at the first compile, after triton's own @jit functions were decorated
RANDOM_AFTER_TRITON = """
import sys
import triton
import torch
import torch.nn.functional as F
assert "commfuse" not in sys.modules
x = torch.rand(64, 500) + 0.5

def draws(x, p):
    return F.dropout(x, p, training=True), torch.rand_like(x), torch.randn_like(x)

fn = torch.compile(draws, backend="commfuse")
for p in (0.0, 1.0):  # no draw decides these: eager's values
    for got, want in zip(fn(x, p)[:1], draws(x, p)[:1]):
        torch.testing.assert_close(got, want)
dropped, u, n = fn(x, 0.5)
kept = dropped != 0
assert abs(kept.float().mean() - 0.5) < 5 * (0.25 / x.numel()) ** 0.5, kept.float().mean()
torch.testing.assert_close(dropped, torch.where(kept, x * 2, 0.0))
assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
assert "commfuse" in sys.modules
torch.testing.assert_close(torch.compile(lambda x: x.sum(1), backend="commfuse")(x), x.sum(1))
print("ok")
"""

HF_TRAIN_STEP = """
import transformers
import torch
cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1,
                              attention_probs_dropout_prob=0.1)
torch.manual_seed(0)
model = transformers.BertForMaskedLM(cfg).train()
ids = torch.randint(0, 128, (2, 16))
step = torch.compile(lambda: model(input_ids=ids, labels=ids).loss, backend="commfuse")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
before = [p.detach().clone() for p in model.parameters()]
loss = step()
loss.backward()
opt.step()
assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(128.0))) < 1.0, loss
grads = [p.grad for p in model.parameters() if p.grad is not None]
assert grads and all(torch.isfinite(g).all() for g in grads)
assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
model.eval()  # no dropout: eager's values
with torch.no_grad():
    torch.testing.assert_close(torch.compile(lambda: model(input_ids=ids, labels=ids).loss, backend="commfuse")(),
                               model(input_ids=ids, labels=ids).loss)
print("ok")
"""


def _fresh_python(script: str):
    """A new interpreter that has not chosen Triton's mode yet (this one has: conftest)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


@pytest.mark.parametrize("set_by", ["commfuse", "program"])
def test_random_draws_after_triton_was_imported(set_by):
    """tl.rand calls Philox helpers that triton decorated for the GPU when it was imported; so
    does tl.sum its combine function, also where the program sets TRITON_INTERPRET after that."""
    switch = 'import os; os.environ["TRITON_INTERPRET"] = "1"\n' if set_by == "program" else ""
    _fresh_python(RANDOM_AFTER_TRITON.replace("import torch\n", f"import torch\n{switch}", 1))


def test_hf_model_with_dropout_trains_after_transformers_was_imported():
    pytest.importorskip("transformers")
    _fresh_python(HF_TRAIN_STEP)


def test_threads_share_one_compiled_function():
    """Three threads call one compiled function (a draw, a Welford reduction, a max) at once: the
    interpreter's global state is taken in turns."""
    def fn(x):
        kept = torch.where(torch.rand_like(x) < 1.0, x, 0.0)  # drawn in the kernel; always x
        return kept.var(1) + x.amax(1), (x.sin() * 2).sum(0)

    torch.manual_seed(0)
    xs = [torch.randn(8, 300) for _ in range(3)]
    compiled = torch.compile(fn, backend="commfuse")
    compiled(xs[0])
    errors = []

    def work(x):
        try:
            for _ in range(8):
                for got, want in zip(compiled(x), fn(x)):
                    torch.testing.assert_close(got, want)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors and not any(t.is_alive() for t in threads), errors


def _reduction_launches(code):
    """(xnumel, XBLOCK, RBLOCK, rnumel) of each reduction launch, and whether its kernel loops."""
    blocks = dict(re.findall(r"^(cf_red\w*_launch\d+) = Site\(\w+, dict\((.*)\)\)$", code, re.M))
    out = []
    for site, x, args in re.findall(r"^\s+(cf_red\w*_launch\d+)\(_stream, \(cdiv\((\d+), \d+\), 1, 1\), (.*)\)$",
                                    code, re.M):
        b = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", blocks[site]))
        out.append((int(x), b["XBLOCK"], b["RBLOCK"], int(args.split(", ")[-1])))
    return out


@pytest.mark.parametrize("op,want", [
    ("std0", [(20000, 8192, 8, 8)]),  # columns' 8 rows whole, 3 programs of 8192 columns
    ("var1", [(16, 16, 2048, 10000), (8, 8, 2, 2)]),  # the GPU's split in 2, each kernel one program
])
def test_reductions_take_few_wide_programs(tmp_path, op, want):
    """(8, 20000): a GPU's blocks took 625 programs of 32 x 32 lanes for std(0) and 16 for var(1)
    (minutes under the interpreter); here a few programs of up to 65536 lanes, the GPU's kind and
    splits kept. No numpy warning (Welford's empty lanes divided 0 / 0)."""
    torch.manual_seed(0)
    x = torch.randn(8, 20000) * 3 + 10
    fn = {"std0": lambda x: x.std(0), "var1": lambda x: x.var(1)}[op]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, dumps = compile_and_run(fn, x, tmp_path=tmp_path)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    torch.testing.assert_close(out.double(), fn(x.double()), rtol=1e-5, atol=0)
    launches = _reduction_launches(dumps.only()[1])
    assert launches == want, launches


@pytest.mark.parametrize("op", ["amax", "amin", "argmax", "argmin", "prod", "var_mean"])
def test_combined_reductions_match_eager(tmp_path, op):
    """Reductions whose combine function is ours (NaN-propagating max / min, argmax's first index
    among ties, prod, Welford), which the interpreter combines lane pairs of at once: rows with
    ties, a NaN, and a length that is not a power of 2."""
    x = torch.randint(0, 5, (6, 999)).float()
    x[2, 7] = float("nan")
    if op == "prod":
        x = 1 + x * 1e-3
    fn = {"amax": lambda x: x.amax(1), "amin": lambda x: x.amin(0), "argmax": lambda x: x.argmax(1),
          "argmin": lambda x: x.argmin(0), "prod": lambda x: x.prod(1),
          "var_mean": lambda x: torch.var_mean(x, 1)}[op]
    out, _ = compile_and_run(fn, x, tmp_path=tmp_path)
    if op == "prod":  # 999 products, rounded in another order: against fp64
        torch.testing.assert_close(out.double(), fn(x.double()), rtol=1e-5, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(out, fn(x), equal_nan=True)


def test_ieee_values_without_numpy_warnings(tmp_path):
    """What eager computes without a word (log(0) = -inf, x / 0, 0 / 0), and lanes past the mask or
    in a where() branch not taken (Kahan's expm1 at 0 divides 0 / 0), warn from numpy in the
    interpreter unless launches run in IEEE arithmetic quietly."""
    x = torch.tensor([0.0, 1e-3, -2.0, 3.0, 0.0, 5.0, 7.0])
    fn = lambda x: (torch.expm1(x), torch.log(x), x / x, (x / 0.0).amax())  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = compile_and_run(fn, x, tmp_path=tmp_path)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    for got, want in zip(out, fn(x)):
        torch.testing.assert_close(got, want, equal_nan=True)
