"""Every `nn.Linear` of a model (lm_head included) once, at M rows: plain bf16 (or float32) `F.linear`,
the oneDNN-packed weight asyncexec uses (`mkldnn._linear_pointwise`; on a CPU where oneDNN has no bf16
GEMM, the packed float32 copy on upcast activations that asyncexec uses there), int8 weight-only
(per-channel scales) with PyTorch's kernel (`aten._weight_int8pack_mm`) and with asyncexec's
(`asyncexec.ops.int8_gemv`, up to 4 rows; where it cannot build, that column is nan), asyncexec's W8A8
int8 GEMM on AVX-512 VNNI (`asyncexec.ops.int8_gemm`, every size; nan without VNNI), and int4
weight-only as asyncexec quantizes it (`aten._weight_int4pack_mm_for_cpu`, a scale and a zero per 32
inputs; `asyncexec.quantization.int4`). Median ms of the whole set, per M, in one process.

`mm W^T`: `torch.mm` on the transposed weight, float32's other layout (asyncexec keeps whichever of it
and the packed one is faster on the CPU).

Usage: python scripts/probe_linear.py [--model smollm2] [--dtype bfloat16] [--rows 1 4 8 32 512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def bench(fn: Callable[[], object], reps: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 512])
    args = ap.parse_args()
    from asyncexec.gguf.file import load_reference_model
    from asyncexec.model_registry import resolve_model
    from asyncexec.ops import int8_gemm, int8_gemv
    from asyncexec.quantization.int4 import INT4_GROUP, quantize_int4
    from asyncexec.quantization.pack import can_pack, quantize_weight

    dtype = getattr(torch, args.dtype)
    model = load_reference_model(resolve_model(args.model), dtype)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(f"{len(lins)} linears, {sum(m.weight.numel() for m in lins) / 1e6:.1f} M weights, {args.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    upcast = not can_pack(dtype)  # asyncexec's choice on this CPU (quantization.py)
    if upcast:
        print(f"oneDNN has no {args.dtype} GEMM on this CPU: 'packed' is the float32 copy on upcast rows")
    ours, vnni = int8_gemv.load(), int8_gemm.load()
    head = ["rows", "plain ms", "mm W^T ms", "packed ms", "int8 ms", "int8 ours ms", "w8a8 ms", "int4 ms",
            "packed/plain", "mmT/packed", "int8/packed", "ours/int8", "w8a8/packed", "int4/int8"]  # fmt: skip
    print(" ".join(f"{h:>12s}" for h in head))
    with torch.inference_mode():
        ws = [(m.weight, m.bias) for m in lins]
        packed = [(torch.ops.mkldnn._reorder_linear_weight(w.float() if upcast else w, 1), b) for w, b in ws]
        transposed = [w.t().contiguous() for w, _ in ws]  # float32's plain layout (quantization.py)
        quant = [(*quantize_weight(w), b) for w, b in ws]
        quant4 = [quantize_int4(w)[:2] for w, _ in ws]
        fit = vnni and all(int8_gemm.fits(w) for w, _ in ws)
        grouped = [quantize_weight(w, group=int8_gemm.GROUP) for w, _ in ws] if fit else []
        blocked = [(int8_gemm.pack(q), s) for q, s in grouped]
        for rows in args.rows:
            xs = {m.in_features: torch.randn(rows, m.in_features, dtype=dtype) for m in lins}

            def plain(xs: dict[int, torch.Tensor] = xs) -> None:
                for w, b in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w, b)

            def mm_t(xs: dict[int, torch.Tensor] = xs) -> None:
                for wt in transposed:
                    torch.mm(xs[wt.shape[0]], wt)

            def onednn(xs: dict[int, torch.Tensor] = xs) -> None:
                for (pw, b), (w, _) in zip(packed, ws, strict=True):
                    x = xs[w.shape[1]]
                    if upcast:
                        bias = None if b is None else b.float()
                        torch.ops.mkldnn._linear_pointwise(x.float(), pw, bias, "none", [], "").to(dtype)
                    else:
                        torch.ops.mkldnn._linear_pointwise(x, pw, b, "none", [], "")

            def int8(xs: dict[int, torch.Tensor] = xs) -> None:
                for q, s, _ in quant:
                    torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s)

            def int8_ours(xs: dict[int, torch.Tensor] = xs) -> None:
                for q, s, _ in quant:
                    int8_gemv.int8_gemv(xs[q.shape[1]], q, s)

            def w8a8(xs: dict[int, torch.Tensor] = xs) -> None:
                for bw, s in blocked:
                    int8_gemm.run(xs[bw.shape[1] * 4], bw, s, None)

            def int4(xs: dict[int, torch.Tensor] = xs) -> None:
                for (pw, sz), (w, _) in zip(quant4, ws, strict=True):
                    torch.ops.aten._weight_int4pack_mm_for_cpu(xs[w.shape[1]], pw, INT4_GROUP, sz)

            a, t, p = bench(plain), bench(mm_t), bench(onednn)
            nan = float("nan")  # int8 and int4 serve bf16 only (with float32 rows: 30x slower at 32 rows)
            q8, q4 = (bench(int8, 10), bench(int4, 10)) if dtype == torch.bfloat16 else (nan, nan)
            o8 = bench(int8_ours, 10) if ours and rows <= 4 and dtype == torch.bfloat16 else nan
            v8 = bench(w8a8, 10) if blocked and dtype == torch.bfloat16 else nan
            row = (rows, a, t, p, q8, o8, v8, q4, p / a, t / p, q8 / p, o8 / q8, v8 / p, q4 / q8)
            print(" ".join(f"{v:12.2f}" for v in row))


if __name__ == "__main__":
    main()
