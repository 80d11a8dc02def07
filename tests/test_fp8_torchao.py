"""The torchao float8 backend (``lightning_mp/fp8/torchao_backend.py``) on the CPU: config errors, the filter, the
swap, checkpoint keys and state, the hardware checks, the saturation watch, bf16 evaluation, compiled layers,
release, a few training steps against bf16, the three recipes through the real Trainer (with a checkpoint's round
trip), and FSDP2's FP8 all-gather on two gloo ranks.

torch runs ``torch._scaled_mm`` on the CPU, so torchao's ``Float8Linear`` computes real FP8 here; only
:meth:`TorchAOFloat8.check` (which refuses a CPU, as it should) is replaced where a test trains.
The plugin through the Trainer on a GPU: ``tests/gpu/test_fp8_torchao_gpu.py``.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from lightning_mp import MPPlugin, prepare_fp8
from lightning_mp.fp8 import FP8Config, FP8UnavailableError
from lightning_mp.fp8.backend import FP8Backend, make_backend
from lightning_mp.fp8.torchao_backend import (
    INSTALL_HINT,
    RECIPE_FORMATS,
    TorchAOFloat8,
    convert_to_torchao,
    float8_linear_config,
    is_float8_linear,
    scaled_mm_probe,
    torchao_support_problem,
)

try:
    import torchao.float8  # noqa: F401
except Exception as err:  # not installed, or built for another torch (0.18 needs torch >= 2.10)
    pytest.skip(f"torchao's float8 cannot be imported here: {err} (pip install 'torchao>=0.18')",
                allow_module_level=True)

AO = {"backend": "torchao"}
OFF = {"size_rule": "off"}  # toy layers are far below the auto size threshold
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


from test_fp8 import ToyLM  # noqa: E402 - (the same toy model as the Transformer Engine tests)


def toy(seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM()


@pytest.fixture
def on_cpu(monkeypatch):
    """The backend's hardware check passes on the CPU (torch runs FP8 matmuls there, slowly)."""
    monkeypatch.setattr(TorchAOFloat8, "check", lambda self, device: None)


