"""FP8 through torchao's float8 on a GPU, through the real Trainer: the three recipes (tensorwise, rowwise,
rowwise_with_gw_hp) train as bf16 does, a poisoned batch is skipped, validation runs in bf16, checkpoints keep the
plain model's keys.

Skipped unless CUDA, compute capability >= 8.9 and ``torchao`` are present. Run on the GPU machine (the torchao
wheel for it is downloaded into ``.whl/``)::

    pip install --no-deps .whl/torchao-0.18.0-*.whl
    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_fp8_torchao_gpu.py

Every training test goes through ``MPPlugin("fp8", fp8={"backend": "torchao", "recipe": ...})``, as a user would.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mp import MPPlugin

_HAS_AO = importlib.util.find_spec("torchao") is not None
_CC = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _CC >= (8, 9) and _HAS_AO),
        reason="needs torchao and a GPU with compute capability >= 8.9 (run on the GPU machine)",
    ),
]
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


# --------------------------------------------------------------------------------------------- model and data
class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, hidden: int = 256, layers: int = 2, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def bigram_batches(n: int, batch: int = 16, seq: int = 128, vocab: int = 512, seed: int = 0) -> list[torch.Tensor]:
    """Token streams from a fixed random bigram chain (4 successors per token, entropy ~1.03 nats): learnable."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    rows = n * batch
    choice = torch.multinomial(probs, rows * (seq + 1), replacement=True, generator=g).view(rows, seq + 1)
    tokens = torch.empty(rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(1, seq + 1):
        tokens[:, t] = succ[tokens[:, t - 1], choice[:, t]]
    return list(tokens.view(n, batch, seq + 1).unbind(0))


class LitGPT(LightningModule):
    def __init__(self, batches: list[torch.Tensor], val_batches=(), poison_step: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT()
        self.batches, self.val_batches = batches, list(val_batches)
        self.poison_step = poison_step
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.poison_step:  # an inf reaches the first FP8 layer's input, in this step only
            token = int(batch[0, 0])
            self._kept = (token, self.model.tok.weight[token].detach().clone())
            with torch.no_grad():
                self.model.tok.weight[token] = float("inf")
        elif self.poison_step is not None and batch_idx == self.poison_step + 1:
            token, row = self._kept
            with torch.no_grad():
                self.model.tok.weight[token] = row
        loss = self.model(batch)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.0, fused=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None, shuffle=False)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_batches, batch_size=None, shuffle=False)


def fit(plugin: MPPlugin, steps: int, module: Optional[LitGPT] = None, callbacks=(), **kwargs: Any) -> LitGPT:
    module = module if module is not None else LitGPT(bigram_batches(steps))
    options: dict[str, Any] = dict(
        accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    Trainer(plugins=[plugin], callbacks=list(callbacks), **options).fit(module)
    return module


def torchao_plugin(recipe: str, **fp8: Any) -> MPPlugin:
    return MPPlugin("fp8", fp8={"backend": "torchao", "recipe": recipe, "size_rule": "off", **fp8})


def backend_of(plugin: MPPlugin) -> Any:
    """The plugin's FP8 backend (a ``TorchAOFloat8`` here)."""
    return plugin._fp8  # type: ignore[attr-defined]


def tail_loss(module: LitGPT, n: int = 20) -> float:
    return torch.stack(module.losses[-n:]).mean().item()


# --------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("recipe", RECIPES)
def test_check_passes_and_the_probe_runs(recipe):
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8, scaled_mm_probe

    assert scaled_mm_probe(torch.device("cuda"), recipe) is None
    TorchAOFloat8({"backend": "torchao", "recipe": recipe}).check("cuda")


@pytest.mark.parametrize("recipe", RECIPES)
def test_trains_as_bf16_does(recipe):
    """200 steps of a 2-layer GPT: the FP8 run's last losses are within 3 % of bf16's; every linear but the head is
    a compiled Float8Linear; no step skipped; the model's state dict has the plain GPT's keys."""
    steps = 200
    reference = fit(MPPlugin("bf16"), steps)
    plugin = torchao_plugin(recipe)
    module = fit(plugin, steps)
    fp8 = backend_of(plugin)
    assert fp8 is not None and fp8.name == "torchao"
    layers = fp8.layers
    assert sorted(layers) == sorted(f"model.blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "fc1", "fc2"))
    assert type(module.model.head) is nn.Linear and fp8.report.compiled is True
    assert plugin.stats.skipped_steps == 0
    ours, theirs = tail_loss(module), tail_loss(reference)
    assert theirs < 2.0, theirs  # (bf16 learnt the bigrams: from ~6.2 to about their entropy)
    assert abs(ours - theirs) < 0.03 * theirs, (ours, theirs)
    assert list(module.model.state_dict()) == list(GPT().state_dict())
    state = fp8.state_dict()
    assert state["backend"] == "torchao" and state["recipe"]["recipe"] == recipe
    assert state["recipe"]["grad_weight_gemm"] == ("high" if recipe == "rowwise_with_gw_hp" else "fp8")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_poisoned_step_is_skipped(recipe):
    """An inf reaching an FP8 layer's input: the sentinel's flag joins the step's verdict; the step is skipped and
    the weights stay finite."""
    steps = 12
    module = LitGPT(bigram_batches(steps), poison_step=5)
    plugin = torchao_plugin(recipe, weights="fp32")
    fit(plugin, steps, module)
    assert plugin.stats.skipped_steps == 1
    assert all(torch.isfinite(p).all().item() for p in module.model.parameters())
    assert math.isfinite(module.losses[-1].item())


def test_validation_runs_bf16_by_default():
    """fp8_in_eval=False: inside validation the FP8 layers compute F.linear in bf16; in training, FP8."""
    seen: list[tuple[bool, bool]] = []  # (training, FP8 on) at each forward of one FP8 layer

    class Spy(Callback):
        def on_train_start(self, trainer, pl_module):
            fp8 = backend_of(trainer.precision_plugin)
            layer = fp8.layers["model.blocks.0.fc1"]
            layer.register_forward_pre_hook(lambda m, args: seen.append((m.training, fp8._route.fp8)))

    batches = bigram_batches(6)
    module = LitGPT(batches[:4], val_batches=batches[4:])
    fit(torchao_plugin("tensorwise"), 4, module, callbacks=[Spy()], limit_val_batches=2, val_check_interval=2)
    assert {on for training, on in seen if training} == {True}
    assert {on for training, on in seen if not training} == {False}
    assert math.isfinite(module.trainer.callback_metrics["val_loss"].item())


def test_fp8_weights_on_one_gpu_are_refused():
    with pytest.raises(MisconfigurationException, match=r"FSDP2's float8 all-gather"):
        fit(torchao_plugin("tensorwise", weights="fp8"), 2)
