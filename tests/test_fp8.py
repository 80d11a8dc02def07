"""lightning_mp.fp8 without Transformer Engine: config, layer filter, messages, and the swap's bookkeeping.

The swap itself is exercised against ``standin_te`` below, a minimal stand-in with te.Linear's and
te.LayerNorm's constructor, parameter names and ``is_first_microbatch`` argument, used only for the swap's
bookkeeping (what is converted, weights copied, sharing kept, report, checkpoint keys). The same behaviour
runs with the real Transformer Engine in tests/gpu/test_fp8_te.py.
"""

from __future__ import annotations

import logging
import pickle
import types
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.fp8 import (
    AUTO_MIN_FEATURES,
    FP8Config,
    FP8Training,
    FP8UnavailableError,
    MicrobatchWeightCache,
    ModuleFilter,
    auto_size_rule,
    check_fp8_support,
    convert_to_te,
    first_last_rule,
    fp8_support_problem,
    name_rule,
    te_installed,
    te_shape_rule,
)
from lightning_mp.fp8.convert import apply_weights_dtype
from lightning_mp.fp8.runtime import fit_amax_history, install_checkpoint_hooks, scaling_state_compat
from lightning_mp.fp8.support import recipe_spec


# --------------------------------------------------------------------------------------------- stand-in TE
class StandInLinear(nn.Module):
    """te.Linear's constructor signature, parameter names and forward argument; computes F.linear."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(out_features, in_features, dtype=params_dtype))  # junk: copy must win
        if bias:
            self.bias = nn.Parameter(torch.randn(out_features, dtype=params_dtype))
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype)  # what te.Linear holds without a bias
        self.device_arg = device
        self.calls: list[Optional[bool]] = []

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        self.calls.append(is_first_microbatch)
        bias = self.bias.to(inp.dtype) if self.bias.numel() else None
        return F.linear(inp, self.weight.to(inp.dtype), bias)

    def get_extra_state(self):  # TE's format: a uint8 tensor holding a pickle
        return torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": [1.0]})), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded_extra_state = state


class StandInLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, params_dtype=None, device=None):
        super().__init__()
        self.normalized_shape, self.eps = (normalized_shape,), eps
        self.weight = nn.Parameter(torch.randn(normalized_shape, dtype=params_dtype))
        self.bias = nn.Parameter(torch.randn(normalized_shape, dtype=params_dtype))

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


for _cls in (StandInLinear, StandInLayerNorm):
    _cls.__module__ = "transformer_engine.pytorch.module"  # how the swap recognises TE modules
standin_te = types.SimpleNamespace(Linear=StandInLinear, LayerNorm=StandInLayerNorm)


# --------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ToyLM(nn.Module):
    """embedding -> stem -> 2 blocks -> odd-shaped adapter -> final norm -> head (optionally tied)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.stem = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(2))
        self.adapter = nn.Linear(hidden, 24)
        self.back = nn.Linear(24, hidden)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.stem(self.emb(tokens))
        for block in self.blocks:
            h = block(h)
        h = h + self.back(F.relu(self.adapter(h)))
        return self.head(self.ln_f(h))


OFF = dict(size_rule="off")  # toy layers are far below the auto size threshold


# --------------------------------------------------------------------------------------------- config
def test_config_defaults_and_recipe_settings():
    cfg = FP8Config()
    assert (cfg.recipe, cfg.weights, cfg.fp8_in_eval, cfg.keep_first, cfg.keep_last) == ("delayed", "auto", False, 0, 1)
    assert (cfg.backend, cfg.convert_layernorm) == ("transformer_engine", True)
    assert cfg.recipe_settings() == {
        "recipe": "delayed", "fp8_format": "HYBRID", "margin": 0, "amax_history_len": 1024, "amax_compute_algo": "max"
    }
    assert FP8Config(recipe="current").recipe_settings() == {"recipe": "current", "fp8_format": "HYBRID"}
    assert FP8Config(recipe="block").recipe_settings() == {"recipe": "block", "fp8_format": "E4M3"}
    assert FP8Config(recipe="mxfp8").recipe_settings() == {"recipe": "mxfp8", "fp8_format": "E4M3", "margin": 0}


