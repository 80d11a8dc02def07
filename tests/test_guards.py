"""FP32 guards (lightning_mp/guards.py): selection, dtypes inside guarded modules, the numbers they save."""

import contextlib
import copy
import gc
import os
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MPPlugin
from lightning_mp.guards import (
    DEFAULT_FP32_MODULES,
    FP32GuardSpec,
    apply_fp32_guards,
    fp32_guard_of,
    fp32_layer_norm,
    fp32_log_softmax,
    fp32_region,
    fp32_softmax,
    guarded_modules,
    remove_fp32_guards,
)
from lightning_mp.master import cast_module_


class LlamaRMSNorm(nn.Module):
    """A hand-written RMSNorm, as in many model zoos: overflows fp16 when |x| > 256 unless guarded."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class NaiveSoftmax(nn.Module):
    """exp / sum(exp): overflows fp16 for logits above ~11 unless guarded."""

    def forward(self, x):
        e = x.exp()
        return e / e.sum(-1, keepdim=True)


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.my_rms = LlamaRMSNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.bn2 = nn.BatchNorm2d(8)
        self.sync_bn = nn.SyncBatchNorm(8)
        self.inorm = nn.InstanceNorm1d(8)
        self.softmax = nn.Softmax(-1)
        self.log_softmax = nn.LogSoftmax(-1)
        self.moe = nn.ModuleDict({"router": nn.Linear(8, 4), "expert": nn.Linear(8, 8)})
        self.lm_head = nn.Linear(8, 10)
        self.loss = nn.CrossEntropyLoss()
        self.mse = nn.MSELoss()
        self.block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))  # a composite: only its LayerNorm


# (not torch's nn.RMSNorm: it computes in fp32 by itself, guards.computes_in_fp32)
DEFAULT_NAMES = [
    "ln", "my_rms", "gn", "bn1", "bn2", "sync_bn", "inorm", "softmax", "log_softmax", "loss", "mse", "block.0",
]


def test_default_set_guards_norms_softmax_and_losses_only():
    assert apply_fp32_guards(Zoo()) == DEFAULT_NAMES
    assert apply_fp32_guards(Zoo(), None) == apply_fp32_guards(Zoo(), ["defaults"])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ([], []),
        (["Linear"], ["proj", "moe.router", "moe.expert", "lm_head", "block.1"]),
        (["*.router"], ["moe.router"]),
        (["router"], ["moe.router"]),  # a bare name matches any dotted suffix
        (["lm_head", "moe.*"], ["moe.router", "moe.expert", "lm_head"]),
        ([nn.Embedding, "torch.nn.modules.normalization.GroupNorm"], ["embed", "gn"]),
        (["defaults", "*.router", nn.Embedding], ["embed", *DEFAULT_NAMES[:11], "moe.router", "block.0"]),
        (["block"], ["block"]),  # a composite module guards its whole subtree; its children are not listed
        (["_BatchNorm"], ["bn1", "bn2", "sync_bn"]),  # base-class names count
    ],
)
def test_selection_by_class_name_pattern_suffix_and_class(spec, expected):
    assert sorted(apply_fp32_guards(Zoo(), spec)) == sorted(expected)


def test_selection_spec_from_a_nested_module_name():
    wrapper = nn.ModuleDict({"model": Zoo()})
    assert "model.lm_head" in guarded_modules(wrapper, ["lm_head"])
    assert guarded_modules(wrapper, ["model"]) == ["model"]


@pytest.mark.parametrize("bad", [[3], [""], "LayerNorm", [int], [nn.LayerNorm(4)], 5])
def test_bad_fp32_modules_raise_with_the_value(bad):
    with pytest.raises(ValueError, match="fp32_modules"):
        FP32GuardSpec.from_arg(bad)
    with pytest.raises(ValueError, match="fp32_modules"):
        MPPlugin("bf16", fp32_modules=bad)


def test_guards_are_idempotent_removable_and_survive_copies():
    model = Zoo()
    apply_fp32_guards(model)
    apply_fp32_guards(model)
    assert len(model.gn._forward_pre_hooks) == 1 and len(model.gn._forward_hooks) == 1
    # a plain LayerNorm's guard is its forward alone: no hooks (Module.__call__ takes its fast path)
    assert not model.ln._forward_pre_hooks and not model.ln._forward_hooks and "forward" in model.ln.__dict__
    assert fp32_guard_of(model.ln) is not None and fp32_guard_of(model.proj) is None
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert fp32_guard_of(copied.ln) is not None and fp32_guard_of(copied.gn) is not None
        assert apply_fp32_guards(copied) == DEFAULT_NAMES
        assert len(copied.gn._forward_pre_hooks) == 1 and not copied.ln._forward_pre_hooks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert copied.ln(copied.proj(torch.randn(2, 8))).dtype == torch.float32
    del model.gn.__dict__["forward"]  # as pickled when only LayerNorms had the guard's forward: put back
    assert apply_fp32_guards(model) == DEFAULT_NAMES and "forward" in model.gn.__dict__
    assert sorted(remove_fp32_guards(model)) == sorted(DEFAULT_NAMES)
    assert not model.gn._forward_pre_hooks and fp32_guard_of(model.ln) is None and fp32_guard_of(model.gn) is None
    assert not any("forward" in m.__dict__ for m in model.modules())


# --------------------------------------------------------------------------------------------- in a Trainer
class Recording(nn.Module):
    """Records, inside forward, the input dtype, the autocast state and the default dtype."""

    def __init__(self, inner: nn.Module, log: list) -> None:
        super().__init__()
        self.inner = inner
        self.log = log

    def forward(self, x):
        self.log.append((x.dtype, torch.is_autocast_enabled("cpu"), torch.get_default_dtype()))
        return self.inner(x)


class GuardedNet(LightningModule):
    """Linear -> LayerNorm -> Linear -> router (Linear) + BatchNorm, MSELoss: guards recorded by hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: dict[str, list] = {"norm": [], "router": [], "fc1": [], "bn": []}
        self.outputs: dict[str, list] = {k: [] for k in ("fc1", "norm", "fc2", "router", "bn", "loss")}
        self.fc1 = Recording(nn.Linear(8, 16), self.inside["fc1"])
        self.norm = Recording(nn.LayerNorm(16), self.inside["norm"])
        self.fc2 = nn.Linear(16, 16)
        self.router = Recording(nn.Linear(16, 1), self.inside["router"])
        self.bn = Recording(nn.BatchNorm1d(16), self.inside["bn"])
        self.loss_fn = nn.MSELoss()
        for name in self.outputs:
            module = getattr(self, name if name != "loss" else "loss_fn")
            module.register_forward_hook(lambda m, a, out, name=name: self.outputs[name].append(out.dtype))

    def forward(self, x):
        h = self.fc2(self.norm(self.fc1(x)))
        return self.router(self.bn(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def scaler_args(mode: str) -> dict:
    return {"init_scale": 2.0**8} if mode.startswith("fp16") else {}


# the guarded containers are matched by name ("*LayerNorm" does not see through the Recording wrapper)
GUARDS = ["norm", "router", "bn", "loss_fn"]


@pytest.mark.parametrize(("mode", "low"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_under_autocast_guarded_modules_run_fp32_and_linears_stay_low(mode, low):
    model = GuardedNet()
    make_trainer(MPPlugin(mode, fp32_modules=GUARDS, **scaler_args(mode)), max_steps=2).fit(model)
    # inside the guards: fp32 inputs, autocast off; outside: autocast on and the Linear computes in low precision
    assert set(model.inside["norm"]) == set(model.inside["router"]) == {(torch.float32, False, torch.float32)}
    assert set(model.inside["fc1"]) == {(torch.float32, True, torch.float32)}
    assert set(model.outputs["fc1"]) == set(model.outputs["fc2"]) == {low}
    assert set(model.outputs["router"]) == set(model.outputs["norm"]) == {torch.float32}  # autocast's rule
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("mode", "low"), [("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)])
def test_true_half_guards_keep_params_buffers_fp32_and_hand_back_half(mode, low):
    model = GuardedNet()
    mean0 = model.bn.inner.running_mean.clone()
    seen: dict = {}

    class DuringTheRun(Callback):
        def on_train_end(self, trainer, pl_module):
            seen.update({n: t.dtype for n, t in (*pl_module.named_parameters(), *pl_module.named_buffers())})

    plugin = MPPlugin(mode, fp32_modules=GUARDS, **scaler_args(mode))
    make_trainer(plugin, max_steps=3, callbacks=[DuringTheRun()]).fit(model)
    assert {n: d for n, d in seen.items() if n.startswith(("fc1", "fc2"))} == dict.fromkeys(
        ["fc1.inner.weight", "fc1.inner.bias", "fc2.weight", "fc2.bias"], low
    )
    guarded = {n: d for n, d in seen.items() if n.startswith(("norm", "router", "bn")) and "num_batches" not in n}
    assert set(guarded.values()) == {torch.float32}  # in the run: the guarded modules' weights and statistics fp32
    # after it, every weight and buffer in the half dtype, as Lightning's precision="bf16-true"/"16-true" leaves them
    assert all(t.dtype == low for t in model.parameters())
    bn = model.bn.inner
    assert bn.running_mean.dtype == bn.running_var.dtype == low
    assert not torch.equal(bn.running_mean, mean0.to(low))  # the statistics were updated
    assert model.dtype == low  # LightningModule.dtype reports the training dtype
    # inside the guards fp32 (and fp32 as default dtype); outside, half inputs and half default dtype
    assert set(model.inside["norm"]) == set(model.inside["bn"]) == {(torch.float32, False, torch.float32)}
    assert set(model.inside["fc1"]) == {(low, False, low)}
    # outputs go back to the model's dtype, except the loss module's
    assert set(model.outputs["norm"]) == set(model.outputs["router"]) == set(model.outputs["fc2"]) == {low}
    assert set(model.outputs["loss"]) == {torch.float32}


# --------------------------------------------------------------------------------------------- numbers
def test_guard_keeps_fp16_from_overflowing():
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 300).half()  # x^2 reaches ~1e6 (fp16 overflows at 65504)
    reference = nn.Sequential(LlamaRMSNorm(64), nn.Linear(64, 64), NaiveSoftmax())
    reference[1].weight.data.mul_(4.0)  # logits of ~20-40: exp overflows fp16 above ~11
    unguarded = copy.deepcopy(reference).half()
    guarded = copy.deepcopy(reference)
    cast_module_(guarded, torch.float16, keep_fp32=apply_fp32_guards(guarded, ["*RMSNorm", "NaiveSoftmax"]))
    assert guarded[0].weight.dtype == torch.float32 and guarded[1].weight.dtype == torch.float16

    # unguarded: x^2 overflows, rsqrt(inf) = 0 wipes the activations; exp overflows, inf/inf = NaN
    assert (unguarded[0](x) == 0).all()
    logits = (torch.randn(4, 64) * 20).half()
    assert torch.isnan(unguarded[2](logits)).any()
    torch.testing.assert_close(guarded[2](logits).float(), F.softmax(logits.float(), -1), atol=1e-3, rtol=0)
    # guarded: the same chain in fp32 where it matters, against fp64 with the fp16 Linear weights
    result = guarded(x)
    assert result.dtype == torch.float16 and torch.isfinite(result).all()
    expected = copy.deepcopy(nn.Sequential(reference[0], guarded[1], reference[2])).double()(x.double())
    torch.testing.assert_close(result.double(), expected, atol=2e-3, rtol=0)
    assert (unguarded(x).double() - expected).abs().max() > 0.1
    # the Linear between the guards still ran in fp16
    seen = []
    guarded[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    guarded(x)
    assert seen == [torch.float16]


def test_large_reduction_and_softmax_helpers():
    logits = torch.full((1, 70000), 1.0).half()
    assert torch.isinf(logits.sum())  # 70000 > 65504: an fp16 reduction overflows
    with fp32_region():
        assert logits.float().sum().item() == 70000.0
    scores = torch.tensor([[12.0, 0.0, -20.0]]).half()
    probs = fp32_softmax(scores, -1)
    assert probs.dtype == torch.float16  # no autocast: back to the input's dtype
    torch.testing.assert_close(probs.float(), F.softmax(scores.float(), -1).half().float())
    assert fp32_softmax(scores, -1, dtype=torch.float32)[0, 2].item() > 0  # e^-32 survives in fp32
    assert torch.isfinite(fp32_log_softmax(scores, -1)).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp32_softmax(scores.bfloat16(), -1).dtype == torch.float32  # autocast: fp32, as autocast's softmax
        assert fp32_log_softmax(scores.bfloat16(), -1).dtype == torch.float32
        x = torch.randn(2, 8).bfloat16()
        ln = fp32_layer_norm(x, 8, torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))
        assert ln.dtype == torch.float32
        torch.testing.assert_close(ln, F.layer_norm(x.float(), (8,)))
    assert fp32_layer_norm(torch.randn(2, 8).half(), [8]).dtype == torch.float16


def test_fp32_region_turns_autocast_off_and_restores_everything():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with fp32_region():
                assert not torch.is_autocast_enabled("cpu")
                assert torch.get_default_dtype() == torch.float32
                assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32
            assert torch.is_autocast_enabled("cpu") and torch.get_default_dtype() == torch.bfloat16

            class Boom(nn.Module):
                def forward(self, x):
                    raise RuntimeError("boom")

            model = nn.Sequential(Boom())
            apply_fp32_guards(model, ["Boom"])
            with pytest.raises(RuntimeError, match="boom"):
                model(torch.randn(2))
            assert torch.is_autocast_enabled("cpu") and torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(previous)


def test_default_list_is_documented_and_guards_off_with_an_empty_list():
    assert "*LayerNorm" in DEFAULT_FP32_MODULES and "torch.nn.modules.loss._Loss" in DEFAULT_FP32_MODULES
    model = GuardedNet()
    make_trainer(MPPlugin("bf16-true", fp32_modules=[]), max_steps=1).fit(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert fp32_guard_of(model.norm) is None


def test_cuda_autocast_modes_skip_guards_autocast_already_runs_in_fp32():
    from lightning_mp.guards import AUTOCAST_FP32_ON_CUDA, DEFAULT_FP32_MODULES, FP32GuardSpec

    reduced = FP32GuardSpec.from_arg(["defaults", "*.router"]).without_autocast_fp32()
    assert "*LayerNorm" not in reduced.patterns and "torch.nn.modules.loss._Loss" not in reduced.patterns
    assert {"*BatchNorm*", "*RMSNorm", "*InstanceNorm*", "*.router"} <= set(reduced.patterns)
    assert set(reduced.patterns) == (set(DEFAULT_FP32_MODULES) - set(AUTOCAST_FP32_ON_CUDA)) | {"*.router"}
    # a user's own entries stay
    assert FP32GuardSpec.from_arg(["LayerNorm"]).without_autocast_fp32().patterns == ("LayerNorm",)


def test_default_loss_guard_takes_torch_losses_not_any_class_named_loss():
    class CaptionLoss(nn.Module):  # a user's whole model, named after what it returns
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x).sum()

    model = nn.Sequential(CaptionLoss(), nn.CrossEntropyLoss())
    spec = FP32GuardSpec.from_arg(None)
    assert not spec.matches("0", model[0])
    assert spec.matches("1", model[1]) and spec.matches("x", nn.MSELoss())
    assert FP32GuardSpec.from_arg(["CaptionLoss"]).matches("0", model[0])  # still guardable by name


# --------------------------------------------------------------------------------------------- saved activations
class _HookPathLayerNorm(nn.LayerNorm):
    """A LayerNorm with its own forward: its guard runs it in the hooks' fp32 region (the general eager path)."""

    def forward(self, x):
        return super().forward(x)


def _guarded_ln(width: int, cls: type = _HookPathLayerNorm) -> nn.Module:
    model = nn.Sequential(cls(width))
    apply_fp32_guards(model, None)
    return model


def _grads(model: nn.Module, x: torch.Tensor, outer_hooks: bool = False, checkpoint: bool = False):
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    with contextlib.ExitStack() as stack:
        if outer_hooks:  # any saved-tensor hooks in force: the guard leaves what is saved alone
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        else:
            out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]


def test_guard_saves_the_16bit_original_and_gradients_do_not_change():
    model = _guarded_ln(64)
    x = torch.randn(8, 64).bfloat16() * 3
    packed = _grads(model, x)
    plain = _grads(model, x, outer_hooks=True)
    checkpointed = _grads(model, x, checkpoint=True)
    for a, b, c in zip(packed, plain, checkpointed):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_guard_does_not_stand_in_for_an_input_changed_in_place():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)

        def forward(self, x):
            x.mul_(2.0).add_(0.1)  # the upcast copy changes: its bf16 original no longer holds its values
            return self.ln(x)

    class GuardedInPlace(InPlace):
        pass

    model = nn.Sequential(GuardedInPlace())
    apply_fp32_guards(model, ["GuardedInPlace"])
    x = torch.randn(4, 16).bfloat16()
    packed = _grads(model, x)
    plain = _grads(model, x, outer_hooks=True)
    for a, b in zip(packed, plain):
        assert torch.equal(a, b)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from /proc")
def test_guarded_norm_keeps_half_the_activation_memory_for_backward():
    """What a guarded LayerNorm keeps for backward: the bf16 input (already alive), not a 2x larger fp32 copy."""
    n = 32 * 2**20  # 32 M elements: 64 MB in bf16, 128 MB in fp32
    model = _guarded_ln(1024)
    x = torch.randn(n // 1024, 1024).bfloat16().requires_grad_(True)
    kept = {}
    for name, outer in (("packed", False), ("plain", True)):
        gc.collect()
        before = _rss_bytes()
        with contextlib.ExitStack() as stack:
            if outer:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
            out = model(x)
        kept[name] = _rss_bytes() - before  # the output (bf16) plus what backward needs
        del out
    assert kept["plain"] - kept["packed"] > 0.75 * 4 * n  # about the fp32 copy (128 MB) kept only without it
    # a plain nn.LayerNorm (one autograd node on the CPU and for small inputs) keeps the bf16 input either way
    lean = _guarded_ln(1024, nn.LayerNorm)
    gc.collect()
    before = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = lean(x)
    assert _rss_bytes() - before < kept["plain"] - 0.75 * 4 * n
    del out


def test_fp32_layer_norm_helper_saves_the_original_too():
    from lightning_mp.guards import fp32_layer_norm

    w, b = torch.randn(32), torch.randn(32)

    def grads(outer: bool):
        x = (torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * 4).bfloat16().requires_grad_(True)
        with contextlib.ExitStack() as stack:
            if outer:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
            y = fp32_layer_norm(x, 32, w, b)
        assert y.dtype is torch.bfloat16
        (y.float() * torch.arange(32.0)).sum().backward()
        return x.grad

    assert torch.equal(grads(False), grads(True))


# --------------------------------------------------------------------------------------------- compiled LayerNorm
# On CUDA with Triton a guarded nn.LayerNorm in a true-half model runs torch.compile's fused kernel of
# layer_norm(x.float(), fp32 weights).to(x.dtype). The CPU has neither, so these tests stand the eager function in
# for the compiled one to check the dispatch; tests/gpu/test_cuda.py runs the compiled kernel for real.
@pytest.fixture
def fused_stand_in(monkeypatch):
    from lightning_mp import guards

    calls = []

    def eager(x, w, b, eps, shape):
        calls.append(x.dtype)
        return guards._layer_norm_fp32(x, w, b, eps, shape)

    monkeypatch.setattr(guards, "fused_layer_norm_available", lambda x: guards._FUSED_LAYER_NORM["failed"] is None)
    monkeypatch.setitem(guards._FUSED_LAYER_NORM, "fn", eager)
    monkeypatch.setitem(guards._FUSED_LAYER_NORM, "failed", None)
    monkeypatch.setattr(guards, "COMPILED_LAYER_NORM_MIN_NUMEL", 0)
    return calls


class OwnForwardLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x)


def _guarded_norm(cls=nn.LayerNorm, width=64):
    model = nn.Sequential(cls(width))
    apply_fp32_guards(model)
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        model[0].bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    return model


def test_guarded_layer_norm_takes_the_compiled_kernel_on_16bit_inputs(fused_stand_in):
    fused, eager = _guarded_norm(), _guarded_norm(OwnForwardLayerNorm)
    eager.load_state_dict(fused.state_dict())
    seen = []
    fused[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 4).bfloat16()
    out = fused(x)
    assert seen == [torch.bfloat16] and fused_stand_in == [torch.bfloat16]  # no fp32 copy made before the kernel
    assert out.dtype is torch.bfloat16 and torch.equal(out, eager(x))
    for a, b in zip(_grads(fused, x), _grads(eager, x)):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps its fp32 rule: the eager upcast path
        assert fused(x).dtype is torch.float32
    assert fused_stand_in.count(torch.bfloat16) == 2  # the forward and the one in _grads; not under autocast


def test_a_failing_compiled_kernel_falls_back_to_the_eager_upcast(fused_stand_in, monkeypatch):
    from lightning_mp import guards

    def broken(*args):
        raise RuntimeError("no ptxas here")

    monkeypatch.setitem(guards._FUSED_LAYER_NORM, "fn", broken)
    model, reference = _guarded_norm(), _guarded_norm(OwnForwardLayerNorm)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 64).bfloat16()
    with pytest.warns(UserWarning, match="compiled fp32 LayerNorm guard failed .*no ptxas here"):
        out = model(x)
    assert torch.equal(out, reference(x))
    assert "no ptxas here" in guards._FUSED_LAYER_NORM["failed"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), reference(x))  # the eager path from now on, without a second warning


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", ["small", "large"])
def test_guarded_layer_norms_skip_the_region_with_the_upcast_paths_values(dtype, affine, size, monkeypatch):
    """A guarded nn.LayerNorm on a 16-bit input, without autocast, runs layer_norm(x.float(), fp32 weights)
    .to(x.dtype) without the hooks' fp32 region: below the compiled kernel's size as torch's composite ops (their own
    autograd nodes, no Python in backward), above it (on the CPU, no compiled kernel) as one autograd node that keeps
    the 16-bit input. Both give the same output and gradients, bit for bit, as the eager upcast path, with or without
    a grad on the input."""
    from lightning_mp import guards

    if size == "large":
        monkeypatch.setattr(guards, "COMPILED_LAYER_NORM_MIN_NUMEL", 0)
    fast = nn.Sequential(nn.LayerNorm(64, elementwise_affine=affine))
    eager = nn.Sequential(OwnForwardLayerNorm(64, elementwise_affine=affine))
    for m in (fast, eager):
        apply_fp32_guards(m)
    if affine:
        with torch.no_grad():
            fast[0].weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
            fast[0].bias.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
        eager.load_state_dict(fast.state_dict())
    seen = []
    fast[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 4 + 1).to(dtype)
    out = fast(x.clone().requires_grad_(True))
    node = "_UpcastLayerNormBackward" if size == "large" else "ToCopyBackward0"
    assert seen == [dtype] and out.dtype is dtype and out.grad_fn.name().endswith(node)
    assert torch.equal(out, eager(x))
    for a, b in zip(_grads(fast, x), _grads(eager, x)):
        assert torch.equal(a, b)
    if affine:  # an input without a grad (the first layer's): the weights' gradients alone
        dy = torch.randn(16, 64).to(dtype)
        fast.zero_grad()
        fast(x).backward(dy)
        eager.zero_grad()
        eager(x).backward(dy)
        assert torch.equal(fast[0].weight.grad, eager[0].weight.grad) and fast[0].weight.grad.dtype is torch.float32
    with torch.inference_mode():
        assert torch.equal(fast(x), eager(x))
    assert (guards.COMPILED_LAYER_NORM_MIN_NUMEL > x.numel()) is (size == "small")


def test_a_plain_layer_norm_under_autocast_leaves_fp32_to_autocast_with_the_regions_values():
    """Under autocast a guarded plain nn.LayerNorm on an fp32 input opens no fp32 region (autocast keeps an fp32
    layer_norm in fp32 itself): the same fp32 output and gradients as the region's path, bit for bit."""
    fast, eager = _guarded_norm(), _guarded_norm(OwnForwardLayerNorm)
    eager.load_state_dict(fast.state_dict())
    guard = fp32_guard_of(fast[0])
    regions = []
    fast[0].register_forward_pre_hook(lambda m, a: regions.append(len(guard._open)))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 4 + 1
    outs, grads = [], []
    for model in (fast, eager):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xi)
        out.backward(torch.arange(64.0).expand(16, 64))
        outs.append(out)
        grads.append((xi.grad, model[0].weight.grad, model[0].bias.grad))
    assert outs[0].dtype is torch.float32 and torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert regions == [0] and guard._open == []  # nothing opened: autocast runs it (the guard has no hooks)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a 16-bit input on the CPU: CPU autocast keeps it 16-bit,
        assert fast(x.bfloat16()).dtype is torch.float32  # so the region runs, as before


