"""The Triton flash kernel on a CUDA GPU: correctness first, then speed, as one table.

1. Correctness: outputs and dq, dk, dv of ``backend="triton"`` against the float64
   reference of the test suite, for every head dim, causal or not, padded or not, MHA
   and GQA, lengths that are not multiples of a tile. The rule is flash-attn's: the
   error may be at most twice that of plain PyTorch (the ``matmul`` backend) in the same
   precision. Timings are not taken if a check fails (``--skip-check`` to override).
2. Speed: forward and forward+backward TFLOP/s for head dims 64 and 128, S from 1k to
   16k, causal and not, padded and not, next to SDPA's flash and efficient backends and
   the machine's measured bf16 (or fp16) matrix-multiply rate.

FLOPs are counted as flash-attn's benchmarks count them: 4 * B * H * S * Sk * D for the
forward, halved when causal, and 2.5 times that for the backward (3.5 times for
forward+backward). A padded batch is counted at its full padded shape: skipping padded
tiles shows up as a higher rate. The number of tokens B * S is held fixed (``--tokens``)
and H * D = 2048, as in flash-attn's benchmarks.

Targets (H200, bf16, head dim 128, S >= 4k): forward >= 1.0x SDPA-flash without a mask,
>= 1.5x SDPA (its best backend that takes the mask) with a padding mask.

    python benchmarks/gpu.py                 # check, then the full table (minutes)
    python benchmarks/gpu.py --quick         # S in {1k, 4k}, fewer repetitions
    python benchmarks/gpu.py --config forward:128:128,128,8,2   # try another tile config
    python benchmarks/gpu.py --compile-only 90   # no GPU needed: compile every variant for sm_90

``--compile-only`` compiles every kernel variant through the real host code for a GPU
architecture (80: A100, 90: H100/H200) on any machine, and lists each kernel's shared
memory, registers and spills (from the ptxas that ships with Triton). It needs no GPU and
no CUDA driver: it stands in a driver that compiles but never launches, which leans on
Triton internals (written against Triton 3.7).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("forward", "dkdv", "dq")
DEVICE = "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Check and time headwise's Triton flash kernel on a CUDA GPU, next to "
                    "PyTorch SDPA's flash and efficient backends.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="B * S, held fixed (B = tokens // S, at least 1)")
    p.add_argument("--model-dim", type=int, default=2048, help="H * D (H = model_dim // D)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--skip-check", action="store_true", help="time even if the correctness check fails")
    p.add_argument("--check-only", action="store_true", help="run the correctness check and stop")
    p.add_argument("--quick", action="store_true", help="S in {1k, 4k} and fewer repetitions")
    p.add_argument("--rep-ms", type=int, default=200, help="milliseconds of repetitions per timing")
    p.add_argument("--compile-only", type=int, metavar="ARCH", choices=(80, 86, 89, 90),
                   help="compile every kernel variant for sm_ARCH and report resources; no GPU needed")
    p.add_argument("--config", action="append", default=[], metavar="KIND:D:BM,BN,WARPS,STAGES",
                   help=f"override the first tile config of a kernel ({', '.join(KINDS)}) for head dims <= D")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = [s for s in args.seqlens if s in (1024, 4096)] or args.seqlens[:2]
        args.rep_ms = min(args.rep_ms, 50)
    return args


def refuse_without_gpu() -> str | None:
    """None when this machine can run the benchmark, else why not (and what to do)."""
    if not torch.cuda.is_available():
        return ("benchmarks/gpu.py needs a CUDA GPU and torch.cuda.is_available() is False here; "
                "run it on a CUDA machine. Without one: `python benchmarks/gpu.py --compile-only 90` "
                "compiles every kernel for an H100/H200, and `python -m pytest tests/kernels/test_triton.py` "
                "checks them in Triton's interpreter")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "benchmarks/gpu.py needs triton: pip install 'headwise[triton]'"
    return None


def apply_configs(overrides: list[str]) -> None:
    from headwise.kernels.triton import configs

    for spec in overrides:
        try:
            kind, bound, numbers = spec.split(":")
            bm, bn, warps, stages = (int(x) for x in numbers.split(","))
            bound_d = int(bound)
        except ValueError:
            raise SystemExit(
                f"--config {spec!r}: expected KIND:D:BM,BN,WARPS,STAGES, e.g. forward:128:128,64,8,3"
            ) from None
        if kind not in KINDS:
            raise SystemExit(f"--config {spec!r}: kind must be one of {KINDS}, got {kind!r}")
        table = configs.GPU_CONFIGS[kind]
        fallbacks = table.get(bound_d, table[max(table)])
        table[bound_d] = (configs.TileConfig(bm, bn, warps, stages), *fallbacks)


# ----------------------------------------------------------------------------- correctness


def float64_reference():
    """The test suite's float64 reference (tests/conftest.py), else headwise's matmul in float64."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))
    try:
        from conftest import reference_attention

        def ref(q, k, v, mask, **kw):  # runs on the CPU, in float64
            kw = {n: (x.cpu() if torch.is_tensor(x) else x) for n, x in kw.items()}
            return reference_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), **kw)[0]

        return ref, "tests/conftest.py reference_attention (float64, CPU)"
    except ImportError:
        import headwise

        def ref(q, k, v, mask, **kw):
            return headwise.attention(q, k, v, mask, backend="matmul", **kw)

        return ref, "headwise matmul backend in float64 (tests/conftest.py not importable)"
    finally:
        sys.path.remove(str(tests))


