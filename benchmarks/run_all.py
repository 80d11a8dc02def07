"""The GPU benchmark suite: every precision mode on GPT-350M, GPT-1.3B, ViT-B/16 and the VLM example scaled up,
against Lightning's own plugins and a plain ``torch.autocast`` loop, in one process (every listed model, one after
the other).

Per model and mode: tokens (or images) per second, MFU against the measured bf16 ceiling, peak memory
(``torch.cuda.max_memory_allocated``) and the loss after N steps, all from the same initial weights and batches
(random tokens / random images, never zeros; the VLM trains on scikit-learn's digits, as in
``examples/vlm_mini.py``). Modes run through ``lightning_mp.tools.compare.run_mode`` (the engine of
``python -m lightning_mp compare``), so a mode that is unsupported, runs out of memory or diverges is reported
in its row; ``bf16-true:kahan`` etc. pick ``MPPlugin``'s ``master_weights`` (plain ``bf16-true``: fp32 masters).
Writes a markdown table, JSON and a PNG chart into ``--out``.

Run from the repository root on the GPU machine::

    PYTHONPATH=. python benchmarks/run_all.py --models gpt-350m vit-b16 --out benchmarks/results
    PYTHONPATH=. python benchmarks/run_all.py --models gpt-1.3b --out benchmarks/results
    PYTHONPATH=. python benchmarks/run_all.py --models vlm --out benchmarks/results

Smoke test at toy sizes, on the CPU too (tf32/fp8 rows report themselves unsupported there)::

    PYTHONPATH=. python benchmarks/run_all.py --tiny --device cpu --steps 2 --warmup 1 --out /tmp/run_all

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

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.dirname(_HERE))  # the repository root: examples/ (the VLM)
from common import GPT, init_gpt_weights, lit_gpt  # noqa: E402  the shared model

from lightning_mp.tools.compare import ModeResult, _PeakMemory, parse_mode, run_mode  # noqa: E402

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
    "bf16-true",  # fp32 master weights (MPPlugin's default)
    "bf16-true:kahan",
    "bf16-true:stochastic",
    "bf16-true:none",
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


class VLMCaptioner(nn.Module):
    """``examples.vlm_mini.VLMMini`` (its own layers, initialisation and loss: ``VLMMini._loss``, ViT encoder,
    caption decoder cross-attending to the image tokens, cross-entropy in fp32) as ``forward(batch) -> loss``,
    so the plain loop and the Lightning wrapper below drive it like the other models. (Not named ``...Loss``:
    MPPlugin's default FP32 guards match class names ending in ``Loss`` and would run the whole model in fp32.)"""

    def __init__(self, **model_kwargs: Any) -> None:
        super().__init__()
        from examples.vlm_mini import VLMMini

        self.vlm = VLMMini(show_captions=0, **model_kwargs)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.vlm._loss(batch)


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
            "items_per_batch": batch * seq, "reinit": True, "note": f"{batch} x {seq} random tokens"}


def vit_spec(batch: int = 256, image: int = 224, patch: int = 16, hidden: int = 768, layers: int = 12,
             heads: int = 12, classes: int = 1000) -> dict[str, Any]:
    tokens = (image // patch) ** 2 + 1

    def build() -> nn.Module:
        return ViT(image, patch, hidden, layers, heads, classes)

    def batches(n: int, seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(batch, 3, image, image, generator=g), torch.randint(0, classes, (batch,), generator=g))
                for _ in range(n)]

    def flops_per_item(n_params: int) -> float:  # per image: every token through the network, plus attention
        return 6 * n_params * tokens + 12 * layers * hidden * tokens * tokens

    return {"build": build, "batches": batches, "flops_per_item": flops_per_item, "item": "images",
            "items_per_batch": batch, "reinit": True, "note": f"{batch} random {image}x{image} images"}