def test_config_from_dict_normalises_case_and_lists():
    cfg = FP8Config.from_dict(
        {"recipe": "Delayed", "fp8_format": "hybrid", "amax_compute_algo": "MOST_RECENT", "include": "blocks.*",
         "exclude": ["head", " *.router "], "weights": "BF16"}
    )
    assert (cfg.recipe, cfg.fp8_format, cfg.amax_compute_algo, cfg.weights) == (
        "delayed", "HYBRID", "most_recent", "bf16"
    )
    assert cfg.include == ("blocks.*",) and cfg.exclude == ("head", "*.router")
    hash(cfg)  # frozen and hashable
    with pytest.raises(Exception):
        cfg.recipe = "current"  # type: ignore[misc, unused-ignore]
    assert FP8Config.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["exclude"] == ["head", "*.router"]


def test_config_from_value():
    assert FP8Config.from_value(None) == FP8Config()
    cfg = FP8Config(recipe="current")
    assert FP8Config.from_value(cfg) is cfg
    assert FP8Config.from_value({"recipe": "block"}).recipe == "block"
    with pytest.raises(ValueError, match=r"fp8='delayed' is invalid: pass a dict"):
        FP8Config.from_value("delayed")


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        (
            {"recipe": "nvfp4"},
            r"fp8 recipe='nvfp4' is invalid\. Accepted values: 'delayed', 'current', 'block', 'mxfp8'",
        ),
        ({"fp8_format": "E5M2"}, r"fp8 fp8_format='E5M2' is invalid\. Accepted values: 'HYBRID', 'E4M3'"),
        ({"amax_compute_algo": "mean"}, r"amax_compute_algo='mean' is invalid\. Accepted values: 'max', 'most_recent'"),
        ({"amax_history_len": 0}, r"fp8 amax_history_len=0 is invalid: use an integer >= 1, or null"),
        ({"amax_history_len": True}, r"amax_history_len=True is invalid"),
        ({"margin": -1}, r"fp8 margin=-1 is invalid: use an integer >= 0"),
        (
            {"recipe": "current", "amax_history_len": 16},
            r"amax_history_len=16 applies to recipe='delayed' only, not recipe='current'",
        ),
        ({"recipe": "block", "margin": 1}, r"margin=1 applies to recipe='delayed' or 'mxfp8' only, not recipe='block'"),
        ({"keep_last": -1}, r"fp8 keep_last=-1 is invalid: use an integer >= 0\."),
        ({"keep_first": 1.5}, r"fp8 keep_first=1.5 is invalid"),
        ({"include": []}, r"include=\[\] selects no module"),
        ({"exclude": [3]}, r"fp8 exclude=\[3\] is invalid: use a list of module-name globs"),
        ({"size_rule": "big"}, r"fp8 size_rule='big' is invalid\. Accepted values: 'auto', 'off'"),
        ({"size_rule": "off", "min_features": 512}, r"min_features=512 takes effect with size_rule='auto' only"),
        ({"min_features": -3}, r"fp8 min_features=-3 is invalid"),
        ({"weights": "fp16"}, r"fp8 weights='fp16' is invalid\. Accepted values: 'auto', 'fp32', 'bf16', 'fp8'"),
        ({"fp8_in_eval": "yes"}, r"fp8 fp8_in_eval='yes' is invalid: use true or false"),
        ({"convert_layernorm": 1}, r"convert_layernorm=1 is invalid: use true or false"),
        ({"check_saturation": "no"}, r"check_saturation='no' is invalid: use true or false"),
        (
            {"cache_fp8_weights": True},
            r"cache_fp8_weights=True is invalid\. Accepted values: 'auto', 'always', 'never'",
        ),
        (
            {"amax_history": 16},
            r"Unknown fp8 setting 'amax_history'\. Did you mean 'amax_history_len'\? Accepted settings: backend,",
        ),
        ({"speed": 2}, r"Unknown fp8 setting 'speed'\. Accepted settings: backend, recipe, fp8_format,"),
    ],
)
def test_config_errors_name_the_value_and_the_accepted_ones(values, pattern):
    with pytest.raises(ValueError, match=pattern):
        FP8Config.from_dict(values)