def tokens(seed: int, n: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (n, seq + 1), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


# --------------------------------------------------------------------------------------------- config
def test_make_backend_picks_torchao_and_it_is_an_fp8_backend():
    fp8 = make_backend({"backend": "torchao"})
    assert isinstance(fp8, TorchAOFloat8) and isinstance(fp8, FP8Backend)
    assert (fp8.name, fp8.config.recipe, fp8.weights, fp8.model) == ("torchao", "tensorwise", "bf16", None)
    assert make_backend({"backend": "ao", "recipe": "RowWise"}).config.recipe == "rowwise"


@pytest.mark.parametrize(
    "values, pattern",
    [
        ({"backend": "torchao", "recipe": "delayed"}, r"recipe='delayed' is a recipe of backend='transformer_engine'"),
        ({"backend": "torchao", "recipe": "columnwise"},
         r"recipe='columnwise' is invalid\. Accepted values: 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'\.$"),
        ({"backend": "torchao", "fp8_format": "HYBRID"}, r"fp8_format='HYBRID' applies to backend='transformer_engine"),
        ({"backend": "torchao", "recipe": "rowwise", "weights": "fp8"}, r"recipe='tensorwise' only"),
        ({"backend": "torchao", "recipe": "rowwise_with_gw_hp", "weights": "fp8"}, r"recipe='tensorwise' only"),
        ({"backend": "pytorch"}, r"backend='pytorch' is invalid.*'transformer_engine', 'torchao'"),
    ],
)
def test_config_errors_name_the_value_and_the_accepted_ones(values, pattern):
    with pytest.raises(ValueError, match=pattern):
        TorchAOFloat8(values)


def test_torchao_backend_refuses_a_transformer_engine_config():
    with pytest.raises(ValueError, match=r"backend='transformer_engine'.*make_backend"):
        TorchAOFloat8(FP8Config())


def test_weights_attribute_is_checked_at_convert(on_cpu):
    fp8 = TorchAOFloat8({**AO, "recipe": "rowwise"})
    fp8.weights = "fp8"
    with pytest.raises(ValueError, match=r"tensorwise' only"):
        fp8.convert(toy(), "cpu")
    fp8.weights = "fp16"
    with pytest.raises(ValueError, match=r"weights='fp16' is invalid.*'fp32', 'bf16'.*'fp8'"):
        fp8.convert(toy(), "cpu")


# --------------------------------------------------------------------------------------------- the recipes
def test_the_recipes_are_torchaos_with_the_formats_recorded():
    from torchao.float8.config import ScalingGranularity, ScalingType

    assert list(RECIPE_FORMATS) == RECIPES
    for recipe in RECIPES:
        config = float8_linear_config(recipe)
        casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
        formats = tuple(str(c.target_dtype).removeprefix("torch.float8_") for c in casts)
        settings = TorchAOFloat8({**AO, "recipe": recipe}).recipe_settings()
        assert formats == RECIPE_FORMATS[recipe] == (settings["input"], settings["weight"], settings["grad_output"])
        assert settings["grad_weight_gemm"] == ("high" if recipe == "rowwise_with_gw_hp" else "fp8")
    gw_hp = float8_linear_config("rowwise_with_gw_hp")  # rowwise forward, the weight gradient's operands not cast
    assert gw_hp.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert gw_hp.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert gw_hp.cast_config_grad_output_for_grad_weight.scaling_type is ScalingType.DISABLED
    with pytest.raises(ValueError, match=r"recipe='tensorwise' only \(its rowwise recipes, 'rowwise' and 'rowwise_w"):
        float8_linear_config("rowwise_with_gw_hp", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match=r"recipe='blockwise' is invalid.*'tensorwise', 'rowwise', 'rowwise_with_gw"):
        float8_linear_config("blockwise")


def test_rowwise_with_gw_hp_converts_and_keeps_the_weight_gradient_in_high_precision(on_cpu):
    """One layer, one input, one output gradient: both rowwise recipes round the output and the input gradient to
    FP8 precision; rowwise's weight gradient too, rowwise_with_gw_hp's is the fp32 one."""
    torch.manual_seed(0)
    reference = nn.Linear(64, 32)
    x, grad = torch.randn(48, 64), torch.randn(48, 32)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward(grad)
    want = {"output": reference(x).detach(), "input_grad": x_ref.grad, "weight_grad": reference.weight.grad}
    errors = {}
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        model = nn.Sequential(copy.deepcopy(reference))
        model[0].weight.grad = None
        fp8 = TorchAOFloat8({**AO, **OFF, "recipe": recipe, "weights": "fp32", "keep_last": 0})
        report = fp8.convert(model, "cpu")
        assert is_float8_linear(model[0]) and report.summary().startswith(f"FP8 (torchao, {recipe}): 1 of 1 nn.Linear")
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(grad)
        got = {"output": out.detach(), "input_grad": xi.grad, "weight_grad": model[0].weight.grad}
        errors[recipe] = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    for recipe in errors:
        assert 1e-3 < errors[recipe]["output"] < 0.08 and 1e-3 < errors[recipe]["input_grad"] < 0.08, errors
    assert 1e-3 < errors["rowwise"]["weight_grad"] < 0.08, errors
    assert errors["rowwise_with_gw_hp"]["weight_grad"] < 1e-5, errors


# --------------------------------------------------------------------------------------------- the swap
def test_swap_follows_the_filter_and_reports(caplog):
    model = toy()
    plain = {n: p for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="lightning_mp.fp8"):
        report = convert_to_torchao(model, config=FP8Config(**AO, **OFF, exclude=["blocks.1.fc2"]))
    converted = sorted(r.fqn for r in report.converted)
    assert converted == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "stem"]
    reasons = {r.fqn: r.reason for r in report.skipped}
    assert "divisible by 16" in reasons["adapter"] and "divisible by 16" in reasons["back"]
    assert "keep_last=1" in reasons["head"] and "exclude" in reasons["blocks.1.fc2"]
    assert all(is_float8_linear(model.get_submodule(n)) for n in converted)
    assert type(model.head) is nn.Linear and type(model.blocks[0].ln) is nn.LayerNorm  # linears only
    # the same parameter objects: an optimizer made before the swap steps the right tensors
    assert all(p is plain[n] for n, p in model.named_parameters())
    line = report.summary()
    assert line.startswith("FP8 (torchao, tensorwise): 4 of 8 nn.Linear -> Float8Linear") and "keep_last" in line
    assert any("FP8 (torchao, tensorwise)" in r.getMessage() for r in caplog.records)
    again = convert_to_torchao(model, config=FP8Config(**AO, **OFF, exclude=["blocks.1.fc2"]))
    assert not again.converted and again.already_te == 4


