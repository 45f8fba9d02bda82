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


def test_the_extension_name_changes_with_the_torch_build_not_with_where_it_is_installed(monkeypatch):
    """Another torch version or revision (another ABI): another build. The same torch in another
    environment: the same build, which that environment imports without rebuilding."""
    tag = native._build_tag()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native._build_tag() != tag and len(tag) == 12
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    assert native._build_tag() != tag
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert native._build_tag() == tag


def _fake_torch_build(monkeypatch, tmp_path):
    """torch's build replaced by one that writes a Python file as the library and loads it,
    recording (name, sources) per call; its build directories under tmp_path / "ext"."""
    import importlib.util

    from torch.utils import cpp_extension

    calls = []

    def load(name, sources, **kw):
        calls.append((name, sources))
        library = Path(sources[0]).with_name(f"{name}.py")
        library.write_text(f"BUILT_FROM = {sources[0]!r}\n")
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / "ext" / name))
    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_two_installs_of_one_source_share_one_build(monkeypatch, tmp_path):
    """A checkout and a wheel (two paths, the same text), or two environments: one build, which
    every later load imports directly. torch reruns a build whose command changed (the source's
    path, the torch include paths), so loading from each in turn rebuilt it every time. Another
    text gets another name and its own build."""
    calls = _fake_torch_build(monkeypatch, tmp_path)
    installs = []
    for where in ("checkout", "wheel"):
        (tmp_path / where).mkdir()
        installs.append(tmp_path / where / native.SOURCE.name)
        installs[-1].write_text(native.SOURCE.read_text())
    modules = []
    for source, torch_at in zip(installs + installs[:1], ["/venv-a", "/venv-b", "/venv-b"], strict=True):
        monkeypatch.setattr(native, "SOURCE", source)  # the checkout, the wheel, the checkout again
        monkeypatch.setattr(torch, "__file__", f"{torch_at}/site-packages/torch/__init__.py")
        modules.append(native._build())
    assert len(calls) == 1, calls  # built once, then imported from its stamp
    (name, (staged,)), = calls
    assert Path(staged).parent == tmp_path / "ext" / name and Path(staged).read_text() == installs[0].read_text()
    assert {m.__name__ for m in modules} == {name} and {m.BUILT_FROM for m in modules} == {staged}
    assert (tmp_path / "ext" / name / native.STAMP).read_text() == f"{name}.py"
    installs[1].write_text(installs[1].read_text() + "\n// another version\n")
    monkeypatch.setattr(native, "SOURCE", installs[1])
    native._build()
    assert len(calls) == 2 and calls[-1][0] != name
    assert Path(calls[-1][1][0]).read_text().endswith("another version\n")


def test_a_stamped_library_that_does_not_import_is_built_again(monkeypatch, tmp_path):
    """The stamp names a library that is gone or broken: torch's build runs, and stamps anew."""
    calls = _fake_torch_build(monkeypatch, tmp_path)
    native._build()
    (name, (staged,)), = calls
    library = Path(staged).with_name(f"{name}.py")
    library.unlink()
    native._build()
    assert len(calls) == 2
    library.write_text("raise ImportError('undefined symbol: at::foo')\n")  # another torch's ABI
    assert native._build().BUILT_FROM == staged
    assert len(calls) == 3


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
