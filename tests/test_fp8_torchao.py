"""The torchao float8 backend (``lightning_mp/fp8/torchao_backend.py``) on the CPU: config errors, the filter, the
swap, checkpoint keys and state, the hardware checks, the saturation watch, bf16 evaluation, compiled layers,
release, and a few training steps against bf16.

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
from torch import nn

from lightning_mp.fp8 import FP8Config, FP8UnavailableError
from lightning_mp.fp8.backend import FP8Backend, make_backend
from lightning_mp.fp8.torchao_backend import (
    INSTALL_HINT,
    TorchAOFloat8,
    convert_to_torchao,
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
        ({"backend": "torchao", "recipe": "columnwise"}, r"recipe='columnwise' is invalid.*'tensorwise', 'rowwise'"),
        ({"backend": "torchao", "fp8_format": "HYBRID"}, r"fp8_format='HYBRID' applies to backend='transformer_engine"),
        ({"backend": "torchao", "recipe": "rowwise", "weights": "fp8"}, r"recipe='tensorwise' only"),
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
    with pytest.raises(ValueError, match=r"weights='fp16' is invalid.*'fp32', 'bf16', 'fp8'"):
        fp8.convert(toy(), "cpu")


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
    assert torchao_support_problem(device_type="cuda", capability=(9, 0), torchao_version="0.18.0") is None


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
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


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
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
    assert state["recipe"] == {"recipe": "rowwise", "input": "e4m3fn", "weight": "e4m3fn", "grad_output": "e4m3fn"}
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