def test_config_from_yaml_through_jsonargparse():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--fp8", type=Optional[FP8Config])
    cfg = parser.parse_string(
        "fp8:\n  recipe: delayed\n  amax_history_len: 16\n  exclude: [head, '*.router']\n  keep_first: 1\n"
        "  weights: bf16\n  fp8_in_eval: true\n  min_features: 1024\n"
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    fp8 = instantiate(cfg).fp8
    assert isinstance(fp8, FP8Config)
    assert (fp8.amax_history_len, fp8.exclude, fp8.keep_first, fp8.weights, fp8.fp8_in_eval, fp8.min_features) == (
        16, ("head", "*.router"), 1, "bf16", True, 1024
    )


# --------------------------------------------------------------------------------------------- filters
@pytest.mark.parametrize(
    ("shape", "ok"),
    [((4096, 4096), True), ((24, 32), False), ((32, 40), False), ((16, 16), True), ((4104, 4096), False)],
)
def test_te_shape_rule(shape, ok):
    assert te_shape_rule(nn.Linear(*shape, device="meta"), "x") is ok


@pytest.mark.parametrize(
    ("shape", "ok"),
    [
        ((1024, 1024), False),  # 0.22x of bf16 on an H200
        ((1024, 4096), False),
        ((4096, 1024), False),
        ((2048, 2048), True),  # the 2048-wide GPT gained 1.46x with every linear in FP8
        ((4096, 4096), True),
        ((8192, 8192), True),
        ((4096, 16384), True),
    ],
)
def test_auto_size_rule(shape, ok):
    assert auto_size_rule(nn.Linear(*shape, device="meta"), "blocks.0.fc1") is ok
    assert auto_size_rule(nn.LayerNorm(64), "ln")  # only linears are sized


def test_auto_size_rule_threshold_is_settable():
    assert AUTO_MIN_FEATURES == 2048
    assert auto_size_rule(nn.Linear(1024, 1024, device="meta"), "x", min_features=1024)
    assert not auto_size_rule(nn.Linear(1024, 1024, device="meta"), "x", min_features=1040)


def test_name_rule_matches_dotted_suffixes():
    rule = name_rule(include=["*"], exclude=["head", "*.router"])
    lin = nn.Linear(16, 16, device="meta")
    assert not rule(lin, "model.head") and not rule(lin, "head")
    assert not rule(lin, "model.blocks.3.moe.router")
    assert rule(lin, "model.blocks.3.fc1") and rule(lin, "model.header")
    only_blocks = name_rule(include=["blocks.*"])
    assert only_blocks(lin, "model.blocks.0.fc1") and not only_blocks(lin, "model.stem")


def test_first_last_rule_sees_the_whole_model():
    model = ToyLM()
    keep_ends = first_last_rule(model, keep_first=1, keep_last=2)
    assert not keep_ends(model.stem, "stem")
    assert not keep_ends(model.head, "head") and not keep_ends(model.back, "back")
    assert keep_ends(model.adapter, "adapter") and keep_ends(model.blocks[0].fc1, "blocks.0.fc1")
    assert first_last_rule(model)(model.head, "head")  # keep nothing by default


def test_module_filter_reasons():
    model = ToyLM(tie=True)
    model.blocks[1].fc2.register_forward_hook(lambda *a: None)
    keep = ModuleFilter(model, FP8Config(keep_first=1, keep_last=1, exclude=["blocks.1.ln"], **OFF))
    reasons = {
        name: keep.reason(m, name) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))
    }
    assert reasons["stem"] == "one of the first 1 linear layer(s), kept in bf16 (keep_first=1)"
    assert reasons["head"].startswith("one of the last 1 linear layer(s)")
    assert "divisible by 16" in reasons["adapter"] and "in_features=32, out_features=24" in reasons["adapter"]
    assert "divisible by 16" in reasons["back"]
    assert reasons["blocks.1.ln"] == "matched exclude pattern 'blocks.1.ln'"
    assert reasons["blocks.1.fc2"] == "has forward hooks, which a swap would drop"
    assert reasons["blocks.0.fc1"] is None and reasons["blocks.0.ln"] is None and reasons["ln_f"] is None
    assert keep(model.blocks[0].fc1, "blocks.0.fc1") and not keep(model.stem, "stem")

    tied = ModuleFilter(model, FP8Config(keep_last=0, **OFF))
    assert "tied weights" in tied.reason(model.head, "head")


