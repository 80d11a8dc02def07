"""FP8 through the real Transformer Engine on a GPU: recipes, the swap, 300 training steps, resume, accumulation.

Skipped unless CUDA, compute capability >= 8.9 and ``transformer_engine`` are present. Run on the GPU machine::

    source .te/te_install.sh && PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_fp8_te.py

Imports only torch, lightning, Transformer Engine and lightning_mp (the GPU machine has no jsonargparse).
The training tests go through ``MPPlugin("fp8", fp8={...})``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp.fp8 import (
    FP8Config,
    FP8Training,
    FP8UnavailableError,
    build_recipe,
    check_fp8_support,
    convert_to_te,
    fp8_scaling_state,
)
from lightning_mp.fp8.config import RECIPE_CLASSES

_HAS_TE = importlib.util.find_spec("transformer_engine") is not None
_CC = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fp8,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _CC >= (8, 9) and _HAS_TE),
        reason="needs Transformer Engine and a GPU with compute capability >= 8.9 (run on the GPU machine)",
    ),
]


# --------------------------------------------------------------------------------------------- the plugin
def make_fp8_plugin(fp8: Optional[dict] = None, **kwargs: Any) -> MPPlugin:
    return MPPlugin("fp8", fp8=fp8 or {}, **kwargs)


def fp8_of(plugin: MPPlugin) -> FP8Training:
    return plugin._fp8  # type: ignore[attr-defined]


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
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
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


def bigram_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
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
    def __init__(self, batches: list[torch.Tensor], lr: float = 1e-3, warmup: int = 20, val_batches=(), **model_args):
        super().__init__()
        self.model = GPT(**model_args)
        self.batches, self.val_batches = batches, list(val_batches)
        self.lr, self.warmup = lr, warmup
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        # by the restored global batch index: a resumed run sees exactly the batches of an uninterrupted one
        # (Lightning restarts a plain DataLoader on resume)
        index = self.trainer.fit_loop.epoch_loop.total_batch_idx % len(self.batches)
        batch = self.batches[index].to(self.device, non_blocking=True)
        loss = self.model(batch)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None, shuffle=False)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_batches, batch_size=None, shuffle=False)


def trainer_for(plugin: Optional[MPPlugin], max_steps: int, callbacks=(), **kwargs) -> Trainer:
    options = dict(
        accelerator="gpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(plugins=[plugin] if plugin is not None else None, callbacks=list(callbacks), **options)


def te_linears(model: nn.Module) -> dict[str, nn.Module]:
    import transformer_engine.pytorch as te

    return {name: m for name, m in model.named_modules() if isinstance(m, te.Linear)}


# --------------------------------------------------------------------------------------------- recipes
def _expected_available(recipe: str) -> bool:
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return {
        "delayed": True,
        "current": True,
        "block": _CC >= (9, 0) and cuda >= (12, 9),
        "mxfp8": (10, 0) <= _CC < (12, 0),
    }[recipe]


@pytest.mark.parametrize("recipe", ["delayed", "current", "block", "mxfp8"])
def test_recipe_on_this_gpu(recipe):
    """On Hopper: delayed, current and block run one FP8 step; mxfp8 fails with a message naming Blackwell."""
    if not _expected_available(recipe):
        with pytest.raises(FP8UnavailableError, match=r"recipe='mxfp8'.*Blackwell" if recipe == "mxfp8" else recipe):
            check_fp8_support("cuda", recipe)
        return
    check_fp8_support("cuda", recipe)
    config = FP8Config(recipe=recipe, size_rule="off", keep_last=0)
    assert type(build_recipe(config)).__name__ == RECIPE_CLASSES[recipe]
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.LayerNorm(512), nn.Linear(512, 256)).cuda()
    fp8 = FP8Training(config)
    report = fp8.convert(model, device="cuda")
    assert report.count("Linear") == 2 and report.count("LayerNorm") == 1
    x = torch.randn(256, 256, device="cuda")
    with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
        y = model(x)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    linear = model[0]
    assert linear.fp8 and torch.isfinite(linear.weight.grad).all()
    assert type(linear.fp8_meta["recipe"]).__name__ == type(fp8.recipe).__name__


# --------------------------------------------------------------------------------------------- the swap
def _small_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    args = dict(vocab=512, hidden=256, layers=2, heads=4, seq=128)
    args.update(kw)
    return GPT(**args).cuda()


def test_swap_keeps_weights_and_outputs_with_fp8_off():
    original = _small_gpt()
    original.blocks[0].adapter = nn.Linear(256, 24).cuda()  # a shape TE cannot run: reported, kept
    model = copy.deepcopy(original)
    fp8 = FP8Training({"size_rule": "off"})
    report = fp8.convert(model, device="cuda")

    skipped = {r.fqn: r.reason for r in report.skipped}
    assert set(skipped) == {"head", "blocks.0.adapter"}, skipped
    assert "keep_last=1" in skipped["head"] and "divisible by 16" in skipped["blocks.0.adapter"]
    assert report.count("Linear") == 8 and report.count("LayerNorm") == 5
    assert 0.5 < report.linear_flop_share < 1.0
    te_mods = te_linears(model)
    assert len(te_mods) == 8
    for name, module in te_mods.items():
        assert torch.equal(module.weight, original.get_submodule(name).weight)  # exact copy, fp32
        assert module.weight.dtype == torch.float32

    tokens = torch.randint(0, 512, (4, 129), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):  # FP8 off: TE modules compute in bf16
        expected = original(tokens)
        got = model(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    got.backward()
    expected.backward()
    for name in ("blocks.0.qkv", "blocks.1.fc2"):
        a, b = model.get_submodule(name).weight.grad, original.get_submodule(name).weight.grad
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99

    # in FP8 the loss stays close to bf16, once delayed scaling has seen a few amaxes (it starts from scale 1)
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
            model(tokens)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16), fp8.autocast(training=True):
        fp8_loss = model(tokens)
    assert abs(fp8_loss.item() - expected.item()) / expected.item() < 0.02
    assert all(m.fp8 for m in te_mods.values())

    # checkpoint keys: the torch model's, loadable both ways, weights_only-safe
    state = model.state_dict()
    assert not any(k.endswith("_extra_state") for k in state)
    plain = _small_gpt()
    plain.blocks[0].adapter = nn.Linear(256, 24).cuda()
    plain.load_state_dict(state)
    model.load_state_dict(plain.state_dict())


def test_tied_head_is_kept_and_bf16_weights():
    model = _small_gpt()
    model.head.weight = model.tok.weight
    report = convert_to_te(model, config=FP8Config(size_rule="off", keep_last=0, weights="bf16"))
    assert "tied weights" in {r.fqn: r.reason for r in report.skipped}["head"]
    assert model.head.weight is model.tok.weight
    assert all(m.weight.dtype == torch.bfloat16 for m in te_linears(model).values())


# --------------------------------------------------------------------------------------------- training
HIDDEN, LAYERS, HEADS, SEQ, BATCH, VOCAB = 1024, 4, 16, 512, 16, 4096  # 8192 tokens per step


def _fit(plugin: Optional[MPPlugin], steps: int, batches, seed: int = 0, callbacks=(), **trainer_kwargs):
    seed_everything(seed)
    module = LitGPT(batches, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS, seq=SEQ)
    trainer = trainer_for(plugin, steps, callbacks, **trainer_kwargs)
    start = time.perf_counter()
    trainer.fit(module)
    torch.cuda.synchronize()
    return module, trainer, time.perf_counter() - start


def test_300_steps_fp8_loss_within_2_percent_of_bf16():
    steps = 300
    batches = bigram_batches(steps, BATCH, SEQ, VOCAB)
    bf16, _, t_bf16 = _fit(MPPlugin("bf16"), steps, batches)
    plugin = make_fp8_plugin({"recipe": "delayed", "size_rule": "off"})
    fp8, trainer, t_fp8 = _fit(plugin, steps, batches)

    report = fp8_of(plugin).report
    assert report is not None and report.count("Linear") == 4 * LAYERS  # every block linear; the head stays bf16
    assert len(te_linears(fp8)) == 4 * LAYERS and all(m.fp8 for m in te_linears(fp8).values())
    assert trainer.precision == "transformer-engine"
    loss_bf16 = torch.stack(bf16.losses[-30:]).mean().item()
    loss_fp8 = torch.stack(fp8.losses[-30:]).mean().item()
    first = bf16.losses[0].item()
    print(
        f"\n[{type(plugin).__name__}] 300 steps, hidden {HIDDEN}: bf16 {t_bf16:.1f} s final {loss_bf16:.4f},"
        f" fp8 {t_fp8:.1f} s final {loss_fp8:.4f} (first {first:.3f}); {report.summary()}"
    )
    assert loss_bf16 < 0.5 * first, "the model did not learn: the comparison would mean nothing"
    assert abs(loss_fp8 - loss_bf16) / loss_bf16 <= 0.02


class _ReadFP8State(Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = fp8_scaling_state(pl_module)


def _small_fit(plugin, steps, batches, callbacks=(), ckpt_path=None, **kw):
    seed_everything(0)
    module = LitGPT(batches, vocab=512, hidden=256, layers=2, heads=4, seq=128, warmup=1)
    trainer = trainer_for(plugin, steps, callbacks, **kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def test_checkpoint_resume_restores_fp8_state(tmp_path):
    batches = bigram_batches(10, 8, 128, 512)  # one epoch = 10 steps: resuming at step 10 starts epoch 2 afresh
    cfg = {"recipe": "delayed", "amax_history_len": 16, "size_rule": "off"}
    whole, _ = _small_fit(make_fp8_plugin(cfg), 20, batches)

    first, trainer = _small_fit(make_fp8_plugin(cfg), 10, batches)
    path = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain tensors only: no pickle inside
    assert not any(k.endswith("_extra_state") for k in ckpt["state_dict"])
    plugin_key = type(trainer.precision_plugin).__qualname__
    saved = ckpt[plugin_key]["fp8"]
    assert saved["recipe"]["recipe"] == "delayed" and saved["recipe"]["amax_history_len"] == 16
    assert len(saved["modules"]) == 8
    entry = saved["modules"]["model.blocks.0.fc1"]
    assert entry["amax_history_fwd"].shape == (16, 3) and entry["amax_history_fwd"].abs().sum() > 0
    GPT(512, 256, 2, 4, 128).load_state_dict({k[len("model."):]: v for k, v in ckpt["state_dict"].items()})

    probe = _ReadFP8State()
    resumed, _ = _small_fit(make_fp8_plugin(cfg), 20, batches, callbacks=[probe], ckpt_path=path)
    assert set(probe.state) == set(saved["modules"])
    for name, saved_entry in saved["modules"].items():
        for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
            assert torch.equal(probe.state[name][key], saved_entry[key]), (name, key)
    after = torch.stack(resumed.losses).float().cpu()
    expected = torch.stack(whole.losses[10:]).float().cpu()
    torch.testing.assert_close(after, expected, rtol=1e-2, atol=1e-3)

    # another recipe on resume: said clearly, state dropped; another history length: said, state adapted
    with pytest.warns(UserWarning, match=r"written with recipe='delayed' and training resumes with recipe='current'"):
        _small_fit(make_fp8_plugin({"recipe": "current", "size_rule": "off"}), 11, batches, ckpt_path=path)
    probe = _ReadFP8State()
    with pytest.warns(UserWarning, match=r"amax_history_len 16 -> 8"):
        _small_fit(make_fp8_plugin(dict(cfg, amax_history_len=8)), 11, batches, callbacks=[probe], ckpt_path=path)
    assert torch.equal(probe.state["model.blocks.0.fc1"]["amax_history_fwd"], entry["amax_history_fwd"][:8])


class _RecordMicrobatchFlags(Callback):
    """A pre-hook registered after the plugin's sees the ``is_first_microbatch`` it passed."""

    def on_train_start(self, trainer, pl_module):
        self.flags: list = []
        module = pl_module.model.blocks[0].fc1
        module.register_forward_pre_hook(
            lambda m, a, kw: self.flags.append(kw.get("is_first_microbatch")), with_kwargs=True
        )


