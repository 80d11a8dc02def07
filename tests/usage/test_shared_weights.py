"""Weights shared between FP32-guarded and unguarded modules in true-half modes (``bf16-true``, ``fp16-true``).

What an experienced user expects of a language model whose LM head is tied to the embedding
(``self.head.weight = self.emb.weight``) and named in ``fp32_modules``: it trains; the head computes in fp32; the
embedding still hands the residual stream half activations; after ``fit`` the module is what Lightning's own
``precision="bf16-true"``/``"16-true"`` leaves (half weights, the tie kept). The same for a weight shared by two
Linear layers of which one is guarded, a guarded LayerNorm sharing its weight with an unguarded module, one
LayerNorm object held under two names, and modules the user guarded with ``apply_fp32_guards`` before ``fit``;
with every kind of master weights. A step whose gradients hold an inf changes nothing.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import apply_fp32_guards
from tests.usage.conftest import opt_assert_nested_equal, opt_plugin, opt_trainer

SW_HALF = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}
SW_LIGHTNING = {"bf16-true": "bf16-true", "fp16-true": "16-true"}
SW_KINDS = ("fp32", "kahan", "stochastic", "none")
SW_VOCAB, SW_WIDTH = 16, 8
SW_STEPS, SW_POISONED = 14, 5  # the batch (of the first epoch) whose loss is multiplied by inf


class SwLayerNormWatch(TorchDispatchMode):
    """Records the dtype layer_norm computes in: its input's, or, for torch's kernel on a 16-bit input with fp32
    weights (the guard's fast path leaves the input as it is), fp32."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_layer_norm.default:
            x, weight = args[0], args[2]
            self.log.append(x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype))
        return func(*args, **(kwargs or {}))


class SwGuardedLinear(nn.Linear):
    """A Linear class of its own, guarded by its type (``fp32_modules=[SwGuardedLinear]``)."""