def test_only_plain_layer_norms_get_the_compiled_forward():
    own = nn.LayerNorm(8)
    own.forward = lambda x: nn.LayerNorm.forward(own, x) + 1  # a forward set on the instance: kept, no kernel
    model = nn.Sequential(nn.LayerNorm(8), OwnForwardLayerNorm(8), nn.GroupNorm(2, 8), own)
    apply_fp32_guards(model)
    fused = [fp32_guard_of(m).fused_layer_norm for m in model]
    assert fused == [True, False, False, False]
    assert all("forward" in m.__dict__ for m in model)  # every guarded module: the guard's forward
    x = torch.randn(2, 8)
    torch.testing.assert_close(model[3](x), F.layer_norm(x, (8,)) + 1)
    remove_fp32_guards(model)
    assert not any("forward" in m.__dict__ for m in model[:3])
    torch.testing.assert_close(model[3](x), F.layer_norm(x, (8,)) + 1)  # its own forward back


# --------------------------------------------------------------------------------------------- inference mode
class _EvalNet(nn.Module):
    """Linear -> LayerNorm -> BatchNorm -> Linear -> Softmax, and a CrossEntropyLoss on the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)
        self.softmax = nn.Softmax(-1)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        logits = self.fc2(self.bn(self.ln(self.fc1(x))))
        return self.softmax(logits), self.loss(logits, y)


def _layout(name: str, model: nn.Module, names: list, x: torch.Tensor):
    """The model, input and forward context of a layout: bf16 autocast, or true-half as MPPlugin('bf16-true')."""
    from lightning.fabric.plugins.precision.utils import _DtypeContextManager

    if name == "autocast":
        return model, x, lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    cast_module_(model, torch.bfloat16, keep_fp32=names)
    return model, x.bfloat16(), lambda: _DtypeContextManager(torch.bfloat16)


@pytest.mark.parametrize("layout", ["autocast", "true-half"])
@pytest.mark.parametrize("train", [True, False])
def test_guards_run_under_inference_mode(layout, train):
    """Lightning validates/tests/predicts under inference_mode (and a frozen teacher may run under it in training)."""
    torch.manual_seed(0)
    model = _EvalNet()
    names = apply_fp32_guards(model)
    assert names == ["ln", "bn", "softmax", "loss"]
    model, x, context = _layout(layout, model, names, torch.randn(6, 8) * 3)
    model.train(train)
    y = torch.randint(0, 4, (6,))
    reference, inferred = copy.deepcopy(model), copy.deepcopy(model)
    with context():
        expected = reference(x, y)
        with torch.inference_mode():
            got = inferred(x, y)
            helper = fp32_layer_norm(x @ torch.ones(8, 16, dtype=x.dtype), 16)
        helper_expected = fp32_layer_norm(x @ torch.ones(8, 16, dtype=x.dtype), 16)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert helper.dtype == helper_expected.dtype and torch.equal(helper, helper_expected)
    assert torch.equal(inferred.bn.running_mean, reference.bn.running_mean)
    assert not any(fp32_guard_of(m)._open for m in model.modules() if fp32_guard_of(m) is not None)


def test_guards_take_inference_tensors_with_grad_enabled():
    """Inputs made under inference_mode (cached teacher outputs) reach a guarded norm in a training forward."""
    model = _guarded_ln(16)
    with torch.inference_mode():
        x = torch.randn(4, 16).bfloat16()
    out = model(x)
    assert out.dtype is torch.bfloat16
    out.float().sum().backward()
    assert model[0].weight.grad is not None
    assert fp32_layer_norm(x, 16).dtype is torch.bfloat16


# --------------------------------------------------------------------------------------------- integer inputs
class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.embed(idx))


def test_guarded_embedding_in_a_true_half_model_hands_back_the_model_dtype():
    from lightning.fabric.plugins.precision.utils import _DtypeContextManager

    model = _Tokens()
    names = apply_fp32_guards(model, ["defaults", "Embedding"])
    assert names == ["embed"]
    cast_module_(model, torch.bfloat16, keep_fp32=names)
    idx = torch.randint(0, 10, (3, 5))
    seen = []
    model.head.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    with _DtypeContextManager(torch.bfloat16):  # MPPlugin's forward context in true-half modes
        out = model(idx)
    out.float().sum().backward()
    assert seen == [torch.bfloat16] and out.dtype is torch.bfloat16
    assert model.embed.weight.dtype is model.embed.weight.grad.dtype is torch.float32
    assert model.head.weight.grad.dtype is torch.bfloat16
    # the values: the fp32 embedding rows rounded once to bf16
    torch.testing.assert_close(out, model.head(model.embed.weight[idx].bfloat16()))
    # without a half default dtype (a plain fp32 model) or under autocast, the fp32 output stays
    plain = _Tokens()
    apply_fp32_guards(plain, ["Embedding"])
    assert plain.embed(idx).dtype is torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain.embed(idx).dtype is torch.float32


def test_guarded_embedding_trains_in_bf16_true():
    class TokenNet(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Tokens()

        def training_step(self, batch, batch_idx):
            idx, y = batch
            return F.cross_entropy(self.net(idx).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            idx, y = torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 4, (8, 5), generator=g)
            return DataLoader(TensorDataset(idx, y), batch_size=4)

        def on_train_end(self):
            self.in_run = (self.net.embed.weight.dtype, self.net.head.weight.dtype)

    model = TokenNet()
    before = model.net.embed.weight.detach().clone()
    make_trainer(MPPlugin("bf16-true", fp32_modules=["defaults", "Embedding"]), max_steps=1).fit(model)
    assert model.in_run == (torch.float32, torch.bfloat16)
    assert model.net.embed.weight.dtype is model.net.head.weight.dtype is torch.bfloat16  # as Lightning leaves it
    assert not torch.equal(model.net.embed.weight, before.bfloat16())


# --------------------------------------------------------------------------------------------- torch.compile
class _Block(nn.Module):
    """A small pre-norm transformer block: LayerNorm -> attention -> LayerNorm -> MLP."""

    def __init__(self, sdpa: bool, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.sdpa, self.heads = sdpa, heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(-1)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = self.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _run(model, x):
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    for p in model.parameters():
        p.grad = None
    return out, grads


class _AutocastInside(nn.Module):
    """The model's forward inside the compiled function's own autocast block."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


