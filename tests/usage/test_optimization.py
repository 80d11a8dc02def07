"""User-side tests of MPPlugin's promise about optimization.

    A step whose gradients hold an inf or NaN changes nothing (parameters, optimizer state including Adam's step
    count, LR schedulers), and otherwise the plugin changes nothing about how a LightningModule trains.

Everything here goes through public behaviour only: a Trainer, the model's weights, ``optimizer.state_dict()``,
the LR schedulers Lightning exposes, and ``plugin.stats``. Reference runs are Lightning's own
``precision="32-true"`` (no plugin) or a plain torch loop. Tiny models, a few steps each, CPU only.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import TensorDataset

from lightning_mp import MPPlugin, NonFiniteDetector, NonFiniteTrainingError

from .conftest import (
    OPT_MODES,
    OPT_SCALING_MODES,
    opt_all_finite,
    opt_assert_nested_equal,
    opt_dataset,
    opt_float,
    opt_loader,
    opt_params,
    opt_plugin,
    opt_state,
    opt_trainer,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*training_step. returned .None.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*GPU available but not used.*",
)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float())


# ======================================================================== 1. clipping

class OptClipModel(LightningModule):
    """Adam on a small MLP; ``poison`` batches get one inf in a gradient after backward; manual mode clips with
    ``self.clip_gradients`` before ``opt.step()``."""

    def __init__(self, manual: bool, algorithm: str, poison=(1,), clip: float = 0.5) -> None:
        super().__init__()
        self.net = _mlp()
        self.automatic_optimization = not manual
        self.algorithm = algorithm
        self.clip = clip
        self.poison = set(poison)
        self.before: list[tuple[dict, dict]] = []
        self.after: list[tuple[dict, dict]] = []

    @property
    def batch_no(self) -> int:
        return len(self.before) - 1

    def on_train_batch_start(self, batch, batch_idx):
        self.before.append((opt_params(self), opt_state(self.optimizers())))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after.append((opt_params(self), opt_state(self.optimizers())))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = _mse(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm=self.algorithm)
        opt.step()
        return None

    def on_after_backward(self) -> None:
        if self.batch_no in self.poison:
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return opt_loader(opt_dataset())


def _clip_cases():
    return [
        pytest.param(way, algorithm, mode, id=f"{way}-{algorithm}-{mode}")
        for way in ("automatic", "manual")
        for algorithm in ("value", "norm")
        for mode in OPT_MODES
    ]


@pytest.mark.parametrize(("way", "algorithm", "mode"), _clip_cases())
def test_clipping_does_not_hide_an_inf_gradient(way, algorithm, mode):
    model = OptClipModel(manual=way == "manual", algorithm=algorithm, poison=(1,))
    plugin = opt_plugin(mode)
    clip_args = {} if way == "manual" else dict(gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    trainer = opt_trainer(plugin, max_steps=3, **clip_args)
    trainer.fit(model)

    # the poisoned batch changed nothing: parameters and Adam's state (step count included), to the bit
    params_before, state_before = model.before[1]
    params_after, state_after = model.after[1]
    opt_assert_nested_equal(params_before, params_after, "parameters across the inf step")
    opt_assert_nested_equal(state_before, state_after, "Adam state across the inf step")
    assert plugin.stats.skipped_steps == 1
    assert plugin.stats.steps == 3
    # the clean batches were applied, and the weights stayed finite
    for i in (0, 2):
        assert not torch.equal(model.before[i][0]["net.0.weight"], model.after[i][0]["net.0.weight"])
    assert opt_all_finite(model.after[-1][0])
    assert int(model.after[-1][1]["state"][0]["step"]) == 2


# ======================================================================== 2. toggle_optimizer

class OptGAN(LightningModule):
    """Lightning's documented GAN pattern: manual optimization, toggle_optimizer, two Adam optimizers.

    The generator's loss, if it leaked into the discriminator, would give the discriminator's bias a gradient of
    ``+g_weight`` against the discriminator loss's ``-1``: a leak flips the sign of Adam's update.
    """

    def __init__(self, g_weight: float = 20.0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Linear(4, 4)
        self.discriminator = nn.Linear(4, 1)
        self.g_weight = g_weight
        self.gen_phase: list[dict] = []
        self.after_step: list[dict] = []

    def training_step(self, batch, batch_idx):
        z, real = batch
        opt_g, opt_d = self.optimizers()
        d_params = opt_params(self.discriminator)
        d_state = opt_state(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = self.g_weight * self.discriminator(self.generator(z)).float().mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        d_grads = [p.grad for p in self.discriminator.parameters()]
        d_grads += [p.grad for group in opt_d.param_groups for p in group["params"]]
        self.gen_phase.append(
            dict(
                params_before=d_params,
                params_after=opt_params(self.discriminator),
                state_before=d_state,
                state_after=opt_state(opt_d),
                grads=[None if g is None else g.detach().clone() for g in d_grads],
            )
        )

        self.toggle_optimizer(opt_d)
        d_loss = -self.discriminator(real).float().mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.after_step.append(dict(params=opt_float(opt_params(self)), d_state=opt_state(opt_d)))

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=5e-2),
            torch.optim.Adam(self.discriminator.parameters(), lr=5e-2),
        )

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        z = torch.randn(16, 4, generator=g)
        real = torch.randn(16, 4, generator=g).abs() + 0.5
        return opt_loader(TensorDataset(z, real), batch_size=8)


def _fit_gan(plugin=None, precision=None, initial=None) -> OptGAN:
    model = OptGAN()
    if initial is not None:
        model.load_state_dict(initial)
    trainer = opt_trainer(plugin, precision=precision, max_steps=-1, max_epochs=1, limit_train_batches=2)
    trainer.fit(model)
    return model


#: absolute tolerance of weights against the fp32 reference, per mode (half weights round to their ulp)
GAN_WEIGHT_ATOL = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 1e-3, "bf16-true": 8e-3, "fp16-true": 2e-3}


@pytest.mark.parametrize("mode", OPT_MODES)
def test_toggle_optimizer_keeps_the_generator_loss_out_of_the_discriminator(mode):
    torch.manual_seed(0)
    initial = copy.deepcopy(OptGAN().state_dict())
    reference = _fit_gan(precision="32-true", initial=initial)
    plugin = opt_plugin(mode)
    model = _fit_gan(plugin, initial=initial)

    assert len(model.gen_phase) == len(reference.gen_phase) == 2
    for step, phase in enumerate(model.gen_phase):
        # the generator's phase (backward + opt_g.step inside toggle_optimizer(opt_g)) leaves the
        # discriminator alone: its weights, its optimizer's state and its gradients
        for grad in phase["grads"]:
            assert grad is None or not grad.any(), (
                f"step {step}: the generator's backward gave the discriminator a gradient {grad.flatten().tolist()}"
            )
        opt_assert_nested_equal(phase["params_before"], phase["params_after"], f"step {step}: discriminator weights")
        opt_assert_nested_equal(phase["state_before"], phase["state_after"], f"step {step}: discriminator Adam state")

    atol = GAN_WEIGHT_ATOL[mode]
    for step, (ours, ref) in enumerate(zip(model.after_step, reference.after_step)):
        # opt_d.step() applied the discriminator loss alone: the same update as fp32, up to rounding
        for name in ("discriminator.bias", "discriminator.weight", "generator.weight", "generator.bias"):
            torch.testing.assert_close(
                ours["params"][name], ref["params"][name], atol=atol, rtol=0,
                msg=lambda m, name=name, step=step: f"step {step}, {name} vs the fp32 reference: {m}",
            )
        for index, ref_state in ref["d_state"]["state"].items():
            state = ours["d_state"]["state"][index]
            assert int(state["step"]) == int(ref_state["step"]) == step + 1
            torch.testing.assert_close(state["exp_avg"].float(), ref_state["exp_avg"], rtol=5e-2, atol=1e-4)
            torch.testing.assert_close(state["exp_avg_sq"].float(), ref_state["exp_avg_sq"], rtol=1e-1, atol=1e-6)
    assert plugin.stats.skipped_steps == 0


# ======================================================================== 3. one backward, two optimizers

class OptTwoPart(LightningModule):
    """One loss through two sub-models, one backward, two SGD optimizers stepped in turn."""

    def __init__(self, lr: float = 0.1, overflow=()) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
        self.lr = lr
        self.overflow = set(overflow)
        self.before: list[dict] = []
        self.after: list[dict] = []
        self.scales: list = []
        self.counts: list[tuple[int, int]] = []

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def on_train_batch_start(self, batch, batch_idx):
        self.before.append(opt_params(self))

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = _mse(self(x), y)
        if len(self.before) - 1 in self.overflow:
            loss = loss * 1e6  # finite in fp32; its scaled gradient overflows fp16
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after.append(opt_params(self))
        stats = self.trainer.precision_plugin.stats
        self.scales.append(stats.loss_scale)
        self.counts.append((stats.steps, stats.skipped_steps))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=self.lr), torch.optim.SGD(self.b.parameters(), lr=self.lr)

    def train_dataloader(self):
        return opt_loader(opt_dataset(n=24))


def _reference_update(model: OptTwoPart, i: int) -> dict[str, torch.Tensor]:
    """-lr * the fp32 gradient at the weights batch ``i`` started from (SGD: update = -lr * true gradient)."""
    ref = OptTwoPart()
    ref.load_state_dict(opt_float(model.before[i]))
    x, y = opt_dataset(n=24).tensors
    loss = _mse(ref(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8])
    loss.backward()
    return {n: -model.lr * p.grad for n, p in ref.named_parameters()}


def _assert_updates_match_fp32_sgd(model: OptTwoPart, i: int, mode: str) -> None:
    expected = _reference_update(model, i)
    before, after = opt_float(model.before[i]), opt_float(model.after[i])
    atol = 1.5e-3 if mode == "fp16-true" else 2e-4  # fp16 weights round each side of the update to their ulp
    for name, update in expected.items():
        torch.testing.assert_close(
            after[name] - before[name], update, atol=atol, rtol=1e-2,
            msg=lambda m, name=name: f"batch {i}, {name}: update vs lr * true gradient: {m}",
        )


@pytest.mark.parametrize("mode", OPT_SCALING_MODES)
def test_one_backward_two_optimizers_overflow_backs_off_once(mode):
    model = OptTwoPart(overflow=(1,))
    plugin = opt_plugin(mode, init_scale=2.0**10)
    opt_trainer(plugin, max_steps=-1, max_epochs=1, limit_train_batches=3).fit(model)

    assert model.scales[0] == 2.0**10
    _assert_updates_match_fp32_sgd(model, 0, mode)
    # the overflowing batch: both optimizers skip, the scale halves once
    opt_assert_nested_equal(model.before[1], model.after[1], "weights across the overflow")
    assert model.scales[1] == 2.0**9, f"loss scale after one overflowing batch: {model.scales[1]}, expected 512"
    steps_delta = model.counts[1][0] - model.counts[0][0]
    skipped_delta = model.counts[1][1] - model.counts[0][1]
    assert steps_delta > 0 and skipped_delta == steps_delta
    # the next clean batch: both optimizers unscale by the scale the loss was scaled with
    _assert_updates_match_fp32_sgd(model, 2, mode)
    assert model.counts[2][1] == model.counts[1][1]


@pytest.mark.parametrize("mode", OPT_SCALING_MODES)
def test_one_backward_two_optimizers_unscale_by_the_same_scale(mode):
    # growth_interval=1: the scale grows after every clean step; both optimizers must still unscale the
    # gradients of one backward by the scale that backward used
    model = OptTwoPart()
    plugin = opt_plugin(mode, init_scale=2.0**10, growth_interval=1)
    opt_trainer(plugin, max_steps=-1, max_epochs=1, limit_train_batches=3).fit(model)
    for i in range(3):
        _assert_updates_match_fp32_sgd(model, i, mode)
    assert plugin.stats.skipped_steps == 0


# ======================================================================== 4. NaN made in hooks

class OptHookNaN(LightningModule):
    """Adam on a small MLP; on batch ``poison`` a user hook writes NaN into a gradient the optimizer steps."""

    def __init__(self, where: str, poison: int = 1) -> None:
        super().__init__()
        self.net = _mlp()
        self.where = where
        self.poison = poison
        self.batch_no = -1
        self.skipped: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_no += 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.precision_plugin.stats.skipped:
            self.skipped.append(self.batch_no)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return _mse(self.net(x), y)

    def _write_nan(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.view(-1)[0] = math.nan
                    return
        raise AssertionError("the optimizer holds no gradient to write into")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.where == "on_before_optimizer_step" and self.batch_no == self.poison:
            self._write_nan(optimizer)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )
        if self.where == "configure_gradient_clipping" and self.batch_no == self.poison:
            self._write_nan(optimizer)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return opt_loader(opt_dataset())


def _hook_cases():
    return [
        pytest.param(where, mode, id=f"{where}-{mode}")
        for where in ("on_before_optimizer_step", "configure_gradient_clipping")
        for mode in OPT_MODES
    ]


def _fit_hook_nan(where: str, mode: str, initial: dict, callbacks=()) -> tuple[OptHookNaN, object]:
    model = OptHookNaN(where)
    model.load_state_dict(initial)
    plugin = opt_plugin(mode)
    clip = dict(gradient_clip_val=1.0) if where == "configure_gradient_clipping" else {}
    trainer = opt_trainer(plugin, max_steps=4, callbacks=callbacks, **clip)
    trainer.fit(model)
    return model, trainer


@pytest.mark.parametrize(("where", "mode"), _hook_cases())
def test_nan_written_by_a_hook_is_skipped_with_and_without_detector(where, mode):
    torch.manual_seed(0)
    initial = copy.deepcopy(OptHookNaN(where).state_dict())
    plain, plain_trainer = _fit_hook_nan(where, mode, initial)
    assert plain.skipped == [1], f"without NonFiniteDetector the skipped batches are {plain.skipped}, expected [1]"
    assert opt_all_finite(opt_params(plain))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        watched, watched_trainer = _fit_hook_nan(where, mode, initial, callbacks=[NonFiniteDetector()])
    assert watched.skipped == plain.skipped, f"with NonFiniteDetector: {watched.skipped}, without: {plain.skipped}"
    opt_assert_nested_equal(opt_params(plain), opt_params(watched), "final weights with vs without the detector")
    opt_assert_nested_equal(
        opt_state(plain_trainer.optimizers[0]), opt_state(watched_trainer.optimizers[0]), "Adam state with vs without"
    )
    assert int(opt_state(plain_trainer.optimizers[0])["state"][0]["step"]) == 3


# ======================================================================== 5. closure-taking optimizers
class OptSAM(torch.optim.Optimizer):
    """A minimal SAM: perturb along the current gradient, evaluate the closure there, restore, then step with the
    gradient at the perturbed point. The closure is required."""

    def __init__(self, params, lr: float = 0.05, rho: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure):  # no default: calling it without a closure is a TypeError
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
        moved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                e = (p.grad.float() * (group["rho"] / (norm + 1e-12))).to(p.dtype)
                p.add_(e)
                moved.append((p, e))
        with torch.enable_grad():
            loss = closure()
        for p, e in moved:
            p.sub_(e)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.to(p.dtype), alpha=-group["lr"])
        return loss


class OptSAMModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = _mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(_mse(self.net(x), y))

        def closure():
            opt.zero_grad()
            loss = _mse(self.net(x), y) * self.closure_factor(batch_idx)
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)

    def closure_factor(self, batch_idx: int) -> float:
        return 1.0

    def configure_optimizers(self):
        return OptSAM(self.parameters())

    def train_dataloader(self):
        return opt_loader(opt_dataset())


SAM_STEPS = 8


def _full_loss(net: nn.Module) -> float:
    x, y = opt_dataset().tensors
    with torch.no_grad():
        return float(_mse(copy.deepcopy(net).float()(x), y))


def _plain_torch_sam(initial: dict) -> nn.Module:
    net = _mlp()
    net.load_state_dict({k[len("net.") :]: v for k, v in initial.items()})
    opt = OptSAM(net.parameters())
    steps = 0
    while steps < SAM_STEPS:
        for x, y in opt_loader(opt_dataset()):
            if steps == SAM_STEPS:
                break
            opt.zero_grad()
            _mse(net(x), y).backward()

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = _mse(net(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            steps += 1
    return net


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-true"])
def test_closure_taking_optimizer_trains(mode):
    torch.manual_seed(0)
    model = OptSAMModel()
    initial = copy.deepcopy(model.state_dict())
    loss_before = _full_loss(model.net)
    plugin = opt_plugin(mode)
    opt_trainer(plugin, max_steps=SAM_STEPS).fit(model)
    loss_after = _full_loss(model.net)
    assert loss_after < 0.8 * loss_before, (loss_before, loss_after)
    if mode == "fp32":
        reference = _plain_torch_sam(initial)
        opt_assert_nested_equal(opt_params(model.net), opt_params(reference), "SAM weights vs plain torch")


class OptSAMPoisoned(OptSAMModel):
    """The closure's gradient (at SAM's perturbed point) is NaN on one batch: that step must change nothing."""

    def closure_factor(self, batch_idx: int) -> float:
        return math.nan if batch_idx == 2 else 1.0


@pytest.mark.parametrize(
    ("mode", "kind"), [("fp32", None), ("bf16", None), ("bf16-true", "fp32"), ("bf16-true", "kahan")]
)
def test_closure_taking_optimizer_skips_a_poisoned_evaluation(mode, kind):
    model = OptSAMPoisoned()
    plugin = MPPlugin(mode, **({"master_weights": kind} if kind else {}))
    seen = []

    class Weights(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    opt_trainer(plugin, max_steps=4, callbacks=[Weights()]).fit(model)
    assert plugin.stats.skipped_steps == 1 and plugin.stats.steps == 4
    opt_assert_nested_equal(seen[2], seen[1], "weights across the poisoned SAM step")
    assert not torch.equal(seen[3]["net.0.weight"], seen[2]["net.0.weight"])
    if kind == "fp32":  # the masters did not move either: the weights are still their rounding
        for p in model.parameters():
            master = plugin.masters.master_of(p)
            assert master is None or torch.equal(master.to(p.dtype), p)


@pytest.mark.parametrize("mode", OPT_SCALING_MODES)
def test_closure_taking_optimizer_under_fp16_trains_or_says_why_not(mode):
    torch.manual_seed(0)
    model = OptSAMModel()
    loss_before = _full_loss(model.net)
    plugin = opt_plugin(mode)
    try:
        opt_trainer(plugin, max_steps=SAM_STEPS).fit(model)
    except Exception as err:  # a clear refusal is acceptable: it must name the closure and the mode
        message = str(err)
        assert "closure" in message and "fp16" in message, f"{type(err).__name__}: {message}"
        return
    assert _full_loss(model.net) < 0.8 * loss_before


# ======================================================================== 6. divergence stop per optimizer

class OptTwoHeads(LightningModule):
    """Two independent heads, one backward of their summed losses: head ``a``'s gradients are NaN every step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = math.nan * _mse(self.a(x), y) + _mse(self.b(x), y)
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)

    def train_dataloader(self):
        return opt_loader(opt_dataset())