def test_module_filter_kinds_and_sizes():
    model = nn.Sequential(
        nn.Linear(4096, 1024, device="meta"),
        nn.LayerNorm(32, elementwise_affine=False),
        nn.LayerNorm((4, 8)),
        nn.modules.linear.NonDynamicallyQuantizableLinear(32, 32),
        nn.Linear(4096, 4096, device="meta"),
    )
    keep = ModuleFilter(model, FP8Config(keep_last=0))
    assert "too small for FP8 to pay: min(in_features, out_features)=1024 < 2048" in keep.reason(model[0], "0")
    assert "no affine weight and bias" in keep.reason(model[1], "1")
    assert "more than one dimension" in keep.reason(model[2], "2")
    assert "subclasses nn.Linear" in keep.reason(model[3], "3")
    assert keep.reason(model[4], "4") is None
    assert ModuleFilter(model, FP8Config(keep_last=0, min_features=1024)).reason(model[0], "0") is None
    assert (
        ModuleFilter(model, FP8Config(convert_layernorm=False)).reason(nn.LayerNorm(32), "n")
        == "convert_layernorm=False"
    )
    user = ModuleFilter(model, FP8Config(keep_last=0), extra=lambda m, fqn: fqn != "4")
    assert user.reason(model[4], "4") == "module_filter_fn returned False"


def test_module_filter_respects_fp32_guards():
    guards = pytest.importorskip("lightning_mp.guards")
    model = ToyLM()
    guards.apply_fp32_guards(model)  # the default guards cover LayerNorm
    report = convert_to_te(model, config=FP8Config(**OFF), te=standin_te)
    kept = {r.fqn: r.reason for r in report.skipped}
    assert kept["ln_f"] == "an FP32 guard keeps it in fp32" and isinstance(model.ln_f, nn.LayerNorm)