def vlm_spec(batch: int = 128, width: int = 1024, heads: int = 16, encoder_depth: int = 12, depth: int = 6,
             image_size: int = 64, patch_size: int = 4) -> dict[str, Any]:
    """``examples/vlm_mini.py`` scaled up: ViT encoder (``encoder_depth`` blocks) and caption decoder (``depth``
    blocks with cross-attention), both ``width`` wide, on ``image_size``² digit images cut in ``patch_size``²
    patches. The default size: 252 M parameters, 256 image tokens and 16 text tokens an image, 128 images a step."""
    from examples.vlm_mini import MAX_TOKENS, PAD, VOCAB_SIZE, DigitCaptionDataModule, caption, encode

    model_kwargs = dict(encoder="vit", width=width, heads=heads, encoder_depth=encoder_depth, depth=depth,
                        image_size=image_size, patch_size=patch_size)
    spec: dict[str, Any] = {}

    def build() -> nn.Module:
        return VLMCaptioner(**model_kwargs)

    def batches(n: int, seed: int) -> list:
        """``n`` batches from ``DigitCaptionDataModule`` (its shuffling and random shifts, epoch after epoch),
        drawn once so every mode gets the same ones and no mode times the Python data loading."""
        dm = DigitCaptionDataModule(image_size=image_size, batch_size=batch)
        try:
            dm.setup("fit")
        except ImportError:  # no scikit-learn: random images with true captions, said in the report
            print("[vlm] scikit-learn is missing: synthetic images instead of the digits", flush=True)
            spec["note"] += " (SYNTHETIC images: scikit-learn missing)"
            g = torch.Generator().manual_seed(seed)
            out = []
            for _ in range(n):
                digits = torch.randint(0, 10, (batch,), generator=g)
                tokens = torch.full((batch, MAX_TOKENS), PAD, dtype=torch.long)
                for i, d in enumerate(digits.tolist()):
                    ids = encode(caption(d))
                    tokens[i, : len(ids)] = torch.tensor(ids)
                out.append((torch.rand(batch, 1, image_size, image_size, generator=g), tokens, digits))
            return out
        if batch > len(dm.train_set):
            raise ValueError(f"vlm: batch {batch} is larger than the {len(dm.train_set)} training images")
        out = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            while len(out) < n:
                out += [tuple(b) for _, b in zip(range(n - len(out)), dm.train_dataloader())]
        return out

    def flops_per_item(n_params: int) -> float:
        """Per image, matmuls only (forward + backward = 3 x forward = 6 FLOPs per weight per token; norms,
        GELU, softmax and the embedding lookup left out), each part with the tokens that pass through it:
        N image tokens, T text tokens (the padded caption minus one, all computed), width w, vocabulary V."""
        n, t, w, v = (image_size // patch_size) ** 2, MAX_TOKENS - 1, width, VOCAB_SIZE
        dense = (
            patch_size**2 * w * n  # patch embedding (a matmul over patches; 1 channel)
            + encoder_depth * 12 * w * w * n  # encoder blocks: q, kv, out (4 w^2) and MLP (8 w^2) on image tokens
            + depth * 14 * w * w * t  # decoder blocks on text tokens: self q/kv/out, cross q/out, MLP
            + depth * 2 * w * w * n  # decoder cross-attention k/v projections of the image tokens
            + w * v * t  # output head (tied to the embedding)
        )
        attention = (  # QK^T and AV: 4 * q_len * kv_len * w forward, x3 with backward
            12 * encoder_depth * n * n * w  # bidirectional self-attention over the image tokens
            + 6 * depth * t * t * w  # causal self-attention over the text, counted at half
            + 12 * depth * t * n * w  # cross-attention, text to image tokens
        )
        return 6 * dense + attention

    spec.update({"build": build, "batches": batches, "flops_per_item": flops_per_item, "item": "images",
                 "items_per_batch": batch, "reinit": False,
                 "note": f"VLMMini: ViT encoder {encoder_depth} x {width}, decoder {depth} x {width}, {heads} heads,"
                         f" {image_size}x{image_size} digits in {patch_size}x{patch_size} patches, batch {batch}"})
    return spec


#: full sizes for the GPU, and ``--tiny`` ones (a few seconds per mode on a CPU) to check the script itself
MODELS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpt-350m": lambda: gpt_spec(hidden=1024, layers=24, heads=16, batch=16),
    "gpt-1.3b": lambda: gpt_spec(hidden=2048, layers=24, heads=16, batch=8),
    "vit-b16": vit_spec,
    "vlm": vlm_spec,
}
TINY_MODELS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpt-350m": lambda: gpt_spec(hidden=64, layers=2, heads=4, batch=2, seq=32, vocab=256),
    "gpt-1.3b": lambda: gpt_spec(hidden=128, layers=2, heads=4, batch=2, seq=32, vocab=256),
    "vit-b16": lambda: vit_spec(batch=4, image=32, patch=8, hidden=64, layers=2, heads=4, classes=10),
    "vlm": lambda: vlm_spec(batch=8, width=64, heads=4, encoder_depth=2, depth=2, image_size=16, patch_size=4),
}