def test_size_rule_and_module_filter_fn():
    report = convert_to_torchao(toy(), config=FP8Config(**AO))  # auto: min side >= 2048
    assert not report.converted and all("too small" in r.reason or "keep_last" in r.reason or "divisible" in r.reason
                                        for r in report.skipped)  # fmt: skip
    report = convert_to_torchao(toy(), config=FP8Config(**AO, **OFF), module_filter_fn=lambda m, fqn: "fc" in fqn)
    assert sorted(r.fqn for r in report.converted) == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    assert any("module_filter_fn" in r.reason for r in report.skipped)


def test_a_layer_held_twice_becomes_one_float8_linear():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    model.add_module("again", model[0])
    convert_to_torchao(model, config=FP8Config(**AO, **OFF, keep_last=0))
    assert is_float8_linear(model[0]) and model.again is model[0]


def test_convert_casts_bf16_weights_and_keeps_the_state_dict_keys(on_cpu):
    model, plain = toy(), toy()
    fp8 = TorchAOFloat8({**AO, **OFF})
    report = fp8.convert(model, "cpu")
    assert report.weights == "bf16" and fp8.model is model and len(fp8.layers) == 5
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())  # a plain checkpoint loads into the converted model and back
    plain.load_state_dict(model.state_dict())
    assert torch.equal(plain.stem.weight, model.stem.weight.float())
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert set(torch.load(buffer, weights_only=True)) == set(plain.state_dict())


