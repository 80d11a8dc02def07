"""The GPU benchmark suite: every precision mode on GPT-350M, GPT-1.3B and ViT-B/16, against Lightning's own
plugins and a plain ``torch.autocast`` loop, in one process per model.

Per model and mode: tokens (or images) per second, MFU against the measured bf16 ceiling, peak memory
(``torch.cuda.max_memory_allocated``) and the loss after N steps, all from the same initial weights and batches
(random tokens / random images, never zeros). Modes run through ``lightning_mp.compare.run_mode`` (the engine
of ``python -m lightning_mp compare``), so a mode that is unsupported, runs out of memory or diverges is reported
in its row. Writes a markdown table, JSON and a PNG chart into ``--out``.

Run from the repository root on the GPU machine::

    PYTHONPATH=. python benchmarks/run_all.py --models gpt-350m vit-b16 --out benchmarks/results
    PYTHONPATH=. python benchmarks/run_all.py --models gpt-1.3b --out benchmarks/results

Targets it checks (shared/GPU.md anchors): bf16 ≥ 10× the throughput of fp32 without TF32; bf16 peak memory
≤ 0.75× fp32's; bf16 GPT ≥ 70 % MFU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import GPT  # noqa: E402  the core benchmark's model

from lightning_mp.compare import ModeResult, run_mode  # noqa: E402

DEFAULT_MODES = [
    "plain-bf16",
    "lightning:32-true",
    "lightning:bf16-mixed",
    "lightning:16-mixed",
    "lightning:bf16-true",
    "fp32",
    "tf32",
    "bf16",
    "fp16",
    "bf16-true",
    "fp8",
]


# --------------------------------------------------------------------------------------------- models
class ViT(nn.Module):
    """ViT-B/16-shaped classifier (patch embedding by a strided conv, pre-norm encoder, class token)."""

    def __init__(self, image: int = 224, patch: int = 16, hidden: int = 768, layers: int = 12, heads: int = 12,
                 classes: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, hidden, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.randn(1, tokens, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        x = self.embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.encoder(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


def _n_params(build: Callable[[], nn.Module]) -> int:
    with torch.device("meta"):  # count without allocating
        return sum(p.numel() for p in build().parameters())


def gpt_spec(hidden: int, layers: int, heads: int, batch: int, seq: int = 2048, vocab: int = 32768) -> dict[str, Any]:
    def build() -> nn.Module:
        return GPT(vocab, hidden, layers, heads, seq)

    def batches(n: int, seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]

    def flops_per_item(n_params: int) -> float:  # per token; causal attention counted at half
        return 6 * n_params + 6 * layers * hidden * seq

    return {"build": build, "batches": batches, "flops_per_item": flops_per_item, "item": "tokens",
            "items_per_batch": batch * seq}


def vit_spec(batch: int = 256) -> dict[str, Any]:
    def batches(n: int, seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(batch, 3, 224, 224, generator=g), torch.randint(0, 1000, (batch,), generator=g))
                for _ in range(n)]

    def flops_per_item(n_params: int) -> float:  # per image: 197 tokens through the network, plus attention
        return 6 * n_params * 197 + 12 * 12 * 768 * 197 * 197

    return {"build": ViT, "batches": batches, "flops_per_item": flops_per_item, "item": "images",
            "items_per_batch": batch}


MODELS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpt-350m": lambda: gpt_spec(hidden=1024, layers=24, heads=16, batch=16),
    "gpt-1.3b": lambda: gpt_spec(hidden=2048, layers=24, heads=16, batch=8),
    "vit-b16": vit_spec,
}


# --------------------------------------------------------------------------------------------- running
def build_on_gpu(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    with torch.device("cuda"):
        model = build()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def lightning_module(model: nn.Module, batches: list, lr: float):
    from lightning.pytorch import LightningModule

    class Lit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=True)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    return Lit()


def run_plain(spec: dict[str, Any], batches: list, seed: int, lr: float, warmup: int) -> ModeResult:
    result = ModeResult(mode="plain-bf16", item_name=spec["item"])
    torch.cuda.reset_peak_memory_stats()
    model = build_on_gpu(spec["build"], seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    events, losses = [], []
    for batch in batches:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch = tuple(t.cuda(non_blocking=True) for t in batch) if isinstance(batch, tuple) else batch.cuda(non_blocking=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        events.append((start, end))
        losses.append(loss.detach().float())
    torch.cuda.synchronize()
    result.step_ms = statistics.median(s.elapsed_time(e) for s, e in events[warmup:])
    result.losses = torch.stack(losses).tolist()
    result.final_loss = sum(result.losses[-3:]) / 3
    result.steps = len(batches)
    result.peak_mem_mib = torch.cuda.max_memory_allocated() / 2**20
    del model, opt
    return result


def run_model(name: str, modes: list[str], steps: int, warmup: int, seed: int, lr: float) -> list[ModeResult]:
    spec = MODELS[name]()
    batches = spec["batches"](warmup + steps, seed + 1)
    results = []
    for mode in modes:
        print(f"[{name}] {mode} ...", flush=True)
        t0 = time.time()
        try:
            if mode == "plain-bf16":
                r = run_plain(spec, batches, seed, lr, warmup)
            else:
                r = run_mode(mode, lambda: lightning_module(build_on_gpu(spec["build"], seed), batches, lr), None,
                             warmup + steps, "cuda", seed, progress=False)
        except torch.OutOfMemoryError:
            r = ModeResult(mode=mode, status="failed", reason="out of memory")
        r.item_name = spec["item"]
        if r.step_ms:
            r.items_per_s = spec["items_per_batch"] / (r.step_ms / 1000)
        results.append(r)
        print(f"[{name}] {mode}: {r.status} {r.reason} step {r.step_ms and round(r.step_ms, 1)} ms,"
              f" peak {r.peak_mem_mib and round(r.peak_mem_mib / 1024, 1)} GiB ({time.time() - t0:.0f} s)", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return results


def table(name: str, results: list[ModeResult], flops_per_item: float, peak_tflops: float) -> str:
    by = {r.mode: r for r in results}
    fp32 = by.get("lightning:32-true") or by.get("fp32")
    native = by.get("lightning:bf16-mixed")
    item = results[0].item_name
    lines = [f"| mode | status | step ms | {item}/s | MFU | peak GiB | loss after N steps | vs fp32 (TF32 off) |"
             " vs Lightning bf16-mixed | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = r.items_per_s * flops_per_item / (peak_tflops * 1e12) if r.items_per_s else None
        v32 = fp32.step_ms / r.step_ms if fp32 and fp32.step_ms and r.step_ms else None
        vn = native.step_ms / r.step_ms if native and native.step_ms and r.step_ms else None
        f = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"| {r.mode} | {r.status} | {f(r.step_ms, '.1f')} | {f(r.items_per_s, ',.0f')} | {f(mfu and 100 * mfu, '.1f')}"
            f" | {f(r.peak_mem_mib and r.peak_mem_mib / 1024, '.1f')} | {f(r.final_loss, '.4f')} | {f(v32, '.2f')}"
            f" | {f(vn, '.3f')} | {r.reason[:120]} |"
        )
    return "\n".join(lines)


def targets(results: list[ModeResult], flops_per_item: float, peak_tflops: float, is_gpt: bool) -> list[str]:
    by = {r.mode: r for r in results}
    out = []
    bf16, fp32 = by.get("bf16"), by.get("fp32")
    if bf16 and fp32 and bf16.step_ms and fp32.step_ms:
        out.append(f"bf16 throughput {fp32.step_ms / bf16.step_ms:.1f}x fp32 without TF32 (target >= 10x)")
        if bf16.peak_mem_mib and fp32.peak_mem_mib:
            out.append(f"bf16 peak memory {bf16.peak_mem_mib / fp32.peak_mem_mib:.2f}x fp32 (target <= 0.75x)")
    if is_gpt and bf16 and bf16.items_per_s:
        out.append(f"bf16 MFU {100 * bf16.items_per_s * flops_per_item / (peak_tflops * 1e12):.1f} % (target >= 70 %)")
    return out


def plot(all_results: dict[str, list[ModeResult]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", flush=True)
        return
    fig, axes = plt.subplots(len(all_results), 2, figsize=(14, 3.6 * len(all_results)), squeeze=False)
    for row, (name, results) in enumerate(all_results.items()):
        ran = [r for r in results if r.items_per_s]
        axes[row][0].barh([r.mode for r in ran], [r.items_per_s for r in ran], color="tab:blue")
        axes[row][0].set_title(f"{name}: {ran[0].item_name if ran else 'items'}/s (higher is better)")
        axes[row][1].barh([r.mode for r in ran], [(r.peak_mem_mib or 0) / 1024 for r in ran], color="tab:orange")
        axes[row][1].set_title(f"{name}: peak GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak-tflops", type=float, default=782.0, help="bf16 ceiling for MFU (782: measured on an H200)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the .md, .json and .png")
    args = p.parse_args()
    import lightning

    if not torch.cuda.is_available():
        sys.exit("run_all.py needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    date = time.strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"run_all_{'_'.join(args.models)}_{device.split()[-1].lower()}_{date}")
    header = (f"{device} | {date} | torch {torch.__version__} | lightning {lightning.__version__} | "
              f"{args.steps} timed steps after {args.warmup} warm-up (median) | MFU vs {args.peak_tflops:g} TFLOP/s")
    report, all_results, payload = [f"# run_all: {header}", ""], {}, {"meta": {"header": header}, "models": {}}
    for name in args.models:
        results = run_model(name, args.modes, args.steps, args.warmup, args.seed, args.lr)
        spec = MODELS[name]()
        n_params = _n_params(spec["build"])
        fpi = spec["flops_per_item"](n_params)
        all_results[name] = results
        report += [f"## {name} ({n_params / 1e6:,.0f} M parameters, {spec['items_per_batch']:,} {spec['item']} a step)", "",
                   table(name, results, fpi, args.peak_tflops), ""]
        report += [f"- {t}" for t in targets(results, fpi, args.peak_tflops, name.startswith("gpt"))] + [""]
        payload["models"][name] = {"n_params": n_params, "results": [asdict(r) for r in results]}
        print("\n".join(report[-8:]), flush=True)
    text = "\n".join(report)
    print(text)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    plot(all_results, stem + ".png")
    print(f"wrote {stem}.md/.json/.png")


if __name__ == "__main__":
    main()