@pytest.mark.slow
@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "softmax-module"])
@pytest.mark.parametrize("layout", ["autocast", "autocast-inside", "true-half"])
def test_default_guards_add_no_graph_breaks_under_torch_compile(layout, sdpa):
    torch.manual_seed(0)
    model = _Block(sdpa)
    names = apply_fp32_guards(model)
    assert names == ["ln1", "softmax", "ln2"]
    model, x, context = _layout(layout.replace("-inside", ""), model, names, torch.randn(2, 5, 16))
    if layout == "autocast-inside":  # e.g. a compiled training step that enters autocast itself
        model, context = _AutocastInside(model), contextlib.nullcontext
    torch._dynamo.reset()
    try:
        with context():
            explained = torch._dynamo.explain(model)(x)
            reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
            assert explained.graph_break_count == 0, reasons
            assert explained.graph_count == 1
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            out, grads = _run(compiled, x)
            ref_out, ref_grads = _run(model, x)
    finally:
        torch._dynamo.reset()
    assert out.dtype == ref_out.dtype == (torch.bfloat16 if layout == "true-half" else torch.float32)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    assert all(not fp32_guard_of(m)._open for m in model.modules() if fp32_guard_of(m) is not None)
    assert torch.get_default_dtype() is torch.float32 and not torch.is_autocast_enabled("cpu")