def test_fp32_weights_and_cast_weights_false_leave_the_dtype(on_cpu):
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    model = toy()
    fp8.convert(model, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model = toy()
    TorchAOFloat8({**AO, **OFF}).convert(model, "cpu", cast_weights=False)  # the plugin casts itself
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_warns_when_nothing_is_converted(on_cpu):
    with pytest.warns(UserWarning, match=r"converted no nn.Linear.*size_rule='off'"):
        TorchAOFloat8(AO).convert(toy(), "cpu")


# --------------------------------------------------------------------------------------------- the checks
def test_check_refuses_the_cpu_naming_bf16():
    with pytest.raises(FP8UnavailableError, match=r"needs an NVIDIA GPU.*on the CPU\. Use precision='bf16'"):
        TorchAOFloat8(AO).check("cpu")
    with pytest.raises(FP8UnavailableError, match=r"on the CPU"):
        TorchAOFloat8({**AO, **OFF}).convert(toy(), "cpu")


def test_check_messages_for_old_gpus_missing_torchao_and_a_failed_probe():
    old = torchao_support_problem(device_type="cuda", capability=(8, 0), device_name="NVIDIA A100",
                                  torchao_version="0.18.0")  # fmt: skip
    assert "NVIDIA A100 has compute capability 8.0" in old and "precision='bf16'" in old
    assert "precision='fp16'" in torchao_support_problem(device_type="cuda", capability=(7, 0), torchao_version="1")
    missing = torchao_support_problem(device_type="cuda", capability=(9, 0), torchao_version=None)
    assert INSTALL_HINT in missing and INSTALL_HINT == 'pip install "torchao>=0.18"' and "precision='bf16'" in missing
    failed = torchao_support_problem(device_type="cuda", capability=(8, 9), torchao_version="0.18.0",
                                     recipe="rowwise", probe_error="RuntimeError: not supported")  # fmt: skip
    assert "recipe='tensorwise'" in failed and "not supported" in failed
    failed = torchao_support_problem(device_type="cuda", capability=(8, 9), torchao_version="0.18.0",
                                     recipe="rowwise_with_gw_hp", probe_error="RuntimeError: no")  # fmt: skip
    assert "recipe='rowwise_with_gw_hp'" in failed and "rowwise scales" in failed and "recipe='tensorwise'" in failed
    assert torchao_support_problem(device_type="cuda", capability=(9, 0), torchao_version="0.18.0") is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_probe_runs_where_torch_has_the_kernel(recipe):
    assert scaled_mm_probe(torch.device("cpu"), recipe) is None  # torch's CPU _scaled_mm


# --------------------------------------------------------------------------------------------- training
def train(model: nn.Module, fp8, steps: int, seed: int = 0, poison: int = -1) -> list[float]:
    """AdamW steps under bf16 autocast; a step whose FP8 flag (or loss) is not clean is skipped."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        batch = tokens(seed)  # one batch, learnt by heart: the loss falls fast and far
        region = fp8.autocast(training=True) if fp8 is not None else torch.autocast("cpu", torch.bfloat16)
        with torch.autocast("cpu", torch.bfloat16), region:
            loss = lm_loss(model, batch)
        loss.backward()
        flag = fp8.sentinel.take() if fp8 is not None else None
        if (flag is None or flag.item() == 0) and math.isfinite(loss.item()):
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_steps_follow_bf16(on_cpu, recipe):
    reference = train(toy(), None, 12)
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "recipe": recipe, "weights": "fp32", "keep_last": 0})
    fp8.convert(model, "cpu")
    fp8.watch_saturation()
    losses = train(model, fp8, 12)
    assert losses[-1] < losses[0] - 0.3  # it trains
    for ours, theirs in zip(losses, reference):
        assert abs(ours - theirs) < 0.02 * theirs + 0.02  # FP8 rounding, not another trajectory


def test_float8_layer_matches_linear_within_fp8_rounding(on_cpu):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(32, 64)
    expected = layer(x)
    TorchAOFloat8({**AO, **OFF, "weights": "fp32", "keep_last": 0}).convert(layer, "cpu")
    got = layer(x)
    error = (got - expected).norm() / expected.norm()
    assert 0 < error < 0.08  # E4M3 has 3 mantissa bits: a few per cent, and not zero (it really is FP8)


# --------------------------------------------------------------------------------------------- the sentinel
def test_sentinel_flags_a_poisoned_input_and_a_poisoned_gradient(on_cpu):
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    fp8.convert(model, "cpu")
    assert fp8.sentinel.take() is None  # not watching
    assert fp8.watch_saturation() == "hooks"
    with fp8.autocast(training=True):
        lm_loss(model, tokens(0)).backward()
    flag = fp8.sentinel.take()
    assert flag.dim() == 0 and flag.item() == 0
    model.stem.weight.grad = None
    with torch.no_grad():
        model.emb.weight[3] = float("inf")  # the stem's input holds inf where token 3 occurs
    batch = tokens(0)
    batch[0, 0] = 3
    with fp8.autocast(training=True):
        lm_loss(model, batch).backward()
    assert fp8.sentinel.take().item() > 0
    assert fp8.sentinel.take().item() == 0  # take() resets
    # an inf gradient reaching a layer's output
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    fp8.convert(model, "cpu")
    fp8.watch_saturation()
    with fp8.autocast(training=True):
        out = model.blocks[0].fc2(torch.randn(2, 128))
    out.backward(torch.full_like(out, float("inf")))
    assert fp8.sentinel.take().item() > 0
    stats = fp8.layer_stats()
    assert math.isinf(stats["blocks.0.fc2"]["grad_amax"]) and stats["blocks.0.fc2"]["weight_amax"] > 0


def test_sentinel_ignores_evaluation_and_can_be_switched_off(on_cpu):
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    fp8.convert(model, "cpu")
    fp8.watch_saturation()
    with torch.no_grad():
        model.emb.weight[:] = float("inf")
    with torch.no_grad(), fp8.autocast(training=False):
        model(tokens(0)[:, :-1])
    assert fp8.sentinel.take().item() == 0  # an eval forward runs no check
    assert fp8.watch_saturation(False) is None and fp8.layer_stats() == {}
    assert TorchAOFloat8({**AO, **OFF, "check_saturation": False}).watch_saturation() is None


def test_layer_stats_report_the_last_amaxes(on_cpu):
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    fp8.convert(model, "cpu")
    assert fp8.layer_stats() == {}  # not watching
    fp8.watch_saturation()
    x = torch.randn(3, 32)
    with fp8.autocast(training=True):
        model.stem(x).sum().backward()
    stats = fp8.layer_stats()["stem"]
    assert stats["input_amax"] == pytest.approx(x.abs().max().item())
    assert stats["weight_amax"] == pytest.approx(model.stem.weight.abs().max().item())
    assert stats["grad_amax"] == 1.0


# --------------------------------------------------------------------------------------------- evaluation
def test_evaluation_runs_bf16_unless_fp8_in_eval(on_cpu):
    x = torch.randn(4, 16, 32)
    for fp8_in_eval in (False, True):
        model = toy()
        fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32", "fp8_in_eval": fp8_in_eval})
        fp8.convert(model, "cpu")
        layer = model.blocks[0].fc1
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            plain = F.linear(x, layer.weight, layer.bias)
            with fp8.autocast(training=False):
                got = layer(x)
            with fp8.autocast(training=True):
                fp8_out = layer(x)
        assert torch.equal(got, fp8_out) is fp8_in_eval
        assert torch.equal(got, plain) is not fp8_in_eval
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            assert torch.equal(layer(x), fp8_out)  # outside any region: FP8, as torchao's own layers


# --------------------------------------------------------------------------------------------- state
def test_state_dict_is_plain_and_loads_with_warnings_on_changes(on_cpu):
    fp8 = TorchAOFloat8({**AO, "recipe": "rowwise"})
    state = fp8.state_dict()
    assert state["format"] == 1 and state["backend"] == "torchao" and state["torchao_version"]
    assert state["recipe"] == {"recipe": "rowwise", "input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e4m3fn",
                               "grad_weight_gemm": "fp8"}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.load_state_dict(state)  # same recipe: silent
        fp8.load_state_dict(None)
    with pytest.warns(UserWarning, match=r"recipe='rowwise' and training resumes with recipe='tensorwise'"):
        TorchAOFloat8(AO).load_state_dict(state)
    te_state = {"format": 1, "recipe": {"recipe": "delayed", "fp8_format": "HYBRID"}, "te_version": "2.20",
                "modules": {}}  # fmt: skip
    with pytest.warns(UserWarning, match=r"backend='transformer_engine' \(recipe='delayed'\).*dropped"):
        fp8.load_state_dict(te_state)
    with pytest.raises(ValueError, match=r"corrupted"):
        fp8.load_state_dict({"recipe": "rowwise"})
    with pytest.raises(ValueError, match=r"format=7"):
        fp8.load_state_dict({**state, "format": 7})


# --------------------------------------------------------------------------------------------- the Trainer
@pytest.fixture
def plugin_on_cpu(monkeypatch):
    """MPPlugin("fp8") with torchao on the CPU: the backend's and the plugin's GPU checks stand aside."""
    import lightning_mp.fp8.support as support

    monkeypatch.setattr(TorchAOFloat8, "check", lambda self, device: None)
    monkeypatch.setattr(support, "fp8_device_problem", lambda *args, **kwargs: None)


class LitToy(LightningModule):
    """The toy LM on two fixed batches, taken by the global batch index (restored on resume, unlike the loader's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ToyLM()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, tokens(self.trainer.fit_loop.epoch_loop.total_batch_idx % 2))
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit_lit(recipe: str, steps: int, module=None, ckpt_path=None):
    seed_everything(0)
    module = module if module is not None else LitToy()
    plugin = MPPlugin("fp8", fp8={**AO, **OFF, "recipe": recipe})
    trainer = Trainer(accelerator="cpu", max_steps=steps, plugins=[plugin], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer, plugin


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_trains_through_the_trainer(plugin_on_cpu, recipe):
    module, _, plugin = fit_lit(recipe, 12)
    assert sum(module.losses[-3:]) < sum(module.losses[:3]) - 0.6  # (from ~4.2 a step)
    assert plugin.stats.skipped_steps == 0
    assert sorted(n for n, m in module.model.named_modules() if is_float8_linear(m)) == [
        "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "stem"]  # fmt: skip
    assert plugin.state_dict()["fp8"]["recipe"]["recipe"] == recipe


def test_a_rowwise_with_gw_hp_checkpoint_resumes_bit_identically_and_records_its_recipe(plugin_on_cpu, tmp_path):
    recipe = "rowwise_with_gw_hp"
    whole, _, _ = fit_lit(recipe, 10)
    _, trainer, _ = fit_lit(recipe, 4)
    path = str(tmp_path / "gw_hp.ckpt")
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["MPPlugin"]["fp8"]["recipe"] == {"recipe": recipe, "input": "e4m3fn", "weight": "e4m3fn",
                                                  "grad_output": "e4m3fn", "grad_weight_gemm": "high"}  # fmt: skip
    assert "model.blocks.0.fc1.weight" in saved["state_dict"]  # the plain model's keys
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*recipe=")  # the same recipe: nothing to say
        rest, _, _ = fit_lit(recipe, 10, ckpt_path=path)
    assert rest.losses == whole.losses[4:]
    for (name, a), b in zip(whole.named_parameters(), rest.parameters()):
        assert torch.equal(a, b), name
    with pytest.warns(UserWarning, match=r"recipe='rowwise_with_gw_hp' and training resumes with recipe='rowwise'"):
        fit_lit("rowwise", 5, ckpt_path=path)


# --------------------------------------------------------------------------------------------- FSDP2
class ShardedToy(LightningModule):
    """Three linears under FSDP2 (``prepare_fp8`` then ``fully_shard`` in ``configure_model``), bf16 gathers for
    what FP8 does not gather; each rank writes its losses, its full weights and its FP8 gathers' scales."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))
        self.folder = folder
        self.losses: list[float] = []

    def configure_model(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        prepare_fp8(self)
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=mesh, mp_policy=policy)
        fully_shard(self.net, mesh=mesh, mp_policy=policy)  # the root: training_step calls self.net

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = (self.net(x).float() - x.flip(-1)).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        data = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.repeat(8, 1)), batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def on_train_end(self):
        weights = {n: p.full_tensor().detach().float().clone() for n, p in self.net.named_parameters()}
        locals_ = {n: getattr(p, "_local_tensor", None) for n, p in self.net.named_parameters()}
        kinds = {n: type(t).__name__ for n, t in locals_.items()}
        scales = {n: t._precomputed_scale.clone() for n, t in locals_.items()
                  if getattr(t, "_precomputed_scale", None) is not None}  # fmt: skip
        torch.save({"losses": self.losses, "weights": weights, "kinds": kinds, "scales": scales},
                   f"{self.folder}/rank{self.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_fsdp2_gathers_fp8_weights_with_scales_computed_after_each_step(plugin_on_cpu, tmp_path):
    """weights='fp8' under ModelParallelStrategy (two gloo ranks): the FP8 layers' shards are torchao's FP8-gather
    tensors, the gathers' scales are computed after each step from the whole weight (one all-reduce), the ranks
    agree, and the losses follow the same run with bf16 gathers."""
    from conftest import ForkModelParallel

    runs = {}
    for weights in ("auto", "fp8"):
        folder = tmp_path / weights
        folder.mkdir()
        plugin = MPPlugin("fp8", fp8={**AO, **OFF, "keep_last": 0, "weights": weights})
        strategy = ForkModelParallel(data_parallel_size=2, tensor_parallel_size=1)
        Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=8, plugins=[plugin], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                ).fit(ShardedToy(str(folder)))  # fmt: skip
        runs[weights] = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    bf16_gather, fp8_gather = runs["auto"], runs["fp8"]
    assert set(bf16_gather[0]["kinds"].values()) == {"Tensor"} and not bf16_gather[0]["scales"]
    kinds = fp8_gather[0]["kinds"]
    assert {kinds[f"{i}.weight"] for i in (0, 2, 4)} == {"WeightWithDynamicFloat8CastTensor"}
    assert kinds["0.bias"] == "Tensor"
    for rank in fp8_gather:
        assert sorted(rank["scales"]) == ["0.weight", "2.weight", "4.weight"]
        for name, scale in rank["scales"].items():  # E4M3's largest value over the whole weight's amax
            expected = torch.finfo(torch.float8_e4m3fn).max / rank["weights"][name].abs().max()
            assert scale.item() == pytest.approx(expected.item(), rel=1e-5)
    for run in runs.values():
        for name, value in run[0]["weights"].items():
            assert torch.equal(value, run[1]["weights"][name]), name
    losses = [sum(r["losses"][i] for r in fp8_gather) / 2 for i in range(8)]
    reference = [sum(r["losses"][i] for r in bf16_gather) / 2 for i in range(8)]
    assert losses[-1] < 0.8 * losses[0]  # it trains
    for ours, theirs in zip(losses, reference):
        assert ours == pytest.approx(theirs, rel=0.03)  # FP8 instead of bf16 for the gathered weights' cast


# --------------------------------------------------------------------------------------------- the rest
def test_fp8_weights_need_fsdp2(on_cpu):
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp8"})
    model = toy()
    fp8.convert(model, "cpu")
    assert type(model.stem.weight).__name__ != "DTensor"
    assert fp8.configure_weight_cache(accumulate_grad_batches=4) is False
    with pytest.raises(ValueError, match=r"FSDP2's float8 all-gather.*ModelParallelStrategy"):
        fp8.connect_optimizers([torch.optim.AdamW(model.parameters())])


def test_release_restores_the_layers_and_copies_stay_independent(on_cpu):
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"})
    fp8.convert(model, "cpu")
    fp8.watch_saturation()
    assert fp8.is_converted(model) and not fp8.is_converted(toy())
    copied = copy.deepcopy(model)  # each copy's forward computes with its own weights
    assert copied.stem.forward.args[1] is copied.stem
    pickled = io.BytesIO()
    torch.save(model, pickled)
    layer = model.stem
    assert layer._forward_pre_hooks and layer._forward_hooks and "forward" in layer.__dict__
    fp8.release()
    assert not layer._forward_pre_hooks and not layer._forward_hooks and "forward" not in layer.__dict__
    with fp8.autocast(training=False):  # the same model in a later validate: routed again
        assert "forward" in layer.__dict__
    assert fp8.adopt(model, "cpu") == 5 and "forward" in layer.__dict__


@pytest.mark.slow
def test_compiled_layers_compute_what_eager_layers_do(on_cpu):
    x = torch.randn(4, 16, 32)
    outs = []
    for compile_layers in (False, True):
        model = toy()
        fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"}, compile_layers=compile_layers)
        fp8.compile_backend = "aot_eager"  # the graphs of Inductor's, without a C++ compiler
        report = fp8.convert(model, "cpu")
        assert report.compiled is compile_layers
        out = model.blocks[0](x)
        out.sum().backward()
        outs.append((out.detach(), model.blocks[0].fc1.weight.grad))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5) and torch.allclose(outs[0][1], outs[1][1], atol=1e-4)


def test_compile_is_left_to_a_compiled_model(on_cpu):
    fp8 = TorchAOFloat8({**AO, **OFF})
    assert fp8._decide_compile(toy(), torch.device("cuda")) is True
    assert fp8._decide_compile(toy(), torch.device("cpu")) is False
    wrapped = nn.Sequential(torch.compile(toy()))
    assert fp8._decide_compile(wrapped, torch.device("cuda")) is False
    flagged = toy()
    flagged._compiler_ctx = {"compiler": "dynamo"}  # what Lightning records on a module handed over compiled
    assert fp8._decide_compile(flagged, torch.device("cuda")) is False
    assert TorchAOFloat8(AO, compile_layers=False)._decide_compile(toy(), torch.device("cuda")) is False


@pytest.mark.slow
def test_the_watch_works_inside_a_compiled_model_without_graph_breaks(on_cpu):
    model = toy()
    fp8 = TorchAOFloat8({**AO, **OFF, "weights": "fp32"}, compile_layers=False)
    fp8.convert(model, "cpu")
    fp8.watch_saturation()
    compiled = torch.compile(model, backend="aot_eager")
    batch = tokens(0)[:, :-1]
    explained = torch._dynamo.explain(model)(batch)
    assert explained.graph_break_count == 0
    with fp8.autocast(training=True):
        compiled(batch).float().sum().backward()
    assert fp8.sentinel.take().item() == 0 and fp8.layer_stats()["stem"]["grad_amax"] > 0
    with torch.no_grad():
        model.emb.weight[batch[0, 0]] = float("inf")
    with fp8.autocast(training=True):
        compiled(batch).float().sum().backward()
    assert fp8.sentinel.take().item() > 0


def test_fsdp1_needs_nothing_but_refuses_fp8_weights():
    TorchAOFloat8(AO).prepare_fsdp(nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"FSDP \(1\) does not run"):
        TorchAOFloat8({**AO, "weights": "fp8"}).prepare_fsdp(nn.Linear(16, 16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_check_on_cuda_without_cuda_says_so():
    with pytest.raises(FP8UnavailableError, match=r"CUDA is not available"):
        TorchAOFloat8(AO).check("cuda")
