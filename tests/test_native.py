"""headwise.native: the extension built on first use, and the pure-PyTorch path where it is not.

Legend: B batch, H query heads, Hkv key/value heads, T new tokens, N pages, P page size,
D head dim.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from headwise import native, paged, paged_native
from headwise.paged import paged_attention


def problem():
    """A GQA decode-and-verify step (T=2) of 3 sequences on shuffled pages of 4 keys, fp32."""
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(40, 2, 4, 16, generator=gen), torch.randn(40, 2, 4, 8, generator=gen)
    table = torch.randperm(40, generator=gen)[:36].reshape(3, 12)
    return torch.randn(3, 4, 2, 16, generator=gen), k_pages, v_pages, table, [45, 9, 30]


def per_sequence_kernels(q, k_pages, v_pages, table, lens):
    rows = [r[:-(-L // 4)] for r, L in zip(table.tolist(), lens, strict=True)]
    return paged.choose_backends(q, k_pages, v_pages, rows, lens)


def test_the_environment_variable_turns_the_extension_off_and_the_pytorch_path_agrees(monkeypatch):
    args = problem()
    served = native.load() is not None
    first = paged_attention(*args, return_lse=True)
    monkeypatch.setenv(native.DISABLE_VARIABLE, "1")
    monkeypatch.setattr(native, "_warned", set())
    assert native.load_state() == "unavailable" and native.unavailable() == "HEADWISE_NO_EXTENSION=1 is set"
    with pytest.warns(RuntimeWarning, match="native paged kernel is not available: HEADWISE_NO_EXTENSION=1 is set; "
                                            "paged attention runs its slower pure-PyTorch path"):
        out, lse = paged_attention(*args, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second call is silent
        again = paged_attention(*args, return_lse=True)
    assert torch.equal(again[0], out)
    torch.testing.assert_close(out, first[0], rtol=0, atol=2e-6 if served else 0)
    torch.testing.assert_close(lse, first[1], rtol=0, atol=2e-6 if served else 0)
    calls = per_sequence_kernels(*args)
    assert len(calls) == 3 and all(d.backend != paged_native.KERNEL for *_, d in calls)
    assert calls[0][3].passed_over[paged_native.KERNEL] == ("the native extension is not available: "
                                                            "HEADWISE_NO_EXTENSION=1 is set")


def test_a_failed_build_falls_back_once_and_says_why(monkeypatch, caplog):
    def no_compiler():
        raise OSError("g++: not found")

    monkeypatch.delenv(native.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_warned", set())
    monkeypatch.setattr(native, "_build", no_compiler)
    args = problem()
    assert native.load_state() == "not tried"
    assert per_sequence_kernels(*args)[0][3].backend == paged_native.KERNEL  # not tried: it would be built
    with pytest.warns(RuntimeWarning, match=r"building paged_attention.cpp failed \(OSError: g\+\+: not found\)"):
        out = paged_attention(*args)
    assert "building paged_attention.cpp failed" in caplog.text
    assert native.load() is None and native.load_state() == "unavailable"
    ref = paged_attention(*args, backend="matmul")  # the per-sequence path, by name
    assert torch.equal(out, ref)


def test_the_extension_name_changes_with_the_torch_version_and_installation(monkeypatch):
    """Another torch, or the same one in another environment (its include paths are in the build's
    command): another build, so that two environments never rebuild each other's."""
    tag = native._build_tag()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native._build_tag() != tag and len(tag) == 12
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert native._build_tag() != tag


def test_two_installs_of_one_source_share_one_build(monkeypatch, tmp_path):
    """A checkout and a wheel in one environment (two paths, the same text) build the same copy
    in one directory: torch reruns a build whose source path changed, so loading from each in
    turn rebuilt it every time. Another text gets another name."""
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "ext" / name))
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: calls.append((name, sources)))
    installs = []
    for where in ("checkout", "wheel"):
        (tmp_path / where).mkdir()
        installs.append(tmp_path / where / native.SOURCE.name)
        installs[-1].write_text(native.SOURCE.read_text())
    stamps = []
    for source in installs + installs[:1]:  # the checkout, the wheel, the checkout again
        monkeypatch.setattr(native, "SOURCE", source)
        native._build()
        stamps.append(Path(calls[-1][1][0]).stat().st_mtime_ns)
    names, sources = zip(*calls, strict=True)
    assert len(set(names)) == 1 and len({tuple(s) for s in sources}) == 1 and len(set(stamps)) == 1
    staged = Path(sources[0][0])
    assert staged.parent == tmp_path / "ext" / names[0] and staged.read_text() == installs[0].read_text()
    installs[1].write_text(installs[1].read_text() + "\n// another version\n")
    monkeypatch.setattr(native, "SOURCE", installs[1])
    native._build()
    assert calls[-1][0] != names[0] and Path(calls[-1][1][0]).read_text().endswith("another version\n")


def test_the_ninja_of_a_virtual_environment_that_is_not_activated_is_found(monkeypatch):
    """torch runs ninja from PATH: where it is not there, the ninja package's own bin is put first."""
    import sys
    import types

    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR="/venv/bin"))
    monkeypatch.setenv("PATH", "/usr/bin")
    native._ninja_on_path()
    assert native.os.environ["PATH"] == "/venv/bin:/usr/bin"
    monkeypatch.setattr(native.shutil, "which", lambda name: "/usr/bin/ninja")
    native._ninja_on_path()  # found on PATH: left as it is
    assert native.os.environ["PATH"] == "/venv/bin:/usr/bin"