@dataclass
class Check:
    name: str
    errors: dict[str, tuple[float, float]]  # tensor -> (triton error, plain PyTorch error)

    @property
    def ok(self) -> bool:
        return all(err <= 2 * base + 1e-4 for err, base in self.errors.values())


def check_case(name, ref, dtype, B, H, Hkv, S, Sk, D, padded, **kw) -> Check:
    import headwise

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(B, H, S, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    mask = None
    if padded:  # right, left and hole patterns, one fully padded row
        j = torch.arange(Sk, device=DEVICE)[None, :]
        mask = torch.stack([j[0] < Sk // 3, j[0] >= Sk // 2, (j[0] < Sk // 10) | (j[0] >= Sk // 3), j[0] < 0])[:B]
    grad = torch.randn(B, H, S, D, device=DEVICE, generator=gen).to(dtype)
    results = []
    for inputs, backend in (((q, k, v), "triton"), ((q, k, v), "matmul"), (None, "reference")):
        if backend == "reference":
            qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
            out = ref(qd, kd, vd, mask, **kw)
            grads = torch.autograd.grad(out, (qd, kd, vd), grad.to(out.device, torch.float64))
        else:
            out = headwise.attention(*inputs, mask, backend=backend, **kw)
            grads = torch.autograd.grad(out, inputs, grad)
        results.append([t.detach().double().cpu() for t in (out, *grads)])
    got, plain, want = results
    errors = {}
    for i, tensor in enumerate(("out", "dq", "dk", "dv")):
        finite = bool(torch.isfinite(got[i]).all())
        err = (got[i] - want[i]).abs().max().item() if finite else math.inf
        errors[tensor] = (err, (plain[i] - want[i]).abs().max().item())
    return Check(name, errors)


def check_cases(head_dims: list[int], n: int = 1000) -> list[tuple[str, dict]]:
    """Shapes for the correctness check; ``n`` (about Sk) is not a multiple of any tile."""
    cases = []
    for D in head_dims:
        cases += [
            (f"D={D} MHA full", dict(B=2, H=4, Hkv=4, S=n, Sk=n, D=D, padded=False)),
            (f"D={D} MHA causal", dict(B=2, H=4, Hkv=4, S=n, Sk=n, D=D, padded=False, is_causal=True)),
            (f"D={D} GQA causal padded S<Sk", dict(B=4, H=8, Hkv=2, S=n * 7 // 9, Sk=n, D=D, padded=True,
                                                   is_causal=True)),
            (f"D={D} MQA padded S>Sk", dict(B=4, H=4, Hkv=1, S=n, Sk=n * 5 // 9, D=D, padded=True)),
            (f"D={D} GQA window+ALiBi padded", dict(B=2, H=8, Hkv=2, S=n, Sk=n, D=D, padded=True,
                                                    window=n // 4, alibi_slopes="paper")),
        ]
    return cases


def run_checks(dtype: torch.dtype, head_dims: list[int], console, n: int = 1000) -> bool:
    from rich.table import Table

    ref, ref_name = float64_reference()
    cases = check_cases(head_dims, n)
    table = Table(title=f"correctness vs {ref_name}: max |error|, triton / plain PyTorch ({dtype})")
    for col in ("case", "out", "dq", "dk", "dv", "ok"):
        table.add_column(col)
    all_ok = True
    import headwise

    for name, kw in cases:
        if kw.get("alibi_slopes") == "paper":
            kw["alibi_slopes"] = headwise.masks.alibi_slopes(kw["H"]).to(DEVICE)
        result = check_case(name, ref, dtype, **kw)
        all_ok &= result.ok
        cells = [f"{e:.2e} / {b:.2e}" for e, b in result.errors.values()]
        table.add_row(name, *cells, "[green]yes" if result.ok else "[red]NO")
    console.print(table)
    return all_ok


# ----------------------------------------------------------------------------- speed


def matmul_tflops(dtype: torch.dtype, rep_ms: int) -> float:
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    ms = do_bench(lambda: a @ b, rep=rep_ms)
    return 2 * n**3 / ms / 1e9


def attention_flops(B, H, S, Sk, D, causal) -> float:
    return 4 * B * H * S * Sk * D / (2 if causal else 1)


def time_ms(fn, rep_ms: int) -> float | None:
    """Median milliseconds of ``fn``, or None when the backend cannot run it."""
    from triton.testing import do_bench

    try:
        fn()
        return do_bench(fn, rep=rep_ms)
    except (RuntimeError, ValueError, torch.OutOfMemoryError):
        torch.cuda.empty_cache()
        return None


def make_case(B, H, S, D, dtype, padded, causal):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    lengths = None
    if padded:  # lengths uniform in [S/4, S] (about 3/8 of the batch is padding); row 0 full
        lengths = torch.randint(S // 4, S + 1, (B,), device=DEVICE, generator=gen)
        lengths[0] = S
    return q, k, v, lengths


def sdpa_fn(q, k, v, lengths, causal, backend, grad):
    """SDPA with one backend forced; with padding, the mask (causal folded in) as SDPA takes it."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    mask = None
    if lengths is not None:
        S, Sk = q.shape[2], k.shape[2]
        keep = torch.arange(Sk, device=DEVICE)[None, :] < lengths[:, None]  # (B, Sk)
        mask = keep[:, None, None, :]  # (B, 1, 1, Sk)
        if causal:
            mask = mask & torch.ones(S, Sk, dtype=torch.bool, device=DEVICE).tril(Sk - S)  # (B, 1, S, Sk)

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)

    return fwd, (lambda: torch.autograd.grad(fwd(), (q, k, v), grad))


def triton_fn(q, k, v, lengths, causal, grad):
    import headwise

    mask = None
    if lengths is not None:
        mask = torch.arange(k.shape[2], device=DEVICE)[None, :] < lengths[:, None]  # (B, Sk)

    def fwd():
        return headwise.attention(q, k, v, mask, is_causal=causal, backend="triton")

    return fwd, (lambda: torch.autograd.grad(fwd(), (q, k, v), grad))


def run_speed(args, dtype: torch.dtype, console) -> None:
    from rich.table import Table
    from torch.nn.attention import SDPBackend

    peak = matmul_tflops(dtype, args.rep_ms)
    console.print(f"{torch.cuda.get_device_name()}: measured {args.dtype} matmul (8192^3) "
                  f"[bold]{peak:.0f} TFLOP/s[/bold]")
    table = Table(title=f"TFLOP/s ({args.dtype}; B * S = {args.tokens}, H * D = {args.model_dim}; "
                        "padded rows counted at their full shape)")
    for col in ("D", "S", "causal", "padded", "fwd triton", "fwd flash", "fwd efficient", "fwd target",
                "f+b triton", "f+b flash", "f+b efficient", "triton fwd / matmul"):
        table.add_column(col, justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    misses = []
    for D in args.head_dims:
        H = max(1, args.model_dim // D)
        for S in args.seqlens:
            B = max(1, args.tokens // S)
            for causal in (False, True):
                for padded in (False, True):
                    q, k, v, lengths = make_case(B, H, S, D, dtype, padded, causal)
                    grad = torch.randn_like(q)
                    flops = attention_flops(B, H, S, S, D, causal)
                    rates = {}
                    fns = {"triton": triton_fn(q, k, v, lengths, causal, grad)}
                    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                        fns[name] = sdpa_fn(q, k, v, lengths, causal, backend, grad)
                    for name, (fwd, fwd_bwd) in fns.items():
                        with torch.no_grad():
                            ms = time_ms(fwd, args.rep_ms)
                        rates[name, "fwd"] = None if ms is None else flops / ms / 1e9
                        ms = None if args.no_backward else time_ms(fwd_bwd, args.rep_ms)
                        rates[name, "fb"] = None if ms is None else 3.5 * flops / ms / 1e9
                    # The target's baseline: flash without a mask, else SDPA's best backend with it.
                    base = [rates["flash", "fwd"]] if not padded else [rates["flash", "fwd"], rates["efficient", "fwd"]]
                    base = max((r for r in base if r is not None), default=None)
                    ratio = None if base is None or rates["triton", "fwd"] is None else rates["triton", "fwd"] / base
                    goal = 1.5 if padded else 1.0
                    target = "-" if ratio is None else f"{ratio:.2f}x"
                    if D == 128 and S >= 4096 and ratio is not None and dtype == torch.bfloat16:
                        met = ratio >= goal
                        target += " [green]ok" if met else f" [red]< {goal}x"
                        if not met:
                            misses.append(f"D={D} S={S} causal={causal} padded={padded}: {ratio:.2f}x < {goal}x")
                    table.add_row(str(D), str(S), "yes" if causal else "", "yes" if padded else "",
                                  fmt(rates["triton", "fwd"]), fmt(rates["flash", "fwd"]),
                                  fmt(rates["efficient", "fwd"]), target, fmt(rates["triton", "fb"]),
                                  fmt(rates["flash", "fb"]), fmt(rates["efficient", "fb"]),
                                  "-" if rates["triton", "fwd"] is None else f"{rates['triton', 'fwd'] / peak:.0%}")
                    del q, k, v, grad, fns
                    torch.cuda.empty_cache()
    console.print(table)
    console.print("'-': the backend cannot run the case (SDPA's flash backend takes no mask) or ran out "
                  "of memory. fwd target: triton forward / SDPA-flash (no mask) or / SDPA's best masked "
                  "backend (padded); checked for D=128, S>=4k, bf16.")
    if misses:
        console.print("[red]targets missed:[/red]\n  " + "\n  ".join(misses))


# ----------------------------------------------------------------------------- compile only


def compile_only(arch: int, dtype: torch.dtype, head_dims: list[int], console) -> int:
    """Compile every variant for sm_``arch`` without a GPU; report shared memory, registers, spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from rich.table import Table
    from triton.backends.compiler import GPUTarget

    from headwise.kernels.triton import jit, launch

    class Utils:  # what Triton asks a driver before launching; A100 / H100 limits
        def get_device_properties(self, device):
            return {"max_shared_mem": 232448 if arch >= 90 else 166912 if arch == 80 else 101376,
                    "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

        def load_binary(self, name, kernel, shared, device):
            return None, None, 0, 0, 1024

    class CompileOnlyDriver:  # compiles for ``arch``, launches nothing
        utils = Utils()

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def launcher_cls(self, src, metadata):
            return lambda *args, **kwargs: None

        def get_active_torch_device(self):
            return torch.device("cpu")

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

    def registers(kernel) -> tuple[str, str]:
        if not ptxas.exists():
            return "?", "?"
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(kernel.asm["ptx"])
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        info = subprocess.run([str(ptxas), "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                              capture_output=True, text=True).stderr
        os.unlink(f.name)
        regs, spills = re.search(r"Used (\d+) registers", info), re.search(r"(\d+) bytes spill stores", info)
        return (regs.group(1) if regs else "?"), (spills.group(1) if spills else "?")

    table = Table(title=f"triton kernels compiled for sm_{arch} ({dtype}); no GPU used")
    for col in ("variant", "kernel", "tiles (BM x BN)", "warps", "stages", "shared memory", "registers",
                "spilled bytes"):
        table.add_column(col)
    triton.runtime.driver.set_active(CompileOnlyDriver())
    interpreted = launch._interpreted
    launch._interpreted = lambda device: False  # CPU tensors, compiled kernels
    try:
        kernels = jit._compiled(False)
        variants = [(D, causal, window, padded, alibi) for D in head_dims
                    for causal, window, padded, alibi in ((False, None, False, False), (True, None, True, False),
                                                          (True, 64, True, True))]
        for D, causal, window, padded, alibi in variants:
            B, H, Hkv, S = 2, 4, 2, 300
            q = torch.randn(B, H, S, D).to(dtype)
            k, v = torch.randn(B, Hkv, S, D).to(dtype), torch.randn(B, Hkv, S, D).to(dtype)
            bias = torch.zeros(B, S).index_fill_(1, torch.arange(200, S), float("-inf")) if padded else None
            slopes = torch.rand(H) if alibi else None
            out, lse = launch._flash_forward(q, k, v, bias, slopes, D**-0.5, causal, window)
            launch._flash_backward(out, q, k, v, out, lse, bias, slopes, D**-0.5, causal, window,
                                   padded)
            name = f"D={D}" + (" causal" if causal else "") + (f" window={window}" if window else "") + \
                   (" padded" if padded else "") + (" alibi" if alibi else "")
            for fn in vars(kernels).values():
                cache = getattr(fn, "device_caches", {}).get(0, ({},))[0]
                for compiled in cache.values():
                    c = compiled.metadata
                    regs, spills = registers(compiled)
                    kernel = compiled.name.strip("_").removesuffix("_kernel")
                    table.add_row(name, kernel, _tiles_of(compiled), str(c.num_warps), str(c.num_stages),
                                  f"{c.shared / 1024:.0f} KiB", regs, spills)
                cache.clear()
    finally:
        launch._interpreted = interpreted
        with contextlib.suppress(RuntimeError):  # no real driver on this machine: nothing to go back to
            triton.runtime.driver.reset_active()
    console.print(table)
    return 0


def _tiles_of(compiled) -> str:
    """'BM x BN' of a compiled kernel, from its constexpr arguments ('-' for the delta kernel)."""
    constants = {k[0] if isinstance(k, tuple) else k: v for k, v in compiled.src.constants.items()}
    names = compiled.src.fn.arg_names
    if "BLOCK_N" not in names:
        return "-"
    return f"{constants.get(names.index('BLOCK_M'))} x {constants.get(names.index('BLOCK_N'))}"


def _console():
    from rich.console import Console

    return Console(width=max(shutil.get_terminal_size().columns, 150))  # the tables are wide


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        if importlib.util.find_spec("triton") is None:
            print("--compile-only needs triton: pip install 'headwise[triton]'", file=sys.stderr)
            return 1
        apply_configs(args.config)
        return compile_only(args.compile_only, DTYPES[args.dtype], args.head_dims, _console())
    why = refuse_without_gpu()
    if why is not None:
        print(why, file=sys.stderr)
        return 1
    import headwise

    console = _console()
    apply_configs(args.config)
    dtype = DTYPES[args.dtype]
    unusable = headwise.kernels.get_kernel("triton").available()
    if unusable:
        print(f"the triton backend is unavailable: {unusable}", file=sys.stderr)
        return 1
    ok = run_checks(dtype, args.head_dims, console)
    if not ok and not args.skip_check:
        console.print("[red]correctness check failed: not timing (pass --skip-check to time anyway)")
        return 1
    if args.check_only:
        return 0 if ok else 1
    run_speed(args, dtype, console)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
