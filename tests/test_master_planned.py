"""The master weights' one gather: its common case (the layout made once per optimizer, list passes, flat buffers)
against the same steps taken record by record, and the fp32 kind against the same steps in fp32 by hand.

Through a Trainer, every case runs twice from the same weights and batches: once as it runs, once with the common
case turned off (every step takes its gradients record by record); weights, masters and optimizer state must be
bit-identical after every step, skipped steps included. In a plain loop, the fp32 masters step as a hand-written fp32
reference does (masters that follow the weights, fp32 gradients, AdamW on them, the weights rounded from them), also
for the cases the common one leaves to the records: a frozen layer, gradient accumulation's sums, a sparse gradient.
"""

import pytest
import torch
from conftest import assert_nested_equal
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_mp import MPPlugin
from lightning_mp import master as master_module
from lightning_mp.master import attach_master_weights, cast_module_


def _layout_of(masters, optimizer):
    """The layout kept for ``optimizer`` (None: none made yet)."""
    return masters._layouts.get(optimizer)


class Net(LightningModule):
    def __init__(self, poison_at=(), write_at=(), new_group_at=None, replace_state_at=(), reload_at=(), freeze=None,
                 unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
        self.late = nn.Linear(4, 4)
        self.poison_at, self.write_at, self.new_group_at = set(poison_at), set(write_at), new_group_at
        self.replace_state_at, self.reload_at, self.freeze = set(replace_state_at), set(reload_at), freeze
        self.unused = unused  # the optimizer holds a layer the forward never uses: it never has a gradient
        self.state_dicts = []  # the optimizer's state dict object at each batch start (from the second)
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
        layout = _layout_of(self.trainer.precision_plugin.masters, optimizer)
        self.seen_flat.append(layout is not None and layout.flat is not None)

    def configure_optimizers(self):
        params = self.parameters() if self.unused else self.body.parameters()
        return torch.optim.AdamW(params, lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(8)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def _fit(monkeypatch, common, kind, steps=8, **kwargs):
    """A fit; ``common=False``: no step takes the common case. Returns the model, the plugin, the optimizer state and
    the masters' state, and how many steps took the common case."""
    dense = []
    all_dense = master_module._all_dense
    with monkeypatch.context() as m:
        m.setattr(master_module, "_all_dense", lambda grads: dense.append(common and all_dense(grads)) or dense[-1])
        model = Net(**kwargs)
        plugin = MPPlugin("bf16-true", master_weights=kind)
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
    opt = trainer.optimizers[0]
    # by parameter index (the order of ``opt.state`` is its insertion order, which the two runs may make differently)
    state = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    return model, plugin, state, plugin.masters.state_dict(), sum(dense)


CASES = [
    {},
    {"poison_at": (2, 5)},
    {"write_at": (3,)},
    {"new_group_at": 4},
    {"poison_at": (1,), "write_at": (1, 6), "new_group_at": 3},
    {"replace_state_at": (3,), "reload_at": (5,)},
    {"freeze": (2, 5)},
    {"poison_at": (1,), "freeze": (2, 5)},  # the frozen layer's last gradient was NaN: it must not be checked
    {"unused": True, "poison_at": (3,)},
]
IDS = ["plain", "skipped-steps", "written-weights", "add-param-group", "all", "state-replaced", "frozen",
       "frozen-after-a-skip", "unused-layer"]


def _assert_same_runs(a, b, case):
    (ma, pa, sa, masters_a, _), (mb, pb, sb, masters_b, _) = a, b
    for (na, ta), (nb, tb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and ta.dtype == tb.dtype and torch.equal(ta, tb), na
    assert_nested_equal(masters_a, masters_b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert pa.stats.skipped_steps == pb.stats.skipped_steps == len(case.get("poison_at", ()))
    # the optimizer keeps its state dict object from step to step (until something loads another)
    reload_at = min(case.get("reload_at", (99,)))
    assert all(d is ma.state_dicts[0] for d in ma.state_dicts[: reload_at - 1])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("flat", [True, False, None], ids=["flat-grads", "grads-a-step", "nothing-flat"])
def test_fp32_common_case_is_bit_identical_to_the_steps_record_by_record(monkeypatch, case, flat):
    """``flat``: small layouts keep their fp32 gradients in one flat buffer from step to step (the default at this
    size); otherwise they are allocated in the step, with the masters in one flat buffer (mid-size layouts) or
    (``None``, large ones) where they are. All give the numbers of the steps taken record by record."""
    if not flat:
        monkeypatch.setattr(master_module, "FLAT_GRADS_MAX_NUMEL", 0)
    if flat is None:
        monkeypatch.setattr(master_module, "FLAT_FOLLOW_MAX_NUMEL", 0)
    flat = bool(flat)
    a = _fit(monkeypatch, True, "fp32", **case)
    assert any(a[0].seen_flat) is flat
    b = _fit(monkeypatch, False, "fp32", **case)
    assert (a[4] > 0 or "unused" in case) and b[4] == 0  # the common case ran, and only in the first fit
    _assert_same_runs(a, b, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[7]], ids=[IDS[0], IDS[4], IDS[7]])
@pytest.mark.parametrize("kind", ["kahan", "stochastic"])
def test_other_kinds_take_the_same_gather(monkeypatch, case, kind):
    """Kahan compensation and stochastic rounding go through the same gather, with stand-ins made for the step: its
    common case gives the numbers of the steps taken record by record."""
    a = _fit(monkeypatch, True, kind, **case)
    b = _fit(monkeypatch, False, kind, **case)
    assert a[4] > 0 and b[4] == 0 and not any(a[0].seen_flat)  # (no flat fp32 buffers: their memory is the point)
    _assert_same_runs(a, b, case)


def test_kinds_without_fp32_copies_keep_none_between_steps():
    """The stand-ins of ``kahan`` and ``stochastic`` are made once with their layout, but hold their fp32 values and
    gradients only inside the step: what those kinds save is the 4 bytes a parameter of an fp32 copy."""
    for kind in ("kahan", "stochastic"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        cast_module_(model, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        masters = attach_master_weights(opt, kind, module=model)
        x = torch.randn(4, 8).bfloat16()
        for _ in range(2):
            model(x).float().sum().backward()
            records = masters.gather(opt)
            assert all(r.standin.shape == r.param.shape and r.standin.grad is not None for r in records.records)
            with masters.stepping(records):
                opt.step()
            masters.write_back(records, skipped=False)
            opt.zero_grad()
            layout = _layout_of(masters, opt)
            assert all(s.numel() == 0 and s.grad is None for s in layout.standins), kind
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim())


class _Reference:
    """fp32 master weights by hand: a master follows its weight where the weight is no longer the master rounded; the
    fp32 gradient is the half one (plus the fp32 sum of earlier micro-batches); the optimizer steps the masters; the
    weights are the masters rounded."""

    def __init__(self, model, make_optimizer):
        self.model = model
        self.params = list(model.parameters())
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.opt = make_optimizer(self.masters)
        self.sums = [None] * len(self.params)

    def carry(self):
        for i, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.float()
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g
                p.grad = None

    def step(self):
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                w = p.detach()
                m.copy_(torch.where(m.to(w.dtype) == w, m, w.float()))
                g = None if p.grad is None else p.grad.float()
                if self.sums[i] is not None:
                    g = self.sums[i] if g is None else self.sums[i] + g
                m.grad, self.sums[i] = g, None
            self.opt.step()
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(p.dtype))
                m.grad = None


class _Tagger(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=sparse)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, tokens):
        return self.body(self.emb(tokens))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-sparse"], ids=["adamw", "sgd-with-a-sparse-gradient"])
@pytest.mark.parametrize("flat", [True, False, None], ids=["flat-grads", "grads-a-step", "nothing-flat"])
def test_fp32_masters_step_as_fp32_by_hand(monkeypatch, optimizer, flat):
    """A plain loop of the fp32 kind against :class:`_Reference`, bit for bit, over steps that take the common case
    and steps that take their gradients record by record: a frozen layer (no gradient), gradient accumulation (fp32
    sums pending), a weight written outside the step, and, with SGD, an embedding's sparse gradient at every step."""
    if not flat:
        monkeypatch.setattr(master_module, "FLAT_GRADS_MAX_NUMEL", 0)
    if flat is None:  # (a layout too large for flat masters: followed weight by weight)
        monkeypatch.setattr(master_module, "FLAT_FOLLOW_MAX_NUMEL", 0)
    sparse = optimizer == "sgd-sparse"

    def make_optimizer(params):
        if sparse:
            return torch.optim.SGD(params, lr=0.05)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    torch.manual_seed(0)
    model = _Tagger(sparse).to(torch.bfloat16)  # (no fp32 originals kept: the masters start from the bf16 weights)
    twin = _Tagger(sparse)
    twin.load_state_dict(model.state_dict())
    twin.to(torch.bfloat16)
    opt = make_optimizer(list(model.parameters()))
    masters = attach_master_weights(opt, "fp32", module=model)
    reference = _Reference(twin, make_optimizer)
    g = torch.Generator().manual_seed(1)

    def backward(net):
        tokens = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(seed))
        target = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed + 1))
        nn.functional.mse_loss(net(tokens).float(), target).backward()

    for step in range(8):
        seed = int(torch.randint(0, 1 << 30, (), generator=g))
        frozen = step in (2, 3)
        for net in (model, twin):
            net.body[0].requires_grad_(not frozen)
            if step == 4:  # written outside the step
                with torch.no_grad():
                    net.body[2].weight.mul_(0.5)
        if step in (5, 6):  # accumulation: the first micro-batch's gradients into fp32 sums
            backward(model)
            masters.carry_grads_(model.parameters())
            backward(twin)
            reference.carry()
            seed += 7
        backward(model)
        backward(twin)
        masters.step(opt)
        reference.step()
        opt.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (step, name)
        for p, m in zip(model.parameters(), reference.masters):
            assert torch.equal(masters.master_of(p), m), step
        assert_nested_equal(opt.state_dict()["state"], reference.opt.state_dict()["state"])
    assert _layout_of(masters, opt) is not None


def test_a_new_optimizer_over_the_same_parameters_gets_its_own_layout():
    """A plain loop that makes a new optimizer over the same parameters (a restart, a second phase): its steps must
    move the weights through its own param groups (a layout kept from the first optimizer would swap the masters
    into the old optimizer's lists and leave the new one's parameters unstepped)."""
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
    from lightning_mp.master import FP32MasterWeights

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