# --------------------------------------------------------------------------------------------- swap bookkeeping
def test_swap_converts_copies_and_reports(caplog):
    torch.manual_seed(0)
    model = ToyLM()
    reference = ToyLM()
    reference.load_state_dict(model.state_dict())
    shared = nn.Linear(32, 32)
    model.blocks[0].shared = shared  # one module held at two paths
    model.blocks[1].shared = shared
    model.stem.weight.requires_grad_(False)

    with caplog.at_level(logging.DEBUG, logger="lightning_mp.fp8"):
        report = convert_to_te(model, config=FP8Config(**OFF), te=standin_te)

    converted = {r.fqn for r in report.converted}
    skipped = {r.fqn: r.reason for r in report.skipped}
    assert converted == {
        "stem", "blocks.0.ln", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.ln", "blocks.1.fc1", "blocks.1.fc2", "ln_f",
        "blocks.0.shared",
    }
    assert set(skipped) == {"adapter", "back", "head"}
    assert skipped["head"].startswith("one of the last 1 linear layer(s)")
    assert isinstance(model.blocks[0].fc1, StandInLinear) and isinstance(model.ln_f, StandInLayerNorm)
    assert isinstance(model.head, nn.Linear) and isinstance(model.adapter, nn.Linear)
    assert model.blocks[0].shared is model.blocks[1].shared and isinstance(model.blocks[0].shared, StandInLinear)
    assert not model.stem.weight.requires_grad and model.blocks[0].fc1.weight.requires_grad
    # weights copied exactly; TE's empty bias tensor for bias=False layers left alone
    for name in ("stem", "blocks.0.fc1", "blocks.1.fc2"):
        new, old = model.get_submodule(name), reference.get_submodule(name)
        assert torch.equal(new.weight, old.weight) and torch.equal(new.bias, old.bias)
        assert new.weight.dtype == torch.float32
    assert torch.equal(model.ln_f.weight, reference.ln_f.weight) and model.ln_f.eps == reference.ln_f.eps
    # the swapped model computes what the original did (FP8 off: the stand-in runs F.linear)
    tokens = torch.randint(0, 64, (2, 5))
    torch.testing.assert_close(model(tokens), reference(tokens))

    lin = report.count("Linear"), report.count("Linear", converted=False)
    assert lin == (6, 3) and report.count("LayerNorm") == 3
    elements = {"stem": 32 * 32, "fc": 32 * 128, "adapter": 32 * 24, "head": 32 * 64}
    done = elements["stem"] * 2 + 4 * elements["fc"]  # the shared linear counts once
    total = done + 2 * elements["adapter"] + elements["head"]
    assert report.linear_flop_share == pytest.approx(done / total)
    summary = report.summary()
    assert (
        summary.startswith("FP8: 6 of 9 nn.Linear -> te.Linear (") and "3 of 3 nn.LayerNorm -> te.LayerNorm" in summary
    )
    assert "2 shapes FP8 GEMMs cannot run (not divisible by 16)" in summary and "1 last layers (keep_last)" in summary
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in infos] == [summary]
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "kept      Linear adapter (32, 24): in_features=32, out_features=24" in debug
    assert report.as_dict()["skipped"][0]["reason"]

    again = convert_to_te(model, config=FP8Config(**OFF), te=standin_te)
    assert (
        not again.converted
        and again.already_te == 9
        and "9 Transformer Engine modules were already there" in again.summary()
    )


def test_swap_bf16_weights_and_module_filter_fn():
    model = ToyLM()
    report = convert_to_te(
        model, config=FP8Config(weights="bf16", keep_last=0, **OFF), te=standin_te,
        module_filter_fn=lambda m, fqn: not fqn.startswith("blocks.1"),
    )
    assert model.blocks[0].fc1.weight.dtype == torch.bfloat16 and model.ln_f.weight.dtype == torch.bfloat16
    assert model.emb.weight.dtype == torch.float32  # only swapped modules change dtype here
    assert {r.fqn for r in report.skipped if r.reason == "module_filter_fn returned False"} == {
        "blocks.1.ln", "blocks.1.fc1", "blocks.1.fc2"
    }
    apply_weights_dtype(model, "bf16")
    assert model.emb.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"weights='fp16' is invalid\. Accepted values: 'fp32', 'bf16', 'fp8'"):
        apply_weights_dtype(model, "fp16")


def test_bf16_weights_leave_fp32_guarded_modules_alone():
    guards = pytest.importorskip("lightning_mp.guards")
    model = ToyLM()
    guards.apply_fp32_guards(model)
    apply_weights_dtype(model, "bf16")
    assert model.ln_f.weight.dtype == torch.float32 and model.blocks[0].ln.bias.dtype == torch.float32
    assert model.blocks[0].fc1.weight.dtype == torch.bfloat16 and model.emb.weight.dtype == torch.bfloat16


