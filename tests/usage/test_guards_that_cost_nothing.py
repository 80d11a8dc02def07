"""The default FP32 guards where they would change nothing: they are not there, or cost no Python around torch.

What a user of a Llama-style model expects: an RMSNorm that upcasts inside (``x.float()`` first, ``.to(dtype)``
last: LitGPT's, Hugging Face's Llama, torch's ``nn.RMSNorm``) already computes in fp32, so the plugin does not wrap
it in a guard in any mode; the model trains as it would under Lightning's own plugin of the mode (true-half: its
weight is half like every other weight). An RMSNorm written in the input's dtype is still guarded, and one the user
names in ``fp32_modules`` is guarded as asked. A plain ``nn.LayerNorm``'s guard (kept in ``master_weights="none"``
and ``fp16-true``) has no hooks on the module, no Python node in backward, and computes what the fp32 region does.
The same under Fabric, on LitGPT's own Llama-style model.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MPFabricPrecision, MPPlugin
from lightning_mp.guards import fp32_guard_of
from tests.usage.conftest import opt_plugin, opt_trainer

GF_WIDTH, GF_STEPS = 16, 8
GF_HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}
#: (mode, master_weights); bf16 and fp16 are autocast modes on the CPU (guards hooked there too)
GF_MODES = (("bf16", None), ("fp16", None), ("bf16-true", "fp32"), ("bf16-true", "none"), ("fp16-true", "fp32"),
            ("fp16-true", "none"))


class LitGPTRMSNorm(nn.Module):
    """LitGPT's RMSNorm (litgpt.model.RMSNorm), as written there."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.dim = eps, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * self.weight.float()).to(dtype=dtype)