# --------------------------------------------------------------------------------------------- running
def build_model(spec: dict[str, Any], seed: int, device: str) -> nn.Module:
    """The same initial weights every call: same seed, same ops, built directly on ``device``."""
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    with torch.device(device):
        model = spec["build"]()
    if spec["reinit"]:  # GPT/ViT: N(0, 0.02) weights, zero biases; the VLM keeps VLMMini's own initialisation
        init_gpt_weights(model)
    return model


def make_optimizer(params, lr: float, device: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, fused=device == "cuda")


def lightning_module(model: nn.Module, batches: list, lr: float, device: str):
    return lit_gpt(model, batches, lambda params: make_optimizer(params, lr, device))


def _final_loss(losses: list[float]) -> float:
    tail = losses[-max(1, min(10, len(losses) // 5)):]  # as compare.run_mode
    return sum(tail) / len(tail)


def run_plain(spec: dict[str, Any], batches: list, seed: int, lr: float, warmup: int, device: str) -> ModeResult:
    """A plain ``torch.autocast`` bf16 loop, timed as ``run_mode`` times Lightning: from after the batch's copy to
    the device (Lightning copies before ``on_train_batch_start``) to after the optimizer step."""
    result = ModeResult(mode="plain-bf16", item_name=spec["item"])
    memory = _PeakMemory(device)
    memory.reset()
    model = build_model(spec, seed, device)
    opt = make_optimizer(model.parameters(), lr, device)
    times, events, losses = [], [], []
    for batch in batches:
        batch = tuple(t.to(device, non_blocking=True) for t in batch) if isinstance(batch, tuple) else batch.to(device)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        with torch.autocast(device, torch.bfloat16):
            loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            end.record()
            events.append((start, end))
        else:
            times.append(1000 * (time.perf_counter() - t0))
        losses.append(loss.detach().float())
    if device == "cuda":
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in events]
    result.step_ms = statistics.median(times[min(warmup, len(times) - 1):])
    result.losses = torch.stack(losses).tolist()
    result.final_loss = _final_loss(result.losses)
    result.steps = len(batches)
    result.peak_mem_mib = memory.peak_mib()
    del model, opt
    return result


def run_model(name: str, spec: dict[str, Any], modes: list[str], steps: int, warmup: int, seed: int, lr: float,
              device: str) -> list[ModeResult]:
    batches = spec["batches"](warmup + steps, seed + 1)
    results = []
    for mode in modes:
        print(f"[{name}] {mode} ...", flush=True)
        t0 = time.time()
        try:
            if mode == "plain-bf16":
                r = run_plain(spec, batches, seed, lr, warmup, device)
            else:
                r = run_mode(mode, lambda: lightning_module(build_model(spec, seed, device), batches, lr, device), None,
                             warmup + steps, device, seed, progress=False, warmup=warmup)
        except torch.OutOfMemoryError:
            r = ModeResult(mode=mode, status="failed", reason="out of memory")
        r.item_name = spec["item"]
        if r.step_ms:
            r.items_per_s = spec["items_per_batch"] / (r.step_ms / 1000)
        results.append(r)
        print(f"[{name}] {mode}: {r.status} {r.reason} step {r.step_ms and round(r.step_ms, 1)} ms,"
              f" peak {r.peak_mem_mib and round(r.peak_mem_mib / 1024, 1)} GiB ({time.time() - t0:.0f} s)", flush=True)
        gc.collect()
        if device == "cuda":
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
            f"| {r.mode} | {r.status} | {f(r.step_ms, '.1f')} | {f(r.items_per_s, ',.0f')}"
            f" | {f(mfu and 100 * mfu, '.1f')}"
            f" | {f(r.peak_mem_mib and r.peak_mem_mib / 1024, '.1f')} | {f(r.final_loss, '.4f')} | {f(v32, '.2f')}"
            f" | {f(vn, '.3f')} | {r.reason.replace('|', '/')[:120]} |"
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
    rows = max(len(results) for results in all_results.values())
    fig, axes = plt.subplots(len(all_results), 2, figsize=(14, max(3.6, 0.28 * rows + 1) * len(all_results)),
                             squeeze=False)
    for row, (name, results) in enumerate(all_results.items()):
        ran = [r for r in results if r.items_per_s]
        axes[row][0].barh([r.mode for r in ran], [r.items_per_s for r in ran], color="tab:blue")
        axes[row][0].set_title(f"{name}: {ran[0].item_name if ran else 'items'}/s (higher is better)")
        axes[row][1].barh([r.mode for r in ran], [(r.peak_mem_mib or 0) / 1024 for r in ran], color="tab:orange")
        axes[row][1].set_title(f"{name}: peak GiB")
        for ax in axes[row]:
            ax.invert_yaxis()  # the modes top to bottom in the table's order
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES,
                   help="plain-bf16, lightning:<precision>, or an MPPlugin mode (bf16-true:kahan etc. pick the"
                        " master weights: fp32, kahan, stochastic, none)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak-tflops", type=float, default=782.0, help="bf16 ceiling for MFU (782: measured on an H200)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the .md, .json and .png")
    p.add_argument("--tag", default="", help="added to the output files' names (e.g. to keep two runs of a day apart)")
    p.add_argument("--tiny", action="store_true", help="toy sizes of every model: checks the script, measures nothing")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is one")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        p.error("use --steps >= 1 and --warmup >= 0")
    for mode in args.modes:
        if mode != "plain-bf16":
            try:
                parse_mode(mode)
            except ValueError as err:
                p.error(f"--modes: {err}")
    import lightning

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        sys.exit("run_all.py: --device cuda, but CUDA is not available here")
    if device_type == "cpu" and not args.tiny:
        sys.exit("run_all.py needs a CUDA GPU (on the CPU, --tiny checks the script at toy sizes)")
    specs = TINY_MODELS if args.tiny else MODELS
    device = torch.cuda.get_device_name() if device_type == "cuda" else "CPU"
    date = time.strftime("%Y-%m-%d")
    os.makedirs(args.out, exist_ok=True)
    parts = ["run_all", *args.models, *(["tiny"] if args.tiny else []), *([args.tag] if args.tag else []),
             device.split()[-1].lower(), date]
    stem = os.path.join(args.out, "_".join(parts))
    header = (f"{device} | {date} | torch {torch.__version__} | lightning {lightning.__version__} | "
              f"{args.steps} timed steps after {args.warmup} warm-up (median) | MFU vs {args.peak_tflops:g} TFLOP/s"
              + (" | TINY sizes: a check of the script, not a measurement" if args.tiny else ""))
    report, all_results, payload = [f"# run_all: {header}", ""], {}, {"meta": {"header": header}, "models": {}}
    for name in args.models:
        t0 = time.time()
        spec = specs[name]()
        results = run_model(name, spec, args.modes, args.steps, args.warmup, args.seed, args.lr, device_type)
        wall_s = time.time() - t0
        n_params = _n_params(spec["build"])
        fpi = spec["flops_per_item"](n_params)
        all_results[name] = results
        report += [f"## {name} ({n_params / 1e6:,.1f} M parameters, {spec['items_per_batch']:,} {spec['item']} a step:"
                   f" {spec['note']}; all modes {wall_s:.0f} s)", "",
                   table(name, results, fpi, args.peak_tflops), ""]
        report += [f"- {t}" for t in targets(results, fpi, args.peak_tflops, name.startswith("gpt"))] + [""]
        payload["models"][name] = {"n_params": n_params, "flops_per_item": fpi,
                                   "items_per_batch": spec["items_per_batch"], "note": spec["note"], "wall_s": wall_s,
                                   "results": [asdict(r) for r in results]}
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