def test_checkpoint_keys_match_the_torch_model():
    model, plain = ToyLM(), ToyLM()
    convert_to_te(model, config=FP8Config(**OFF), te=standin_te)
    assert any(k.endswith("_extra_state") for k in model.state_dict())  # TE's pickled state, before the hooks
    assert install_checkpoint_hooks(model) == 5  # the converted linears (the stand-in norm has no extra state)
    state = model.state_dict()
    assert not any(k.endswith("_extra_state") for k in state)
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)  # strict: an FP8 checkpoint loads into the torch model
    model.load_state_dict(plain.state_dict())  # and a torch checkpoint into the converted model
    assert model.blocks[0].fc1.loaded_extra_state.numel() == 0  # TE's "no state" value
    assert install_checkpoint_hooks(model) == 0  # idempotent


# --------------------------------------------------------------------------------------------- micro-batch cache
def test_microbatch_weight_cache_marks_the_first_forward_after_each_step():
    model = nn.Sequential(StandInLinear(8, 8), nn.ReLU(), StandInLinear(8, 8))
    cache = MicrobatchWeightCache()
    assert cache.attach(model) == 2
    x = torch.randn(2, 8)
    model(x)  # inactive: TE's default (None)
    cache.active = True
    for _ in range(3):  # three micro-batches, then a step
        model(x)
    cache.weights_updated()
    model(x)
    model[0](x)  # the same module twice before the next step: still cached
    model[0](x, is_first_microbatch=True)  # the caller's own value wins
    assert model[0].calls == [None, True, False, False, True, False, True]
    assert model[2].calls == [None, True, False, False, True]
    model.load_state_dict(model.state_dict())  # a load may change weights: recast next time
    model(x)
    assert model[0].calls[-1] is True
    cache.detach()
    model(x)
    assert model[0].calls[-1] is None


def test_fp8_training_weight_cache_configuration():
    fp8 = FP8Training({"cache_fp8_weights": "auto"})
    fp8._model = nn.Sequential(StandInLinear(8, 8))
    assert not fp8.configure_weight_cache(accumulate_grad_batches=1)
    assert fp8.configure_weight_cache(accumulate_grad_batches=4)
    assert not fp8.configure_weight_cache(accumulate_grad_batches=4, automatic_optimization=False)
    always = FP8Training({"cache_fp8_weights": "always"})
    always._model = fp8._model
    assert always.configure_weight_cache(accumulate_grad_batches=1, automatic_optimization=False)
    never = FP8Training({"cache_fp8_weights": "never"})
    never._model = fp8._model
    assert not never.configure_weight_cache(accumulate_grad_batches=8)


def test_eval_runs_without_fp8_by_default():
    fp8 = FP8Training()
    assert isinstance(fp8.autocast(training=False), type(__import__("contextlib").nullcontext()))
    assert not isinstance(
        FP8Training({"fp8_in_eval": True}).autocast(training=False), type(__import__("contextlib").nullcontext())
    )


# --------------------------------------------------------------------------------------------- messages
def test_messages_cpu_and_old_gpus():
    cpu = fp8_support_problem(device_type="cpu", te_version=None)
    assert "needs an NVIDIA GPU with FP8 tensor cores" in cpu and "Ada, Hopper or Blackwell" in cpu
    assert cpu.endswith("but the run is on the CPU. Use precision='bf16' instead.")
    a100 = fp8_support_problem(
        device_type="cuda", capability=(8, 0), device_name="NVIDIA A100-SXM4-80GB", te_version=None
    )
    assert "NVIDIA A100-SXM4-80GB has compute capability 8.0" in a100 and "Use precision='bf16' on this GPU" in a100
    t4 = fp8_support_problem(device_type="cuda", capability=(7, 5), device_name="Tesla T4", te_version="2.20.2")
    assert "Use precision='fp16' (with loss scaling)" in t4
    assert "device type 'mps'" in fp8_support_problem(device_type="mps")


def test_message_without_transformer_engine():
    text = fp8_support_problem(device_type="cuda", capability=(9, 0), device_name="NVIDIA H100", te_version=None)
    assert "Transformer Engine, which is not installed" in text
    assert '`pip install "lightning-mp[fp8]"`' in text and "precision='bf16'" in text