def test_gradient_accumulation_caches_fp8_weights():
    batches = bigram_batches(16, 8, 128, 512)
    cfg = {"recipe": "delayed", "size_rule": "off"}
    spy = _RecordMicrobatchFlags()
    cached, _ = _small_fit(make_fp8_plugin(cfg), 4, batches, callbacks=[spy], accumulate_grad_batches=4)
    assert spy.flags == [True, False, False, False] * 4
    spy_off = _RecordMicrobatchFlags()
    plain, _ = _small_fit(make_fp8_plugin(dict(cfg, cache_fp8_weights="never")), 4, batches, callbacks=[spy_off],
                          accumulate_grad_batches=4)
    assert spy_off.flags == [None] * 16
    torch.testing.assert_close(torch.stack(cached.losses), torch.stack(plain.losses), rtol=3e-2, atol=3e-2)


class _RecordFP8Use(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.train, self.val = [], []
        module = pl_module.model.blocks[0].fc1

        def hook(m, args, out):
            (self.train if trainer.training else self.val).append(m.fp8)

        module.register_forward_hook(hook)


@pytest.mark.parametrize("fp8_in_eval", [False, True])
def test_eval_precision_and_no_deprecation_warning(fp8_in_eval):
    batches = bigram_batches(4, 8, 128, 512)
    probe = _RecordFP8Use()
    seed_everything(0)
    module = LitGPT(batches, val_batches=batches[:2], vocab=512, hidden=256, layers=2, heads=4, seq=128)
    trainer = trainer_for(
        make_fp8_plugin({"size_rule": "off", "fp8_in_eval": fp8_in_eval}), 4, [probe], limit_val_batches=2,
        val_check_interval=2,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert probe.train and all(probe.train)
    assert probe.val and all(v is fp8_in_eval for v in probe.val)
    deprecations = [str(w.message) for w in caught if "fp8_autocast is deprecated" in str(w.message)]
    assert not deprecations, deprecations


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_weights_dtype_in_training(weights):
    batches = bigram_batches(4, 8, 128, 512)
    plugin = make_fp8_plugin({"size_rule": "off", "weights": weights})
    module, trainer = _small_fit(plugin, 4, batches)
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    assert all(m.weight.dtype == dtype for m in te_linears(module).values())
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert any(p.dtype == dtype for p in params)
    assert all(math.isfinite(loss.item()) for loss in module.losses)
