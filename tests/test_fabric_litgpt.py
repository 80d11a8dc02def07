"""MPFabricPrecision on a Fabric program nobody here wrote: LitGPT's pretraining loop (``litgpt.pretrain.fit``:
gradient accumulation through ``fabric.no_backward_sync``, ``fabric.clip_gradients``, its learning-rate schedule,
validation) on tiny LitGPT models, on the CPU.

Skipped where litgpt is not installed. It installs beside this package (``pip install litgpt``; the ``cli``
extra's jsonargparse >= 4.39 meets its <= 4.41 pin); ``make setup`` installs it without its dependencies, as
``.venv`` keeps the newest jsonargparse.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import HalfPrecision, MixedPrecision, Precision
from torch.utils.data import DataLoader

pytest.importorskip("litgpt")
from litgpt import GPT, Config  # noqa: E402
from litgpt.args import EvalArgs, TrainArgs  # noqa: E402
from litgpt.pretrain import fit  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

from lightning_mp import MPFabricPrecision  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
]

VOCAB, BLOCK = 64, 16
#: Pythia-like: LayerNorm, GPT-NeoX MLP, parallel residual, partial rotary; Llama-like: RMSNorm, SwiGLU, grouped
#: queries, full rotary
CONFIGS = {
    "pythia": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=BLOCK),
}
CONFIGS["llama"] = dict(
    CONFIGS["pythia"], norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64, bias=False,
    parallel_residual=False, n_query_groups=2, rotary_percentage=1.0,
)
FP16_SCALE = 2.0**10  # (both scalers from one modest scale: the first steps of a tiny model overflow 65536)


def fabric_own(mode: str) -> Precision:
    """Fabric's own plugin of ``mode`` on the CPU (fp16: its plugin made directly, as Fabric turns "16-mixed" into
    bf16 on the CPU)."""
    if mode == "bf16":
        return MixedPrecision("bf16-mixed", "cpu")
    if mode == "fp16":
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=FP16_SCALE))
    if mode == "bf16-true":
        return HalfPrecision("bf16-true")
    return Precision()


#: our plugin as Fabric's own runs the mode: no FP32 guards, no master weights in bf16-true
AS_FABRIC = {
    "bf16": {"fp32_modules": []},
    "fp16": {"fp32_modules": [], "init_scale": FP16_SCALE},
    "bf16-true": {"fp32_modules": [], "master_weights": "none"},
}


def tokens(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=torch.Generator().manual_seed(seed))


def setup(plugin: Precision, config: str) -> tuple[Fabric, Any, Any]:
    """LitGPT's set-up: the model, then the optimizer, set up apart (as ``litgpt.pretrain.main`` does)."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = GPT(Config(**CONFIGS[config]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    return fabric, fabric.setup(model), fabric.setup_optimizers(optimizer)


def pretrain(plugin: Precision, config: str, iters: int = 8) -> dict[str, torch.Tensor]:
    """``litgpt.pretrain.fit`` for ``iters`` micro-batches of 2, two a step; returns the trained weights."""
    fabric, model, optimizer = setup(plugin, config)
    data = tokens(iters * 2)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    train = TrainArgs(save_interval=None, log_interval=100, global_batch_size=4, micro_batch_size=2,
                      max_tokens=iters * 2 * BLOCK, lr_warmup_steps=1, max_norm=1.0, min_lr=1e-4)
    evaluation = EvalArgs(interval=1000, max_iters=1, initial_validation=False, final_validation=False)
    fit(fabric, devices=1, state=state, train_dataloader=DataLoader(data, batch_size=2),
        val_dataloader=DataLoader(data[:4], batch_size=2), out_dir=None, tokenizer_dir=None, train=train,
        eval=evaluation)  # fmt: skip
    assert state["step_count"] == iters // 2
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def distance(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return float(sum((weights[n].float() - reference[n]).square().sum() for n in reference) ** 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_litgpt_pretrains_as_with_fabrics_own_precision(mode, config):
    """LitGPT's loop with our plugin ends on the same weights as with Fabric's own plugin, bit for bit."""
    plugin = MPFabricPrecision(mode, **AS_FABRIC[mode])
    ours = pretrain(plugin, config)
    expected = pretrain(fabric_own(mode), config)
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[n], expected[n]) for n in expected)
    assert (plugin.stats.steps, plugin.stats.skipped_steps) == (4, 0)


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_litgpt_bf16_true_with_master_weights_follows_fp32(config):
    """bf16-true with the defaults (fp32 master weights, FP32 guards): the masters stay far closer to the fp32 run
    than Fabric's own bf16-true weights, whose Adam updates round away; the model holds them rounded."""
    reference = pretrain(Precision(), config, iters=16)
    fabric_bf16 = pretrain(fabric_own("bf16-true"), config, iters=16)
    plugin = MPFabricPrecision("bf16-true")
    weights = pretrain(plugin, config, iters=16)
    masters = {**weights, **plugin.masters.state_dict()["masters"]}
    assert distance(masters, reference) < distance(fabric_bf16, reference) / 4
    for name, master in plugin.masters.state_dict()["masters"].items():
        assert torch.equal(weights[name], master.to(weights[name].dtype))


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-true"])
def test_litgpt_step_with_a_nan_changes_nothing(mode):
    """A LitGPT model in a Fabric loop: a step whose activations hold a NaN (poisoned embedding output) is skipped,
    the weights, masters and optimizer state as before; training goes on."""
    fabric, model, optimizer = setup(MPFabricPrecision(mode), "llama")
    plugin = fabric.strategy.precision
    data = tokens(6)
    poison = {"on": False}

    def poisoned_embedding(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * float("nan") if poison["on"] else out

    model.module.transformer.wte.register_forward_hook(poisoned_embedding)

    def step(batch: torch.Tensor) -> None:
        loss = chunked_cross_entropy(model(batch[None, :BLOCK]), batch[None, 1:])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()

    def snapshot() -> dict[str, Any]:
        state = {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
                 "optimizer": copy.deepcopy(optimizer.state_dict())}
        if plugin.masters is not None:
            state["masters"] = copy.deepcopy(plugin.masters.state_dict())
        return state

    step(data[0])
    step(data[1])
    before = snapshot()
    poison["on"] = True
    step(data[2])
    poison["on"] = False
    after = snapshot()
    assert all(torch.equal(after["params"][n], t) for n, t in before["params"].items())
    assert after["optimizer"]["state"].keys() == before["optimizer"]["state"].keys()
    for index, values in before["optimizer"]["state"].items():
        assert all(torch.equal(after["optimizer"]["state"][index][k], v) for k, v in values.items())
    if "masters" in before:
        assert all(torch.equal(after["masters"]["masters"][n], t) for n, t in before["masters"]["masters"].items())
    assert (plugin.stats.steps, plugin.stats.skipped_steps) == (3, 1)
    step(data[3])
    assert (plugin.stats.steps, plugin.stats.skipped_steps, plugin.stats.consecutive_skips) == (4, 1, 0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
