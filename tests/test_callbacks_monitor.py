"""PrecisionMonitor in a real Trainer on the CPU: metric names and values in a CSVLogger file, with MPPlugin,
Lightning's native 16-mixed (a real fp16 GradScaler) and bf16-mixed, per-layer figures, cost and the plot."""

import csv
import math
import multiprocessing
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import TinyRegressor, make_trainer
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import MPPlugin
from lightning_mp.callbacks import PrecisionMonitor
from lightning_mp.callbacks import monitor as monitor_module
from lightning_mp.stats import StepStats

FP16_TINY = 2.0**-14


def read_csv(root: Path) -> list[dict[str, str]]:
    (path,) = [Path(d) / f for d, _, files in os.walk(root) for f in files if f == "metrics.csv"]
    with open(path) as fh:
        return list(csv.DictReader(fh))


def precision_rows(root: Path) -> list[dict[str, str]]:
    return [r for r in read_csv(root) if r.get("precision/skipped_steps")]


def fit(tmp_path, plugin=None, callbacks=(), max_steps=8, model=None, **kwargs):
    trainer = make_trainer(
        plugin, max_steps=max_steps, callbacks=callbacks, logger=CSVLogger(tmp_path), log_every_n_steps=2, **kwargs
    )
    trainer.fit(model or TinyRegressor())
    return trainer


def native_fp16(init_scale=1024.0):
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


# poisoned batches 1, 4, 5 -> optimizer steps 2, 5 and 6 overflow; logged after steps 2, 4, 6, 8
EXPECTED = {
    "step": ["1", "3", "5", "7"],  # the index Lightning logs optimizer step k's metrics at: k - 1
    "precision/skipped_steps": [1, 1, 3, 3],
    "precision/consecutive_skips": [1, 0, 2, 0],
    "precision/skip_rate": [0.5, 0.0, 1.0, 0.0],
    "precision/loss_scale": [512.0, 512.0, 128.0, 128.0],
}


def assert_expected(rows):
    assert [r["step"] for r in rows] == EXPECTED["step"]
    for name in ("precision/skipped_steps", "precision/consecutive_skips"):
        assert [int(float(r[name])) for r in rows] == EXPECTED[name], name
    for name in ("precision/skip_rate", "precision/loss_scale"):
        assert [float(r[name]) for r in rows] == EXPECTED[name], name
    # the logging steps 2 and 6 overflowed: their gradient norm says so
    assert [math.isfinite(float(r["precision/grad_norm"])) for r in rows] == [False, True, False, True]
    assert float(rows[1]["precision/grad_norm"]) > 0 and float(rows[3]["precision/grad_norm"]) > 0


