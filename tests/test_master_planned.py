"""The fp32 masters' planned step (one layout per optimizer, made once) against the general path, through a Trainer.

Every case runs twice from the same weights and batches: once as it runs, once with the planned path turned off;
weights, masters and optimizer state must be bit-identical after every step, skipped steps included.
"""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp import master as master_module


def _layout_of(masters, optimizer):
    """The planned step's layout kept for ``optimizer`` (None: none made, or the optimizer is not plannable)."""
    kept = masters._layouts.get(optimizer)
    return None if kept is None else kept[1]


class Net(LightningModule):
    def __init__(self, poison_at=(), write_at=(), new_group_at=None, fused=False, replace_state_at=(), reload_at=(),
                 freeze=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
        self.late = nn.Linear(4, 4)
        self.poison_at, self.write_at, self.new_group_at = set(poison_at), set(write_at), new_group_at
        self.replace_state_at, self.reload_at, self.freeze = set(replace_state_at), set(reload_at), freeze
        self.state_dicts = []  # the optimizer's state dict object at each batch start (from the second)
        self.seen_layouts = []
        self.seen_flat = []  # whether the layout kept its fp32 gradients in a flat buffer

    def training_step(self, batch, i):
        x, y = batch
        out = self.body(x)
        if self.new_group_at is not None and i >= self.new_group_at:
            out = self.late(out)
        loss = nn.functional.mse_loss(out.float(), y.float())
        return loss * float("nan") if i in self.poison_at else loss

    def on_train_batch_start(self, batch, i):
        if i in self.write_at:  # a weight written from outside the step (an EMA swap, a pruning callback)
            with torch.no_grad():
                self.body[0].weight.mul_(0.5)
        if self.new_group_at is not None and i == self.new_group_at:
            self.trainer.optimizers[0].add_param_group({"params": list(self.late.parameters())})
        opt = self.trainer.optimizers[0]
        if i > 0:
            self.state_dicts.append(opt.state)
            # between steps the state is keyed by the model's own parameters, as in fp32
            assert {id(k) for k in opt.state} <= {id(p) for g in opt.param_groups for p in g["params"]}
        if i in self.replace_state_at:  # a callback replaces a parameter's state (e.g. resets its moments)
            weight = self.body[3].weight
            opt.state[weight] = {k: v.clone() if k == "step" else v * 0.5 for k, v in opt.state[weight].items()}
        if i in self.reload_at:  # the optimizer's state reloaded mid-run (a new state dict object)
            opt.load_state_dict(opt.state_dict())
        if self.freeze is not None and i in self.freeze:  # frozen, then unfrozen (a finetuning schedule)
            self.body[0].requires_grad_(i == self.freeze[1])

    def on_before_optimizer_step(self, optimizer):
        masters = self.trainer.precision_plugin.masters
        layout = _layout_of(masters, optimizer) if masters is not None else None
        self.seen_layouts.append(layout is not None if masters is not None else None)
        self.seen_flat.append(layout is not None and layout.flat is not None)

    def configure_optimizers(self):
        params = self.body.parameters() if self.new_group_at is not None else self.parameters()
        return torch.optim.AdamW(params, lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(8)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def _fit(monkeypatch, planned, steps=8, **kwargs):
    with monkeypatch.context() as m:
        if not planned:
            m.setattr(master_module.FP32MasterWeights, "_gather_planned", lambda self, opt, check: None)
        model = Net(**kwargs)
        plugin = MPPlugin("bf16-true")
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
    opt = trainer.optimizers[0]
    # by parameter index (the order of ``opt.state`` is its insertion order, which the two paths may make differently)
    state = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    masters = {n: t.clone() for n, t in plugin.masters.state_dict()["masters"].items()}
    return model, plugin, state, masters


@pytest.mark.parametrize(
    "case",
    [
        {},
        {"poison_at": (2, 5)},
        {"write_at": (3,)},
        {"new_group_at": 4},
        {"poison_at": (1,), "write_at": (1, 6), "new_group_at": 3},
        {"replace_state_at": (3,), "reload_at": (5,)},
        {"freeze": (2, 5)},
        {"poison_at": (1,), "freeze": (2, 5)},  # the frozen layer's last gradient was NaN: it must not be checked
    ],
    ids=["plain", "skipped-steps", "written-weights", "add-param-group", "all", "state-replaced", "frozen",
         "frozen-after-a-skip"],
)
@pytest.mark.parametrize("flat", [True, False], ids=["flat-grads", "grads-a-step"])
def test_planned_path_is_bit_identical_to_the_general_path(monkeypatch, case, flat):
    """``flat``: small layouts keep their fp32 gradients in one flat buffer from step to step (the default at this
    size); otherwise they are allocated in the step. Both give the general path's numbers."""
    if not flat:
        monkeypatch.setattr(master_module, "FLAT_GRADS_MAX_NUMEL", 0)
    a, pa, sa, ma = _fit(monkeypatch, True, **case)
    assert any(a.seen_flat) is flat
    b, pb, sb, mb = _fit(monkeypatch, False, **case)
    assert any(a.seen_layouts) and not any(b.seen_layouts)  # the planned path ran, and only in the first fit
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and ta.dtype == tb.dtype and torch.equal(ta, tb), na
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert pa.stats.skipped_steps == pb.stats.skipped_steps == len(case.get("poison_at", ()))
    # the optimizer keeps its state dict object from step to step (until something loads another)
    reload_at = min(case.get("reload_at", (99,)))
    assert all(d is a.state_dicts[0] for d in a.state_dicts[: reload_at - 1])


def test_a_new_optimizer_over_the_same_parameters_gets_its_own_layout():
    """A plain loop that makes a new optimizer over the same parameters (a restart, a second phase): its steps must
    move the weights through its own param groups (a layout kept from the first optimizer would swap the masters
    into the old optimizer's lists and leave the new one's parameters unstepped)."""
    from lightning_mp.master import attach_master_weights, cast_module_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    cast_module_(model, torch.bfloat16)
    x, y = torch.randn(4, 8).bfloat16(), torch.randn(4, 4)
    masters = None
    for _ in range(2):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if masters is None:
            masters = attach_master_weights(opt, "fp32", module=model)
        else:
            masters.attach(opt)
        for _ in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
            masters.step(opt)
            opt.zero_grad()
            assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
            assert _layout_of(masters, opt) is not None
            in_groups = [p for g in opt.param_groups for p in g["params"]]
            assert len(in_groups) == 4 and all(a is b for a, b in zip(in_groups, model.parameters()))
            assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim())


def test_flat_gradients_only_where_views_fit_the_parameters():
    """A channels-last (non-contiguous) half parameter gets its gradient allocated in the step, with its strides; a
    layout above the size limit too; below it, the fp32 gradients are views of one buffer, kept from step to step."""
    from lightning_mp.master import FP32MasterWeights, cast_module_

    def run(model):
        cast_module_(model, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        masters = FP32MasterWeights()
        masters.attach(opt, model)
        x = torch.randn(2, 3, 4, 4).bfloat16()
        grads = []
        for _ in range(2):
            model(x).float().sum().backward()
            records = masters.gather(opt, check=True)
            grads.append([r.standin.grad for r in records.records])
            with masters.stepping(records):
                opt.step()
            masters.write_back(records, skipped=False)
            opt.zero_grad()
        return _layout_of(masters, opt), grads

    torch.manual_seed(0)
    layout, grads = run(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 2)))
    assert layout.flat is not None and all(a is b for a, b in zip(*grads))  # the same views, step after step
    assert all(g.untyped_storage().data_ptr() == layout.flat.untyped_storage().data_ptr() for g in grads[0])
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    layout, grads = run(nn.Sequential(conv, nn.Flatten(), nn.Linear(16, 2)))
    assert layout.flat is None and grads[0][0].stride() == conv.weight.stride()