@pytest.mark.parametrize("mode", OPT_MODES)
def test_divergence_stop_counts_each_optimizers_streak(mode):
    model = OptTwoHeads()
    plugin = opt_plugin(mode, max_consecutive_skips=3)
    trainer = opt_trainer(plugin, max_steps=-1, max_epochs=5)
    with pytest.raises(NonFiniteTrainingError):
        trainer.fit(model)
    assert model.batches in (3, 4), f"stopped after {model.batches} batches"


# ======================================================================== 7. accumulation

class OptAccum(LightningModule):
    """SGD on a small MLP with gradient accumulation; ``none`` batches return None from training_step,
    ``poison`` batches get one inf in a gradient."""

    def __init__(self, none=(), poison=(), scheduler: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.net = _mlp()
        self.none = set(none)
        self.poison = set(poison)
        self.scheduler = scheduler
        self.lr = lr
        self.batch_no = -1
        self.calls = {"on_before_optimizer_step": 0, "configure_gradient_clipping": 0}
        self.windows: list[dict] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_no += 1
        if self.batch_no == 0:
            self.initial = opt_params(self)  # as converted by the plugin (half weights in true-half modes)

    def training_step(self, batch, batch_idx):
        if self.batch_no in self.none:
            return None
        x, y = batch
        return _mse(self.net(x), y)

    def on_after_backward(self) -> None:
        if self.batch_no in self.poison:
            self.net[0].weight.grad[0, 0] = math.inf

    def on_before_optimizer_step(self, optimizer) -> None:
        self.calls["on_before_optimizer_step"] += 1

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        self.calls["configure_gradient_clipping"] += 1
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.batch_no % 2 == 1:  # the end of a window of 2 micro-batches (LR schedulers have stepped)
            record = dict(params=opt_params(self))
            if self.scheduler:
                sched = self.lr_schedulers()
                record.update(last_epoch=sched.last_epoch, lr=self.optimizers().param_groups[0]["lr"])
            self.windows.append(record)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return opt_loader(opt_dataset(n=48))


@pytest.mark.parametrize("mode", ("fp32", "bf16"))
def test_none_on_the_last_microbatch_steps_like_lightning(mode):
    torch.manual_seed(0)
    initial = copy.deepcopy(OptAccum().state_dict())

    def fit(plugin=None, precision=None) -> OptAccum:
        model = OptAccum(none=(1,))
        model.load_state_dict(initial)
        trainer = opt_trainer(
            plugin, precision=precision, max_steps=2, accumulate_grad_batches=2, gradient_clip_val=100.0
        )
        trainer.fit(model)
        return model

    reference = fit(precision="32-true")
    model = fit(opt_plugin(mode))
    assert reference.calls == {"on_before_optimizer_step": 2, "configure_gradient_clipping": 2}
    # the first window's step used micro-batch 0's gradients, as Lightning's does
    for w, (ours, ref) in enumerate(zip(model.windows, reference.windows)):
        if mode == "fp32":
            opt_assert_nested_equal(ours["params"], ref["params"], f"window {w}: weights vs precision='32-true'")
        else:
            torch.testing.assert_close(ours["params"], ref["params"], atol=2e-3, rtol=1e-2,
                                       msg=lambda m, w=w: f"window {w}: weights vs precision='32-true': {m}")
    assert model.calls == reference.calls


@pytest.mark.parametrize("mode", OPT_MODES)
def test_scheduler_steps_on_the_window_after_a_skipped_one(mode):
    torch.manual_seed(0)
    model = OptAccum(poison=(0,), none=(3,), scheduler=True)
    plugin = opt_plugin(mode)
    opt_trainer(plugin, max_steps=3, accumulate_grad_batches=2).fit(model)
    lr = model.lr
    w0, w1, w2 = model.windows
    # window 0 (an inf in micro-batch 0) is skipped: weights and the scheduler held
    opt_assert_nested_equal(model.initial, w0["params"], "weights across the skipped window")
    assert (w0["last_epoch"], w0["lr"]) == (0, lr)
    # window 1 ends in a training_step returning None: it steps with micro-batch 2's gradients, and the
    # scheduler steps with it
    assert (w1["last_epoch"], w1["lr"]) == (1, lr * 0.5), f"after the clean window: {w1['last_epoch'], w1['lr']}"
    assert not torch.equal(w1["params"]["net.0.weight"], w0["params"]["net.0.weight"])
    assert (w2["last_epoch"], w2["lr"]) == (2, lr * 0.25)
    assert plugin.stats.skipped_steps == 1


# ======================================================================== 8. LR schedulers
class OptSchedModel(LightningModule):
    """Adam + a step-interval StepLR; batch ``poison`` gets one inf in a gradient."""

    def __init__(self, poison: int = 1, lr: float = 1e-2) -> None:
        super().__init__()
        self.net = _mlp()
        self.poison = poison
        self.lr = lr
        self.before: list[tuple] = []
        self.after: list[tuple] = []

    def _snapshot(self) -> tuple:
        opt = self.optimizers()
        return opt_params(self), opt_state(opt), self.lr_schedulers().last_epoch, opt.param_groups[0]["lr"]

    def on_train_batch_start(self, batch, batch_idx):
        self.before.append(self._snapshot())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.after.append(self._snapshot())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return _mse(self.net(x), y)

    def on_after_backward(self) -> None:
        if len(self.before) - 1 == self.poison:
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return opt_loader(opt_dataset())


@pytest.mark.parametrize("mode", OPT_MODES)
def test_skipped_step_holds_the_step_interval_scheduler(mode):
    model = OptSchedModel(poison=1)
    plugin = opt_plugin(mode)
    opt_trainer(plugin, max_steps=4).fit(model)
    lr = model.lr
    assert [a[2] for a in model.after] == [1, 1, 2, 3]
    assert [a[3] for a in model.after] == [lr * 0.5, lr * 0.5, lr * 0.25, lr * 0.125]
    params_before, state_before, _, _ = model.before[1]
    params_after, state_after, _, _ = model.after[1]
    opt_assert_nested_equal(params_before, params_after, "weights across the skipped step")
    opt_assert_nested_equal(state_before, state_after, "Adam state across the skipped step")
    assert int(state_after["state"][0]["step"]) == 1
    assert int(model.after[-1][1]["state"][0]["step"]) == 3
    assert (plugin.stats.steps, plugin.stats.skipped_steps) == (4, 1)