def test_mpplugin_fp16_values_in_the_csv_file(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=2)
    plugin = MPPlugin("fp16", init_scale=1024.0)
    fit(tmp_path, plugin, [monitor], model=TinyRegressor(poison_loss=(1, 4, 5)))
    rows = precision_rows(tmp_path)
    assert_expected(rows)
    assert plugin.stats.skipped_steps == 3 and plugin.stats.loss_scale == 128.0
    assert monitor.history == [(2, 512.0, 1), (4, 512.0, 1), (6, 128.0, 3), (8, 128.0, 3)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_native_16_mixed_scaler_values_in_the_csv_file(tmp_path, optimizer):
    # a real fp16 GradScaler on the CPU; with a fused optimizer it unscales inside the step
    monitor = PrecisionMonitor(log_every_n_steps=2)
    trainer = fit(tmp_path, native_fp16(), [monitor], model=TinyRegressor(poison_loss=(1, 4, 5), optimizer=optimizer))
    assert_expected(precision_rows(tmp_path))
    assert trainer.scaler.get_scale() == 128.0


def test_grad_norm_is_unscaled_with_fused_and_plain_optimizers(tmp_path):
    norms = {}
    for optimizer in ("adam", "adamw_fused"):
        monitor = PrecisionMonitor(log_every_n_steps=1)
        torch.manual_seed(0)
        model = TinyRegressor(optimizer=optimizer)
        fit(tmp_path / optimizer, native_fp16(init_scale=2.0**12), [monitor], max_steps=1, model=model)
        norms[optimizer] = monitor.last["precision/grad_norm"]
    # the first step: same weights, same batch; the fused path divides the scaled gradients by the scale
    assert norms["adamw_fused"] == pytest.approx(norms["adam"], rel=1e-3)
    model = TinyRegressor()
    x, y = next(iter(model.train_dataloader()))
    torch.manual_seed(0)
    reference = TinyRegressor().eval()  # eval: no poison bookkeeping, no trainer needed
    torch.nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert norms["adam"] == pytest.approx(float(expected), rel=2e-2)  # fp16 autocast vs fp32


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_native_plugins_without_a_scaler(tmp_path, precision):
    # on the CPU Lightning turns "16-mixed" into bf16-mixed: no scaler, nothing skipped
    monitor = PrecisionMonitor()
    trainer = fit(tmp_path, None, [monitor], precision=precision)
    assert trainer.scaler is None
    rows = precision_rows(tmp_path)
    assert [r["step"] for r in rows] == ["1", "3", "5", "7"]  # Trainer(log_every_n_steps=2) is the default
    assert "precision/loss_scale" not in rows[0] or rows[0]["precision/loss_scale"] == ""
    assert {float(r["precision/skipped_steps"]) for r in rows} == {0.0}
    assert {float(r["precision/skip_rate"]) for r in rows} == {0.0}
    assert all(float(r["precision/grad_norm"]) > 0 for r in rows)


def test_mpplugin_bf16_skips_are_counted_without_a_loss_scale(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=4)
    fit(tmp_path, MPPlugin("bf16"), [monitor], model=TinyRegressor(poison_grad=(2,), poison_value=math.nan))
    rows = precision_rows(tmp_path)
    assert [(r["step"], float(r["precision/skipped_steps"]), float(r["precision/skip_rate"])) for r in rows] == [
        ("3", 1.0, 0.25),
        ("7", 1.0, 0.0),
    ]
    assert rows[0].get("precision/loss_scale", "") == ""


class LayerProbe(Callback):
    """Independent per-layer figures of chosen steps: outputs via hooks, gradients before the step."""

    def __init__(self, steps, scale=1.0):
        self.steps, self.scale = steps, scale
        self.act, self.grad, self.handles = {}, {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 in self.steps:
            for name in ("net1", "net2"):
                module = getattr(pl_module, name)
                hook = lambda m, a, out, n=name: self.act.__setitem__(n, out.detach().float())  # noqa: E731
                self.handles.append(module.register_forward_hook(hook))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step + 1 in self.steps:
            for name in ("net1", "net2"):
                module = getattr(pl_module, name)
                self.grad[name] = torch.cat([p.grad.detach().flatten().float() for p in module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for h in self.handles:
            h.remove()
        self.handles = []


def test_layer_figures_match_an_independent_computation(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=3, layer_stats=True)
    probe = LayerProbe({3})
    plugin = MPPlugin("fp16", init_scale=2.0**6, growth_interval=100)
    fit(tmp_path, plugin, [monitor, probe], max_steps=3, model=TinyRegressor())
    rows = precision_rows(tmp_path)
    assert len(rows) == 1
    row = {k: float(v) for k, v in rows[0].items() if v != ""}
    for name in ("net1", "net2"):
        act, grad = probe.act[name], probe.grad[name]
        absmax = float(act.abs().max())
        assert row[f"precision/act_absmax/{name}"] == pytest.approx(absmax)
        assert row[f"precision/act_headroom/{name}"] == pytest.approx(math.log2(65504.0 / absmax))
        assert row[f"precision/act_nonfinite/{name}"] == 0.0
        gmax = float(grad.abs().max())
        assert row[f"precision/grad_absmax/{name}"] == pytest.approx(gmax)
        assert row[f"precision/grad_headroom/{name}"] == pytest.approx(math.log2(65504.0 / (gmax * 2.0**6)))
        underflow = float((grad.abs() * 2.0**6 < FP16_TINY).float().mean())
        assert row[f"precision/grad_underflow/{name}"] == pytest.approx(underflow)
        assert row[f"precision/grad_nonfinite/{name}"] == 0.0
    # relu makes some of net2's inputs zero, but never whole gradient columns of net1: a sanity bound
    assert 0.0 <= row["precision/grad_underflow/net1"] < 1.0


def test_layer_figures_show_zeros_and_non_finite_values(tmp_path):
    model = TinyRegressor()
    with torch.no_grad():
        model.net2.weight.zero_()  # net1 then gets all-zero gradients: 100 % underflow, infinite headroom
    monitor = PrecisionMonitor(log_every_n_steps=1, layer_stats=True, layers=r"^net\d$")
    fit(tmp_path / "zeros", MPPlugin("fp32"), [monitor], max_steps=1, model=model)
    assert monitor.last["precision/grad_underflow/net1"] == 1.0
    assert monitor.last["precision/grad_headroom/net1"] == math.inf

    monitor = PrecisionMonitor(log_every_n_steps=1, layer_stats=True, layers=r"^net\d$")
    fit(tmp_path / "inf", MPPlugin("fp32"), [monitor], max_steps=1, model=TinyRegressor(poison_activation=(0,)))
    last = monitor.last
    # one inf in net2's 8 x 32 input: one of its 8 outputs is non-finite
    assert last["precision/act_nonfinite/net2"] == pytest.approx(1 / 8)
    assert last["precision/act_headroom/net2"] == -math.inf or math.isnan(last["precision/act_headroom/net2"])
    assert last["precision/act_nonfinite/net1"] == 0.0


def test_costs_nothing_between_logging_steps(tmp_path, monkeypatch):
    reads = []
    original = StepStats.as_dict
    monkeypatch.setattr(StepStats, "as_dict", lambda self: reads.append(1) or original(self))
    for prop in ("skipped", "skipped_steps", "consecutive_skips", "steps", "loss_scale"):
        monkeypatch.setattr(StepStats, prop, property(lambda self, p=prop: pytest.fail(f"StepStats.{p} read")))
    hooks_seen = []

    class HookCount(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            hooks_seen.append(len(pl_module.net1._forward_hooks))

    monitor = PrecisionMonitor(log_every_n_steps=4, layer_stats=True)
    fit(tmp_path, MPPlugin("fp16"), [monitor, HookCount()], max_steps=8)
    assert len(reads) == 2  # steps 4 and 8: one StepStats copy each
    assert hooks_seen == [0, 0, 0, 1, 0, 0, 0, 1]  # layer hooks only during logging steps
    assert len(monitor._hooks) == 0


def test_accumulation_logs_once_per_optimizer_step(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=2)
    model = TinyRegressor(poison_loss=(2,))
    fit(tmp_path, native_fp16(), [monitor], max_steps=4, accumulate_grad_batches=2, model=model)
    rows = precision_rows(tmp_path)
    # optimizer step 2 holds micro-batches 2 and 3 (batch 2 poisoned): one skip
    assert [(r["step"], float(r["precision/skipped_steps"]), float(r["precision/loss_scale"])) for r in rows] == [
        ("1", 1.0, 512.0),
        ("3", 1.0, 512.0),
    ]


def test_native_counters_survive_resume(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=2)
    trainer = fit(tmp_path / "a", native_fp16(), [monitor], max_steps=4, model=TinyRegressor(poison_loss=(1,)))
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"]["PrecisionMonitor"]
    assert state["native_skipped_steps"] == 1 and state["history"] == [[2, 512.0, 1], [4, 512.0, 1]]

    resumed = PrecisionMonitor(log_every_n_steps=2)
    logger = CSVLogger(tmp_path / "b")
    trainer = make_trainer(native_fp16(), max_steps=8, callbacks=[resumed], logger=logger, log_every_n_steps=2)
    trainer.fit(TinyRegressor(poison_loss=(1, 5), batches_by_index=True), ckpt_path=path)
    assert resumed.history[-1] == (8, 256.0, 2)
    assert resumed.last["precision/skip_rate"] == 0.0 and resumed.history[-2] == (6, 256.0, 2)


def test_plot_is_written_at_the_end_of_fit(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "precision.png"
    monitor = PrecisionMonitor(log_every_n_steps=1, plot=str(path))
    fit(tmp_path, native_fp16(), [monitor], model=TinyRegressor(poison_loss=(2,)))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_is_picklable_and_arguments_are_validated():
    pickle.dumps(PrecisionMonitor(layer_stats=True, layers="net"))
    for kwargs, fragment in [
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"log_every_n_steps": True}, "log_every_n_steps=True"),
        ({"log_every_n_steps": "5"}, "log_every_n_steps='5'"),
        ({"layer_stats": "yes"}, "layer_stats='yes'"),
        ({"layers": "("}, "not a valid regular expression"),
        ({"plot": ""}, "plot=''"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("'", "'")):
            PrecisionMonitor(**kwargs)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_agrees_across_ddp_ranks(tmp_path, monkeypatch):
    """Two CPU processes see different batches; every rank computes the same figures (the maxima over ranks).

    ``ddp_fork``: the workers inherit the imported modules, so the test takes a second, not twenty.
    """
    out = tmp_path / "ranks"
    out.mkdir()

    trainer = make_trainer(
        MPPlugin("fp16", init_scale=256.0),
        max_steps=2,
        callbacks=[PrecisionMonitor(log_every_n_steps=2, layer_stats=True), _RankDump(str(out))],
        strategy="ddp_fork",
        devices=2,
        logger=CSVLogger(tmp_path / "logs"),
    )
    torch.manual_seed(0)
    trainer.fit(TinyRegressor())
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["last"] == ranks[1]["last"]
    for name in ("net1", "net2"):
        local = [r["local_act_max"][name] for r in ranks]
        assert local[0] != local[1]  # different data on each rank
        assert ranks[0]["last"][f"precision/act_absmax/{name}"] == pytest.approx(max(local))

    # sharded gradients (FSDP): the norm over all shards is the root of the sum of the ranks' squares; here
    # DDP's replicated gradients stand in for two shards, so it comes out sqrt(2) times the replicated norm
    monkeypatch.setattr(monitor_module, "_grads_are_sharded", lambda trainer: True)
    trainer = make_trainer(
        MPPlugin("fp16", init_scale=256.0),
        max_steps=2,
        callbacks=[PrecisionMonitor(log_every_n_steps=2), _RankDump(str(out))],
        strategy="ddp_fork",
        devices=2,
        logger=CSVLogger(tmp_path / "logs_sharded"),
    )
    torch.manual_seed(0)
    trainer.fit(TinyRegressor())
    sharded = torch.load(out / "rank0.pt", weights_only=True)["last"]["precision/grad_norm"]
    assert sharded == pytest.approx(math.sqrt(2) * ranks[0]["last"]["precision/grad_norm"], rel=1e-6)


class _RankDump(Callback):
    def __init__(self, folder):
        self.folder, self.local, self.handles = folder, {}, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            for name in ("net1", "net2"):
                def hook(m, a, out, n=name):
                    self.local[n] = float(out.detach().abs().max())

                self.handles.append(getattr(pl_module, name).register_forward_hook(hook))

    def on_train_end(self, trainer, pl_module):
        monitor = next(c for c in trainer.callbacks if isinstance(c, PrecisionMonitor))
        path = os.path.join(self.folder, f"rank{trainer.global_rank}.pt")
        torch.save({"last": monitor.last, "local_act_max": self.local}, path)


@pytest.mark.parametrize("kind", ["fp32", "kahan"])
def test_layer_gradient_figures_in_true_half_with_master_weights(tmp_path, kind):
    """Master weights are invisible: the model's parameters carry the gradients the monitor reads per layer."""
    monitor = PrecisionMonitor(log_every_n_steps=1, layer_stats=True, layers=r"^net\d$")
    fit(tmp_path, MPPlugin("bf16-true", master_weights=kind), [monitor], max_steps=2)
    grads = {k: v for k, v in monitor.last.items() if k.startswith("precision/grad_") and k.endswith(("net1", "net2"))}
    assert grads and all(math.isfinite(v) for v in grads.values()), monitor.last
    assert monitor.last["precision/grad_underflow/net1"] < 1.0  # real gradients, not missing ones


# ---------------------------------------------------------------------------------------------- Lightning's logging
def test_figures_reach_callback_metrics_so_early_stopping_and_checkpoints_watch_them(tmp_path):
    """A skip rate above 0.5 stops training (EarlyStopping's divergence threshold); ModelCheckpoint ranks by the
    gradient norm. Both read ``trainer.callback_metrics``, where the monitor's figures land."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    monitor = PrecisionMonitor(log_every_n_steps=2)
    stop = EarlyStopping(
        monitor="precision/skip_rate", mode="min", divergence_threshold=0.5, patience=100, check_on_train_epoch_end=True
    )
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="precision/grad_norm", mode="min", every_n_train_steps=2)
    # 8 batches an epoch: in the second epoch the last logging window (batches 14 and 15) is all skipped steps
    model = TinyRegressor(poison_grad=(14, 15), poison_value=math.nan)
    trainer = make_trainer(
        MPPlugin("bf16"), max_steps=-1, max_epochs=5, callbacks=[monitor, stop, best], logger=CSVLogger(tmp_path),
        enable_checkpointing=True, log_every_n_steps=2,
    )  # fmt: skip
    trainer.fit(model)
    assert stop.stopped_epoch == 1 and trainer.current_epoch == 2  # stopped after the second of five epochs
    metrics = trainer.callback_metrics
    assert float(metrics["precision/skip_rate"]) == 1.0 and int(metrics["precision/skipped_steps"]) == 2
    assert {f"precision/{name}" for name in ("skipped_steps", "skip_rate", "consecutive_skips")} <= set(metrics)
    assert best.best_model_score is not None and math.isfinite(float(best.best_model_score))
    assert Path(best.best_model_path).is_file()
    # the loggers still get the figures at the monitor's own steps, once each
    assert [r["step"] for r in precision_rows(tmp_path)] == [str(s) for s in range(1, 16, 2)]


@pytest.mark.parametrize("prog_bar", [False, True])
def test_prog_bar_shows_the_scalar_figures_on_request(tmp_path, prog_bar):
    monitor = PrecisionMonitor(log_every_n_steps=1, layer_stats=True, prog_bar=prog_bar)
    trainer = fit(tmp_path, MPPlugin("fp16"), [monitor], max_steps=2)
    shown = {k for k in trainer.progress_bar_metrics if k.startswith("precision/")}
    # loss scale, skips, grad norm (spike_skips only with the loss-spike guard on)
    expected = {f"precision/{name}" for name in monitor_module.SCALAR_NAMES if name != "spike_skips"}
    assert shown == (expected if prog_bar else set())
    assert "precision/act_absmax/net1" in trainer.callback_metrics  # per-layer figures: callback metrics only
    with pytest.raises(ValueError, match="prog_bar='yes' is invalid"):
        PrecisionMonitor(prog_bar="yes")


def test_a_trainer_without_a_logger_is_refused_when_fit_starts():
    trainer = make_trainer(MPPlugin("bf16"), callbacks=[PrecisionMonitor()])  # conftest's Trainer: logger=False
    with pytest.raises(MisconfigurationException, match=r"Cannot use `PrecisionMonitor` callback with `Trainer` that"
                       r" has no logger\."):  # fmt: skip
        trainer.fit(TinyRegressor())
    trainer.validate(TinyRegressor())  # only fit logs: validate runs without a logger


def test_plot_says_why_it_drew_nothing(tmp_path):
    path = tmp_path / "precision.png"
    with pytest.warns(UserWarning, match=r"drew nothing: no logging step ran: fit made 4 optimizer steps and the"
                      r" monitor logs every 50"):  # fmt: skip
        fit(tmp_path, MPPlugin("bf16"), [PrecisionMonitor(log_every_n_steps=50, plot=str(path))], max_steps=4)
    assert not path.exists()
    pytest.importorskip("matplotlib")
    unwritable = tmp_path / "no such folder" / "precision.png"
    with pytest.warns(UserWarning, match="could not write the plot"):
        fit(tmp_path, MPPlugin("bf16"), [PrecisionMonitor(log_every_n_steps=1, plot=str(unwritable))], max_steps=2)


SKIP_FIGURES = ("precision/skipped_steps", "precision/skip_rate", "precision/consecutive_skips", "precision/loss_scale")


@pytest.mark.parametrize(("first", "second"), [("mp", "native"), ("native", "native"), ("mp", "mp"), ("native", "mp")])
def test_a_second_fit_with_another_plugin_logs_what_a_fresh_monitor_logs(tmp_path, first, second):
    """The skip figures count the plugin of the run: a monitor used again with another plugin starts afresh."""
    plugins = {"mp": lambda: MPPlugin("fp16", init_scale=1024.0), "native": native_fp16}
    reused = PrecisionMonitor(log_every_n_steps=2)
    fit(tmp_path / "first", plugins[first](), [reused], model=TinyRegressor(poison_loss=(1, 4, 5)))
    assert reused.last["precision/skipped_steps"] == 3
    fit(tmp_path / "second", plugins[second](), [reused], max_steps=4, model=TinyRegressor(poison_loss=(1,)))
    fresh = PrecisionMonitor(log_every_n_steps=2)
    fit(tmp_path / "fresh", plugins[second](), [fresh], max_steps=4, model=TinyRegressor(poison_loss=(1,)))

    def figures(root):
        return [{name: float(row[name]) for name in SKIP_FIGURES} for row in precision_rows(root)]

    assert figures(tmp_path / "fresh") == [
        {"precision/skipped_steps": 1, "precision/skip_rate": 0.5, "precision/consecutive_skips": 1,
         "precision/loss_scale": 512.0},
        {"precision/skipped_steps": 1, "precision/skip_rate": 0.0, "precision/consecutive_skips": 0,
         "precision/loss_scale": 512.0},
    ]  # fmt: skip
    assert figures(tmp_path / "second") == figures(tmp_path / "fresh")
    assert reused.history == fresh.history == [(2, 512.0, 1), (4, 512.0, 1)]
    assert pickle.loads(pickle.dumps(reused)).history == reused.history  # (it remembers the plugin weakly)


class LogsItsLoss(TinyRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.detach())
        return loss


@pytest.mark.parametrize(("monitor_every", "trainer_every"), [(2, 2), (4, 2), (1, 2), (2, 1)])
def test_the_monitor_shares_the_row_of_the_models_metrics_of_the_same_step(tmp_path, monitor_every, trainer_every):
    """With CSVLogger, one row a logged step: the model's ``self.log`` and the monitor's figures of that step
    together (a step only the monitor logs gets a row of its own, as Lightning's own logging would)."""
    monitor = PrecisionMonitor(log_every_n_steps=monitor_every)
    trainer = make_trainer(MPPlugin("bf16"), max_steps=8, callbacks=[monitor], logger=CSVLogger(tmp_path),
                           log_every_n_steps=trainer_every)
    trainer.fit(LogsItsLoss())
    rows = read_csv(tmp_path)
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)), rows  # never two rows for one step
    model_steps = {int(r["step"]) for r in rows if r["train_loss"]}
    monitor_steps = {int(r["step"]) for r in rows if r["precision/skipped_steps"]}
    assert model_steps == {k - 1 for k in range(1, 9) if k % trainer_every == 0}
    assert monitor_steps == {k - 1 for k in range(1, 9) if k % monitor_every == 0}
    for r in rows:
        if int(r["step"]) in monitor_steps:
            assert float(r["precision/skip_rate"]) == 0.0 and float(r["precision/grad_norm"]) > 0
        else:  # nothing stale carried into a step the monitor did not log
            assert r["precision/grad_norm"] == ""


# --------------------------------------------------------------------------------------------- FP8 layers
def _fp8_on_cpu(monkeypatch):
    """torchao's float8 runs on the CPU (torch's FP8 matmul there): the GPU checks are what stands aside."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as err:  # not installed, or built for another torch (0.18 needs torch >= 2.10)
        pytest.skip(f"torchao's float8 cannot be imported here: {err}")
    import lightning_mp.fp8.support as support
    from lightning_mp.fp8.torchao_backend import TorchAOFloat8

    monkeypatch.setattr(TorchAOFloat8, "check", lambda self, device: None)
    monkeypatch.setattr(support, "fp8_device_problem", lambda *args, **kwargs: None)


class _FP8Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = (self.net(x).float() - x).pow(2).mean()
        self.log("loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g)),
                                           batch_size=16)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_fp8_layers_logs_each_fp8_layers_scaling(monkeypatch, tmp_path):
    _fp8_on_cpu(monkeypatch)
    from lightning.pytorch.loggers import CSVLogger

    monitor = PrecisionMonitor(log_every_n_steps=1, fp8_layers=True)
    plugin = MPPlugin("fp8", fp8={"backend": "torchao", "size_rule": "off", "keep_last": 0})
    trainer = Trainer(accelerator="cpu", max_steps=3, plugins=[plugin], callbacks=[monitor],
                      logger=CSVLogger(str(tmp_path), name="run"), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(_FP8Net())
    fp8 = {k: v for k, v in monitor.last.items()
           if k.startswith("precision/fp8_") and k.split("/")[1].endswith("_amax")}  # (the shares may be 0)
    layers = {k.split("/", 2)[2] for k in fp8}
    assert layers == {"net.0", "net.2"}  # the two FP8 layers, by their names
    assert {k.split("/")[1] for k in fp8} >= {"fp8_input_amax", "fp8_weight_amax", "fp8_grad_amax"}
    assert all(math.isfinite(v) and v > 0 for v in fp8.values())
    weight = _first_linear_weight(trainer).detach()  # the amax the watch read: the FP8 layer's fp32 weight's
    assert fp8["precision/fp8_weight_amax/net.0"] == pytest.approx(float(weight.abs().max()), rel=0.02)
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "precision/fp8_input_amax/net.0" in rows[0]


def _first_linear_weight(trainer):
    return trainer.lightning_module.net[0].weight


def test_fp8_layers_without_fp8_warns_and_logs_nothing(tmp_path):
    monitor = PrecisionMonitor(log_every_n_steps=1, fp8_layers=True)
    trainer = Trainer(accelerator="cpu", max_steps=2, plugins=[MPPlugin("bf16")], callbacks=[monitor],
                      logger=CSVLogger(str(tmp_path), name="run"), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match=r"fp8_layers=True\): the run has no FP8 layers.*MPPlugin in 'bf16'"):
        trainer.fit(_FP8Net())
    assert not any(k.startswith("precision/fp8_") for k in monitor.last)


def test_fp8_layers_must_be_a_bool():
    with pytest.raises(ValueError, match=r"fp8_layers='yes' is invalid: use true or false"):
        PrecisionMonitor(fp8_layers="yes")


@pytest.mark.parametrize("plugin, title", [
    (lambda: MPPlugin("bf16"),
     r"PrecisionMonitor: bf16, 1 skipped steps \(no loss scale: bf16 does not scale the loss\)"),
    (lambda: MPPlugin("fp16"), r"PrecisionMonitor: fp16, \d+ skipped steps"),
])
def test_the_plot_is_titled_with_the_precision_in_every_mode(tmp_path, monkeypatch, plugin, title):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    titles: list[str] = []
    save = Figure.savefig

    def record(self, *args, **kwargs):
        titles.extend(ax.get_title() for ax in self.axes if ax.get_title())
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    path = tmp_path / "precision.png"
    fit(tmp_path, plugin(), [PrecisionMonitor(log_every_n_steps=1, plot=str(path))],
        model=TinyRegressor(poison_loss=(2,)))
    assert len(titles) == 1 and re.fullmatch(title, titles[0]), titles
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_moment_underflow_shares_of_the_adam_moments(tmp_path, states):
    """net2's zeroed weight gives net1 all-zero gradients: net1's 544 moment elements stay 0 of 577 in all."""
    model = TinyRegressor(optimizer="adam")
    with torch.no_grad():
        model.net2.weight.zero_()
    monitor = PrecisionMonitor(log_every_n_steps=1, moment_underflow=True)
    fit(tmp_path, MPPlugin("bf16", optimizer_states=states), [monitor], max_steps=1, model=model)
    for key in ("exp_avg", "exp_avg_sq"):
        assert monitor.last[f"precision/moment_underflow/{key}"] == pytest.approx(544 / 577)
    assert float(model.trainer.callback_metrics["precision/moment_underflow/exp_avg_sq"]) == pytest.approx(544 / 577)

    off = PrecisionMonitor(log_every_n_steps=1)  # off by default
    fit(tmp_path / "off", MPPlugin("bf16", optimizer_states=states), [off], max_steps=1, model=TinyRegressor("adam"))
    assert not any(name.startswith("precision/moment_underflow") for name in off.last)
    with pytest.raises(ValueError, match="moment_underflow='yes' is invalid"):
        PrecisionMonitor(moment_underflow="yes")