class SwScale(nn.Module):
    """An elementwise gain (not a norm: unguarded), ``x * weight``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class SwNet(LightningModule):
    """Tokens -> embedding -> residual blocks -> LM head -> cross-entropy, with what ``variant`` shares.

    * ``tied_head``: ``head.weight = emb.weight``, the head guarded by name;
    * ``shared_linear`` / ``shared_linear_type``: ``fc2.weight = fc.weight``, ``fc2`` guarded by name / by type;
    * ``norm_shares_weight``: a guarded LayerNorm whose weight an unguarded gain (``SwScale``) holds too;
    * ``norm_twice``: one LayerNorm object held as ``norm`` and ``norm_b``, called twice, guarded by its second name;
    * ``user_guards``: the untied head guarded with ``apply_fp32_guards`` before ``fit`` (the plugin's defaults);
    * ``user_guards_tied``: the same with the head tied to the embedding.

    Records the residual stream's dtypes (forward hooks on the unguarded modules) and the dtype the guarded module
    computes in (its own forward pre-hook runs inside the guard).
    """

    def __init__(self, variant: str, poison: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.variant, self.poison = variant, poison
        self.emb = nn.Embedding(SW_VOCAB, SW_WIDTH)
        self.norm = nn.LayerNorm(SW_WIDTH)
        self.fc = nn.Linear(SW_WIDTH, SW_WIDTH)
        self.fc2 = (SwGuardedLinear if variant == "shared_linear_type" else nn.Linear)(SW_WIDTH, SW_WIDTH)
        self.scale = SwScale(SW_WIDTH)
        self.head = nn.Linear(SW_WIDTH, SW_VOCAB, bias=False)
        self.criterion = nn.CrossEntropyLoss()
        if variant in ("tied_head", "user_guards_tied"):
            self.head.weight = self.emb.weight
        if variant.startswith("shared_linear"):
            self.fc2.weight = self.fc.weight
        if variant == "norm_shares_weight":
            self.scale.weight = self.norm.weight
        if variant == "norm_twice":
            self.norm_b = self.norm
        if variant.startswith("user_guards"):
            apply_fp32_guards(self, ["head"])
        self.residual: list[torch.dtype] = []  # the residual stream (outputs of the unguarded modules)
        self.inside: list[torch.dtype] = []  # the guarded module's input, as its forward sees it
        self.losses: list[float] = []
        for unguarded in (self.emb, self.fc, self.scale):
            unguarded.register_forward_hook(lambda m, a, out: self.residual.append(out.dtype))
        if isinstance(self.guarded, nn.LayerNorm):
            # a plain LayerNorm's guard works inside its forward (no hooks): watch the kernel that computes it
            self.guarded.register_forward_pre_hook(lambda m, a: None if self._watch.__enter__() else None)
            self.guarded.register_forward_hook(lambda m, a, out: self._watch.__exit__(None, None, None))
        else:
            self.guarded.register_forward_pre_hook(self._record_inside)

    @property
    def _watch(self) -> "SwLayerNormWatch":
        if "_sw_watch" not in self.__dict__:
            self.__dict__["_sw_watch"] = SwLayerNormWatch(self.inside)
        return self.__dict__["_sw_watch"]

    def _record_inside(self, module: nn.Module, args: tuple) -> None:
        # fp32 inputs: the guard upcast them
        self.inside.append(torch.promote_types(args[0].dtype, module.weight.dtype))

    @property
    def guarded(self) -> nn.Module:
        """The module this variant guards (and watches)."""
        return {"shared_linear": self.fc2, "shared_linear_type": self.fc2, "norm_shares_weight": self.norm,
                "norm_twice": self.norm}.get(self.variant, self.head)  # fmt: skip

    @property
    def fp32_modules(self) -> Any:
        """The plugin's ``fp32_modules`` for this variant (explicit lists keep the plain LayerNorm guard)."""
        return {"tied_head": ["defaults", "head"], "shared_linear": ["defaults", "fc2"],
                "shared_linear_type": ["defaults", SwGuardedLinear], "norm_shares_weight": ["defaults"],
                "norm_twice": ["norm_b", "CrossEntropyLoss"]}.get(self.variant)  # fmt: skip

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.fc(self.norm(h))
        h = h + self.fc2(h)
        h = self.scale(h)
        if self.variant == "norm_twice":
            h = self.norm_b(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        loss = self.criterion(self(tokens), target)
        self.losses.append(float(loss.detach()))
        if self.poison and self.current_epoch == 0 and batch_idx == SW_POISONED:
            loss = loss * math.inf
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # eps=1e-4: Adam's default 1e-8 is 0 in an fp16 optimizer state (fp16-true without masters, Lightning's 16-true)
        return torch.optim.Adam(self.parameters(), lr=0.05, eps=1e-4)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.arange(SW_VOCAB).repeat(4)
        return DataLoader(TensorDataset(tokens, (3 * tokens + 1) % SW_VOCAB), batch_size=8)


SW_VARIANTS = ("tied_head", "shared_linear", "shared_linear_type", "norm_shares_weight", "norm_twice",
               "user_guards", "user_guards_tied")  # fmt: skip


class SwPoisonWatch(Callback):
    """What the poisoned batch's step leaves: weights, buffers, optimizer state and master weights, before and after."""

    def __init__(self) -> None:
        self.before: dict = {}
        self.after: dict = {}

    @staticmethod
    def snapshot(trainer: Any, module: SwNet) -> dict:
        masters = trainer.precision_plugin.masters
        return {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "masters": copy.deepcopy(masters.state_dict()) if masters is not None else {},
        }

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.current_epoch == 0 and batch_idx == SW_POISONED:
            self.before = self.snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.current_epoch == 0 and batch_idx == SW_POISONED:
            self.after = self.snapshot(trainer, pl_module)


def sw_fit(variant: str, mode: str, kind: str) -> tuple[SwNet, Any, SwPoisonWatch]:
    model = SwNet(variant)
    plugin = opt_plugin(mode, master_weights=kind, fp32_modules=model.fp32_modules)
    watch = SwPoisonWatch()
    opt_trainer(plugin, max_steps=SW_STEPS, callbacks=[watch]).fit(model)
    return model, plugin, watch


@pytest.mark.slow
@pytest.mark.parametrize("kind", SW_KINDS)
@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
@pytest.mark.parametrize("variant", SW_VARIANTS)
def test_shared_weights_train_in_the_half_dtype(variant: str, mode: str, kind: str) -> None:
    """The run trains, the residual stream is half, the guarded module computes in fp32, the poisoned step changes
    nothing, and the module after ``fit`` is half with its ties kept."""
    half = SW_HALF[mode]
    model, plugin, watch = sw_fit(variant, mode, kind)

    assert set(model.residual) == {half}, f"the residual stream left {half}: {set(model.residual)}"
    assert set(model.inside) == {torch.float32}, f"the guarded module computed in {set(model.inside)}"
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == SW_STEPS
    opt_assert_nested_equal(watch.before, watch.after, "poisoned step")
    clean = [v for i, v in enumerate(model.losses) if i != SW_POISONED]
    assert all(math.isfinite(v) for v in clean), model.losses
    assert sum(clean[-3:]) / 3 < 0.7 * sum(clean[:3]) / 3, model.losses

    # after fit: as Lightning's plugin leaves it, every floating tensor half, the shared ones still shared
    floating = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    assert {t.dtype for t in floating} == {half}
    if variant in ("tied_head", "user_guards_tied"):
        assert model.head.weight is model.emb.weight
    if variant.startswith("shared_linear"):
        assert model.fc2.weight is model.fc.weight
    if variant == "norm_shares_weight":
        assert model.scale.weight is model.norm.weight
    if variant == "norm_twice":
        assert model.norm_b is model.norm


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
@pytest.mark.parametrize("variant", SW_VARIANTS)
def test_shared_weights_leave_the_module_as_lightning_does(variant: str, mode: str) -> None:
    """Dtypes and ties after ``fit`` against the same model under Lightning's own ``bf16-true``/``16-true``; the
    module then runs forward in its dtype, as the Lightning-trained one does."""
    ours = SwNet(variant, poison=False)
    opt_trainer(opt_plugin(mode, fp32_modules=ours.fp32_modules), max_steps=4).fit(ours)
    theirs = SwNet(variant, poison=False)
    opt_trainer(precision=SW_LIGHTNING[mode], max_steps=4).fit(theirs)

    def layout(module: SwNet) -> dict:
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        owners = {id(t): name for name, t in reversed(list(tensors.items()))}  # the first name holding each tensor
        return {name: (t.dtype, owners[id(t)]) for name, t in tensors.items()}

    assert layout(ours) == layout(theirs)
    tokens = torch.arange(SW_VOCAB)
    for module in (ours, theirs):
        module.eval()
        with torch.no_grad():
            logits = module(tokens)
            assert logits.dtype == SW_HALF[mode]
            assert module.criterion(logits, tokens).isfinite()


@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
def test_tied_head_computes_with_the_half_weight_in_fp32(mode: str) -> None:
    """The guarded head's logits are the fp32 product of its fp32 input and the half weight, rounded once; the
    embedding's output is the half weight's rows (no fp32 stand-in leaks out of the head)."""
    half = SW_HALF[mode]
    model = SwNet("tied_head", poison=False)
    seen: dict = {}

    def first_call(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, (args[0], out))

        return hook

    model.emb.register_forward_hook(first_call("emb"))
    model.head.register_forward_hook(first_call("head"))
    opt_trainer(opt_plugin(mode, fp32_modules=model.fp32_modules), max_steps=1).fit(model)
    tokens, emb_out = seen["emb"]
    head_in, head_out = seen["head"]
    assert emb_out.dtype == half and head_out.dtype == half and head_in.dtype == torch.float32
    weight0 = SwNet("tied_head", poison=False).emb.weight.detach().to(half)  # the weight of that first step
    assert torch.equal(emb_out, weight0[tokens])
    assert torch.equal(head_out, F.linear(head_in, weight0.float()).to(half))


class SwCompiledLM(LightningModule):
    """The tied embedding and guarded LM head inside a module compiled in ``__init__`` (backend "eager": dynamo
    traces the guards as with inductor, without minutes of C++ compiling)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        lm = nn.ModuleDict({"emb": nn.Embedding(SW_VOCAB, SW_WIDTH), "fc": nn.Linear(SW_WIDTH, SW_WIDTH),
                            "head": nn.Linear(SW_WIDTH, SW_VOCAB, bias=False)})  # fmt: skip
        lm["head"].weight = lm["emb"].weight
        self.lm = lm
        self.body = torch.compile(self.run_lm, backend="eager")
        self.residual: list[torch.dtype] = []
        self.losses: list[float] = []

    def run_lm(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.lm["emb"](tokens)
        h = h + self.lm["fc"](h)
        return self.lm["head"](h), h.dtype

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        logits, residual = self.body(tokens)
        self.residual.append(residual)
        loss = F.cross_entropy(logits.float(), target)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05, eps=1e-4)

    def train_dataloader(self) -> DataLoader:
        tokens = torch.arange(SW_VOCAB).repeat(4)
        return DataLoader(TensorDataset(tokens, (3 * tokens + 1) % SW_VOCAB), batch_size=8)


@pytest.mark.parametrize("mode", ("bf16-true", "fp16-true"))
def test_tied_head_under_torch_compile(mode: str) -> None:
    """Under ``torch.compile`` the guarded head's half weight is upcast for its call too (in the graph)."""
    torch._dynamo.reset()
    model = SwCompiledLM()
    opt_trainer(opt_plugin(mode, fp32_modules=["defaults", "head"]), max_steps=10).fit(model)
    assert set(model.residual) == {SW_HALF[mode]}
    assert all(math.isfinite(v) for v in model.losses)
    assert sum(model.losses[-3:]) / 3 < 0.7 * sum(model.losses[:3]) / 3, model.losses
    assert model.lm["head"].weight is model.lm["emb"].weight and model.lm["emb"].weight.dtype == SW_HALF[mode]