def test_messages_for_recipes():
    hopper = dict(device_type="cuda", capability=(9, 0), device_name="NVIDIA H200", te_version="2.20.2")
    assert fp8_support_problem(**hopper, recipe="delayed") is None
    assert fp8_support_problem(**hopper, recipe="block") is None
    old = fp8_support_problem(**hopper, recipe="current", recipe_class_present=False)
    assert (
        "needs transformer_engine.common.recipe.Float8CurrentScaling,"
        " which the installed Transformer Engine 2.20.2 lacks" in old
    )
    te_says = "Device compute capability 10.0 or higher required for MXFP8 execution."
    mx = fp8_support_problem(**hopper, recipe="mxfp8", te_reason=te_says)
    assert mx.startswith("fp8 recipe='mxfp8' (MXFP8BlockScaling) cannot run on NVIDIA H200: " + te_says)
    assert "Blackwell" in mx and "use recipe='delayed', 'current', 'block' here." in mx
    # an older TE without its own check: the same hardware rule
    assert "MXFP8 needs compute capability 10.x" in fp8_support_problem(**hopper, recipe="mxfp8")
    ada = dict(hopper, capability=(8, 9), device_name="NVIDIA L40S")
    block = fp8_support_problem(**ada, recipe="block")
    assert (
        "(Float8BlockScaling) cannot run on NVIDIA L40S" in block and "use recipe='delayed', 'current' here." in block
    )
    blackwell = dict(hopper, capability=(10, 0), device_name="NVIDIA B200")
    assert fp8_support_problem(**blackwell, recipe="mxfp8") is None


def test_check_fp8_support_raises_a_value_error_on_cpu():
    with pytest.raises(FP8UnavailableError, match=r"run is on the CPU\. Use precision='bf16' instead\.") as info:
        check_fp8_support("cpu", "delayed")
    assert isinstance(info.value, ValueError)


def test_convert_on_cpu_fails_before_touching_the_model():
    model = ToyLM()
    with pytest.raises(FP8UnavailableError, match="precision='bf16'"):
        FP8Training().convert(model, device="cpu")
    assert sum(type(m) is nn.Linear for m in model.modules()) == 8 and type(model.ln_f) is nn.LayerNorm


@pytest.mark.skipif(te_installed(), reason="Transformer Engine is installed here")
def test_import_te_names_the_install_command():
    from lightning_mp.fp8.support import import_te

    with pytest.raises(FP8UnavailableError, match=r"pip install \"lightning-mp\[fp8\]\""):
        import_te()
    with pytest.raises(FP8UnavailableError, match=r"pip install \"lightning-mp\[fp8\]\""):
        check_fp8_support(torch.device("cuda"), "delayed")  # no GPU here either: TE is the first blocker named


def test_package_imports_without_transformer_engine():
    import sys

    import lightning_mp  # noqa: F401

    assert "transformer_engine" not in sys.modules


# --------------------------------------------------------------------------------------------- recipes and state
def test_recipe_spec():
    assert recipe_spec(FP8Config(recipe="delayed", amax_history_len=16, fp8_format="E4M3")) == (
        "DelayedScaling", {"fp8_format": "E4M3", "margin": 0, "amax_history_len": 16, "amax_compute_algo": "max"}
    )
    assert recipe_spec(FP8Config(recipe="current")) == ("Float8CurrentScaling", {"fp8_format": "HYBRID"})
    assert recipe_spec(FP8Config(recipe="block")) == ("Float8BlockScaling", {"fp8_format": "E4M3"})
    assert recipe_spec(FP8Config(recipe="mxfp8")) == ("MXFP8BlockScaling", {"fp8_format": "E4M3"})
    assert recipe_spec(FP8Config(recipe="mxfp8", margin=1))[1] == {"fp8_format": "E4M3", "margin": 1}