class LlamaRMSNorm(nn.Module):
    """Hugging Face's Llama RMSNorm: fp32 statistics, the gain applied in the input's dtype."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HalfRMSNorm(nn.Module):
    """An RMSNorm written in the input's dtype (fp16 overflows above |x| ~ 256): the guard's case."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class GfNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(GF_WIDTH, GF_WIDTH)
        self.lit_norm = LitGPTRMSNorm(GF_WIDTH)
        self.llama_norm = LlamaRMSNorm(GF_WIDTH)
        self.torch_norm = nn.RMSNorm(GF_WIDTH)
        self.half_norm = HalfRMSNorm(GF_WIDTH)
        self.ln = nn.LayerNorm(GF_WIDTH)
        self.out = nn.Linear(GF_WIDTH, 1)
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(8, GF_WIDTH, generator=g), torch.randn(8, 1, generator=g))
        self.data = [batch] * GF_STEPS  # one batch again and again: the loss goes down
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.lit_norm(h) + self.llama_norm(h) + self.torch_norm(h)
        return self.out(self.ln(self.half_norm(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x.to(self.inp.weight.dtype)).float(), y.float())  # (true-half: y came in half)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # (not Adam: its eps underflows in fp16 weights without masters, a NaN under Lightning's 16-true too)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=None)


class GfWatch(Callback):
    """During fit: which modules are guarded, their weights' dtypes, the hooks on the LayerNorm."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx:
            return
        for name in ("lit_norm", "llama_norm", "torch_norm", "half_norm", "ln"):
            sub = getattr(pl_module, name)
            self.seen[name] = (fp32_guard_of(sub) is not None, sub.weight.dtype)
        self.seen["ln hooks"] = len(pl_module.ln._forward_pre_hooks) + len(pl_module.ln._forward_hooks)


def gf_fit(mode: str, masters, **kwargs) -> tuple[GfNet, GfWatch]:
    model, watch = GfNet(), GfWatch()
    if masters is not None:
        kwargs["master_weights"] = masters
    opt_trainer(opt_plugin(mode, **kwargs), max_steps=GF_STEPS, callbacks=[watch]).fit(model)
    return model, watch


@pytest.mark.parametrize(("mode", "masters"), GF_MODES)
def test_upcasting_rmsnorms_are_not_guarded_in_any_mode(mode: str, masters) -> None:
    model, watch = gf_fit(mode, masters)
    weight_dtype = GF_HALF.get(mode, torch.float32)
    for name in ("lit_norm", "llama_norm", "torch_norm"):
        # not guarded: true-half trains its weight in the half dtype like every other one (fp32 masters keep it)
        assert watch.seen[name] == (False, weight_dtype), (name, watch.seen[name])
    assert watch.seen["half_norm"] == (True, torch.float32), watch.seen["half_norm"]  # computes in 16 bits: guarded
    assert all(math.isfinite(v) for v in model.losses) and model.losses[-1] < model.losses[0], model.losses


@pytest.mark.parametrize("mode", ("bf16-true", "bf16"))
def test_an_upcasting_rmsnorm_named_in_fp32_modules_is_guarded_as_asked(mode: str) -> None:
    _, watch = gf_fit(mode, None, fp32_modules=["defaults", "lit_norm", LlamaRMSNorm])
    assert watch.seen["lit_norm"][0] and watch.seen["llama_norm"][0]
    assert not watch.seen["torch_norm"][0]  # the defaults alone picked it
    if mode == "bf16-true":
        assert watch.seen["lit_norm"][1] is torch.float32 and watch.seen["torch_norm"][1] is torch.bfloat16


@pytest.mark.parametrize(("mode", "masters"), (("bf16-true", "none"), ("fp16-true", "none"), ("fp16-true", "fp32")))
def test_a_guarded_layernorm_has_no_hooks_and_no_python_in_backward(mode: str, masters) -> None:
    _, watch = gf_fit(mode, masters)
    assert watch.seen["ln"] == (True, torch.float32) and watch.seen["ln hooks"] == 0

    # the guarded LayerNorm as the run leaves it during fit: what it computes, and the nodes of its backward
    half = GF_HALF[mode]
    plugin = MPPlugin(mode, master_weights=masters)
    ln = nn.LayerNorm(GF_WIDTH)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    wrapper = nn.Sequential(ln)
    converted = plugin.convert_module(wrapper)
    norm = converted[0]
    assert fp32_guard_of(norm) is not None and norm.weight.dtype is torch.float32
    x = (torch.randn(4, GF_WIDTH, generator=torch.Generator().manual_seed(2)) * 3).to(half).requires_grad_(True)
    with plugin.forward_context():
        out = norm(x)
    assert out.dtype is half
    reference = F.layer_norm(x.float(), (GF_WIDTH,), norm.weight, norm.bias, norm.eps).to(half)
    assert torch.equal(out, reference)
    nodes, todo = [], [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            nodes.append(node)
            todo.extend(n for n, _ in node.next_functions)
    python = [type(n).__name__ for n in nodes if isinstance(n, torch.autograd.function.BackwardCFunction)]
    assert not python, f"Python in the guarded LayerNorm's backward: {python}"
    grads = torch.autograd.grad(out, (x, norm.weight, norm.bias), torch.ones_like(out))
    expected = torch.autograd.grad(reference, (x, norm.weight, norm.bias), torch.ones_like(reference))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_litgpt_llama_under_fabric_has_no_guards_and_half_norm_weights() -> None:
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config.from_name(
        "tiny-llama-1.1b", n_layer=1, n_embd=32, n_head=2, n_query_groups=2, intermediate_size=64,
        padded_vocab_size=64, block_size=16,
    )
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MPFabricPrecision("bf16-true", master_weights="none")])
    with fabric.init_module():
        model = litgpt.GPT(config)
    model = fabric.setup_module(model)
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert norms and all(fp32_guard_of(m) is None and m.weight.dtype is torch.bfloat16 for m in norms)
    loss = model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean()
    fabric.backward(loss)
    assert all(m.weight.grad is not None and torch.isfinite(m.weight.grad).all() for m in norms)