@pytest.mark.slow
def test_compiled_fp32_functions_add_no_graph_breaks():
    def fn(x, w, b):
        with fp32_region():
            total = x.float().sum(-1, keepdim=True)
        return fp32_softmax(x, -1) + fp32_log_softmax(x, -1) + fp32_layer_norm(x, 16, w, b) + total.to(x.dtype)

    def fn_autocast(x, w, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(x, w, b)

    x, w, b = torch.randn(4, 16).bfloat16(), torch.randn(16), torch.randn(16)
    for autocast, f in ((False, fn), (True, fn), (False, fn_autocast)):
        torch._dynamo.reset()
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                explained = torch._dynamo.explain(f)(x, w, b)
                reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
                assert explained.graph_break_count == 0, reasons
                got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b)
                expected = f(x, w, b)
                assert torch.is_autocast_enabled("cpu") is autocast
        finally:
            torch._dynamo.reset()
        assert got.dtype == expected.dtype == (torch.float32 if autocast or f is fn_autocast else torch.bfloat16)
        assert torch.equal(got, expected)


class _Router(nn.Module):
    """A guarded Linear (a MoE router); ``breaks``: its own code breaks the graph, as data-dependent routing does."""

    def __init__(self, log: list, breaks: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.log = log
        self.breaks = breaks

    def forward(self, x):
        h = self.lin(x)
        if self.breaks:
            torch._dynamo.graph_break()
            self.log.append((torch.is_autocast_enabled("cpu"), h.dtype))
        else:
            self.log.append((False, h.dtype))
        return self.lin(h)


@pytest.mark.slow
@pytest.mark.parametrize("inside", [False, True], ids=["autocast", "autocast-inside"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("breaks", [True, False], ids=["graph-break", "one-graph"])
def test_a_guarded_linear_runs_in_fp32_under_torch_compile(backend, inside, breaks):
    """Autocast is off in a guarded module's forward, in one graph and where its own code breaks the graph."""
    log = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Router(log, breaks), nn.Linear(8, 8))
    apply_fp32_guards(model, ["_Router"])
    outputs = []
    model[1].register_forward_hook(lambda m, a, out: outputs.append(out))
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inside):
            run = _AutocastInside(model) if inside else model
            got = torch.compile(run, backend=backend, fullgraph=not breaks)(x)
            expected = run(x)
            assert torch.is_autocast_enabled("cpu") is not inside
    finally:
        torch._dynamo.reset()
    assert log == [(False, torch.float32)] * 2  # compiled and eager: the router in fp32, autocast off
    assert outputs[0].dtype is outputs[1].dtype is torch.float32 and torch.equal(outputs[0], outputs[1])
    assert torch.equal(got, expected)
    assert not fp32_guard_of(model[1])._open