def test_fit_amax_history():
    h = torch.arange(12.0).view(4, 3)
    assert fit_amax_history(h, 4) is h
    assert torch.equal(fit_amax_history(h, 2), h[:2])
    padded = fit_amax_history(h, 6)
    assert padded.shape == (6, 3) and torch.equal(padded[:4], h) and not padded[4:].any()


def test_scaling_state_compat():
    delayed = FP8Config().recipe_settings()
    assert scaling_state_compat(delayed, delayed) == (True, None)
    assert scaling_state_compat(None, delayed) == (False, None)
    restore, message = scaling_state_compat(delayed, FP8Config(recipe="current").recipe_settings())
    assert not restore and "written with recipe='delayed' and training resumes with recipe='current'" in message
    restore, message = scaling_state_compat(FP8Config(recipe="current").recipe_settings(), delayed)
    assert not restore and "recalibrates over the first 1024 steps" in message
    restore, message = scaling_state_compat(delayed, FP8Config(fp8_format="E4M3").recipe_settings())
    assert not restore and "fp8_format='HYBRID'" in message
    restore, message = scaling_state_compat(delayed, FP8Config(amax_history_len=16, margin=1).recipe_settings())
    assert restore and "amax_history_len 1024 -> 16" in message and "margin 0 -> 1" in message
    current = FP8Config(recipe="current").recipe_settings()
    assert scaling_state_compat(current, current) == (False, None)


def test_fp8_training_state_before_convert_and_errors(tmp_path):
    fp8 = FP8Training({"amax_history_len": 16})
    state = fp8.state_dict()
    assert state["modules"] == {} and state["recipe"]["amax_history_len"] == 16
    path = tmp_path / "fp8.pt"
    torch.save(state, path)
    assert torch.load(path, weights_only=True)["recipe"] == state["recipe"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8.load_state_dict(state)  # before convert: waits quietly
    assert fp8._pending is state
    fp8.load_state_dict(None)
    with pytest.raises(ValueError, match="checkpoint's FP8 state is corrupted"):
        fp8.load_state_dict({"modules": 3})


def test_layer_stats_read_transformer_engines_delayed_scaling_state():
    """FP8Training.layer_stats: per layer, the scale and latest amax of input, weight and output gradient as TE keeps
    them (fp8_meta, delayed scaling), and the headroom to the format's maximum (E4M3 448 forward, E5M2 57344 back)."""
    from types import SimpleNamespace

    from lightning_mp.fp8 import FP8Training

    class DelayedScaling:  # (TE's recipe class is recognised by its name or its delayed())
        fp8_format = "Format.HYBRID"

    layer = nn.Linear(4, 4)
    layer.fp8_meta = {
        "recipe": DelayedScaling(),
        "scaling_fwd": SimpleNamespace(scale=torch.tensor([2.0, 4.0, 1.0]),
                                       amax_history=torch.tensor([[112.0, 224.0, 0.0], [1.0, 1.0, 1.0]])),
        "scaling_bwd": SimpleNamespace(scale=torch.tensor([1024.0, 1.0]),
                                       amax_history=torch.tensor([[7.0, 0.0]])),
    }
    model = nn.Sequential(layer, nn.ReLU())
    fp8 = FP8Training()
    fp8._model = model
    stats = fp8.layer_stats()
    assert set(stats) == {"0"}
    s = stats["0"]
    assert (s["input_scale"], s["input_amax"], s["input_headroom"]) == (2.0, 112.0, 448.0 / 224.0)
    assert (s["weight_scale"], s["weight_amax"], s["weight_headroom"]) == (4.0, 224.0, 0.5)  # clipped: below 1
    assert (s["grad_scale"], s["grad_amax"], s["grad_headroom"]) == (1024.0, 7.0, 57344.0 / 7168.0)
    layer.fp8_meta["recipe"] = SimpleNamespace(delayed=lambda: False)  # current scaling keeps no state to read
    assert fp8.layer_stats() == {}
