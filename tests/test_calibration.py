"""headwise.calibration: this machine's unit costs, measured at first use, stored per CPU,
torch version and thread count, and named in every decision that reads them.

The measurement itself is replaced here by a function that returns known costs (or raises
as a noisy one would): what is tested is when it runs, what is stored and read back, and
what "auto" then decides and says. tests/test_tune.py runs the real measurement.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import headwise
from headwise import calibration, policy
from headwise.cli import main

FAST = policy.Costs(call_us=10.0, pack_us=1.0, bucket_us=1.0, gemm_ps=10.0, attn_ps=10.0, copy_ps=1.0)
SLOW_PACK = policy.Costs(call_us=10.0, pack_us=1e6, bucket_us=1e6, gemm_ps=10.0, attn_ps=10.0, copy_ps=1e6)


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """HEADWISE_TUNE=auto with a cache dir of the test's own and a stand-in measurement that
    counts its calls, on a machine that reads as quiet; the process's calibration forgotten
    before and after."""
    calls = []

    def measure(timing=None):
        calls.append(timing)
        return FAST, FAST

    monkeypatch.setenv("HEADWISE_TUNE", "auto")
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_measure", [measure])
    monkeypatch.setattr(calibration, "_cpu_waiting_us", lambda: 0)  # a quiet machine, whatever runs beside the test
    calibration.forget()
    yield calls
    calibration.forget()


def _padded_batch():
    x = torch.randn(8, 32, 64)
    lengths = torch.tensor([32, 3, 5, 2, 4, 6, 3, 2])
    return x, torch.arange(32)[None, :] < lengths[:, None]  # (B, S): most of the batch is padding


def test_the_first_priced_decision_measures_once_and_stores_it(calibrating, tmp_path):
    mha = headwise.MultiHeadAttention(64, 4).eval()
    x, mask = _padded_batch()
    with torch.no_grad():
        mha(x, mask)
        mha(x, mask)
    assert len(calibrating) == 1
    stored = json.loads((tmp_path / "calibration.json").read_text())
    assert list(stored) == [calibration.machine_key()]
    assert stored[calibration.machine_key()]["inference"]["call_us"] == FAST.call_us
    assert policy.INFERENCE_COSTS == FAST and policy.TRAINING_COSTS == FAST
    assert "unit costs measured on this machine" in mha.dispatch(x, mask).path_reason


def test_a_later_process_reads_the_stored_costs_without_measuring(calibrating, tmp_path):
    calibration.calibrate()
    calibration.forget()  # a new process: nothing loaded
    assert policy.INFERENCE_COSTS == policy.BUILT_IN_INFERENCE_COSTS
    calibrating.clear()
    found = calibration.current()
    assert calibrating == [] and found is not None and found.inference == FAST
    assert str(tmp_path) in calibration.describe()


def test_the_costs_are_kept_per_thread_count(calibrating):
    threads = torch.get_num_threads()
    try:
        calibration.current()
        torch.set_num_threads(threads + 1)
        calibration.current()
    finally:
        torch.set_num_threads(threads)
    assert len(calibrating) == 2
    assert len(json.loads(calibration.cache_file().read_text())) == 2


def test_measured_costs_change_the_decision_and_forget_the_memo(calibrating, monkeypatch):
    """Packing priced with costs that make it cheap, then with costs that make it dear: the
    module's remembered plan does not outlive the costs it was made from."""
    mha = headwise.MultiHeadAttention(64, 4).eval()
    x, mask = _padded_batch()
    monkeypatch.setattr(calibration, "_measure", [lambda timing=None: (FAST, FAST)])
    with torch.no_grad():
        assert mha.plan(x, mask).path == "packed"
        calibration.forget()
        monkeypatch.setenv("HEADWISE_CACHE_DIR", str(calibration.cache_file().parent / "other"))
        monkeypatch.setattr(calibration, "_measure", [lambda timing=None: (SLOW_PACK, SLOW_PACK)])
        plan = mha.plan(x, mask)
    assert plan.path == "dense" and "unit costs measured on this machine" in plan.why


def test_off_keeps_the_built_in_costs_and_reads_no_file(calibrating, monkeypatch, tmp_path):
    (tmp_path / "calibration.json").write_text(json.dumps({calibration.machine_key(): {"bad": 1}}))
    monkeypatch.setenv("HEADWISE_TUNE", "off")
    assert calibration.current() is None
    assert calibrating == [] and policy.INFERENCE_COSTS == policy.BUILT_IN_INFERENCE_COSTS
    assert calibration.describe() == "unit costs built in (HEADWISE_TUNE=off)"


def test_cache_mode_reads_but_never_measures(calibrating, monkeypatch):
    monkeypatch.setenv("HEADWISE_TUNE", "cache")
    assert calibration.current() is None and calibrating == []
    assert "`headwise tune` measures it" in calibration.describe()


def test_a_noisy_measurement_keeps_the_built_in_costs_and_stores_nothing(calibrating, monkeypatch, caplog):
    def noisy(timing=None):
        raise calibration.MeasurementError("attn_ps: time against work fits with R^2 0.31")

    monkeypatch.setattr(calibration, "_measure", [noisy])
    assert calibration.current() is None
    assert policy.TRAINING_COSTS == policy.BUILT_IN_TRAINING_COSTS
    assert not calibration.cache_file().exists()
    assert "R^2 0.31" in calibration.describe() and "R^2 0.31" in caplog.text
    assert calibration.current() is None  # this process does not measure again on every call


def test_a_measurement_while_other_work_waits_for_a_cpu_is_not_kept(calibrating, monkeypatch, caplog):
    """Fits that hold can still price a load: other work that kept tasks waiting for a CPU for
    most of the measurement (Linux's pressure stall information) makes it refused, as a noisy
    fit is: the built-in costs serve, nothing is stored, and the reason says why."""
    waited = [0]

    def measure(timing=None):
        waited[0] += 10**6  # a second of waiting, in a measurement far shorter
        return SLOW_PACK, SLOW_PACK

    monkeypatch.setattr(calibration, "_measure", [measure])
    monkeypatch.setattr(calibration, "_cpu_waiting_us", lambda: waited[0])
    assert calibration.current() is None
    assert policy.INFERENCE_COSTS == policy.BUILT_IN_INFERENCE_COSTS and not calibration.cache_file().exists()
    assert "the machine was busy" in calibration.describe() and "waited for a CPU" in caplog.text
    with pytest.raises(calibration.MeasurementError, match=r"the machine was busy: for \d+% of the"):
        calibration.calibrate()


def test_a_process_with_more_threads_than_cpus_keeps_its_measurement(calibrating, monkeypatch):
    """torch's threads beyond the CPUs the process may use (a container's quota below the host's
    cores) wait for each other whatever else runs: the check would refuse every measurement, so
    it stands aside and the measurement prices the way the process runs."""
    waited = [0]

    def measure(timing=None):
        waited[0] += 10**6
        return FAST, FAST

    monkeypatch.setattr(calibration, "_measure", [measure])
    monkeypatch.setattr(calibration, "_cpu_waiting_us", lambda: waited[0])
    monkeypatch.setattr(calibration, "_usable_cpus", lambda: torch.get_num_threads() - 0.5)
    assert calibration.calibrate().inference == FAST and calibration.cache_file().exists()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_the_usable_cpus_follow_the_affinity_and_the_cgroups_quota(monkeypatch, tmp_path):
    assert 0 < calibration._usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setattr(calibration, "_own_cgroup", lambda: tmp_path)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert calibration._usable_cpus() == min(1.5, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert calibration._usable_cpus() == len(os.sched_getaffinity(0))


def test_a_little_waiting_is_within_what_a_measurement_keeps(calibrating, monkeypatch):
    waited = [0]

    def measure(timing=None):
        time.sleep(0.05)  # seconds, of which other work kept a task waiting for 90% of the share allowed
        waited[0] += int(0.05 * 1e6 * calibration.MAX_WAITING * 0.9)
        return FAST, FAST

    monkeypatch.setattr(calibration, "_measure", [measure])
    monkeypatch.setattr(calibration, "_cpu_waiting_us", lambda: waited[0])
    assert calibration.calibrate().inference == FAST and calibration.cache_file().exists()


@pytest.mark.parametrize(("text", "expected"), [
    ("some avg10=0.00 avg60=0.00 avg300=2.57 total=328099479\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
     328099479),
    ("full avg10=0.00 avg60=0.00 avg300=0.00 total=5\n", None),
    ("some avg10=0.00 total=many\n", None),
])
def test_the_cpu_pressure_is_read_from_its_some_line(monkeypatch, tmp_path, text, expected):
    (tmp_path / "cpu").write_text(text)
    monkeypatch.setattr(calibration, "_pressure_file", lambda: tmp_path / "cpu")
    assert calibration._cpu_waiting_us() == expected
    monkeypatch.setattr(calibration, "_pressure_file", lambda: tmp_path / "absent")
    assert calibration._cpu_waiting_us() is None  # not Linux, or a kernel without PSI: no check


def test_the_pressure_file_is_the_processs_own_cgroups_where_it_has_one(monkeypatch, tmp_path):
    """cgroup v2: /sys/fs/cgroup/<the path in /proc/self/cgroup's 0:: line>/cpu.pressure, which
    counts the container's own tasks only (in a cgroup namespace the path is "/"); else the
    system's /proc/pressure/cpu."""
    own = calibration._own_cgroup()
    assert calibration._pressure_file() == (own / "cpu.pressure" if own and (own / "cpu.pressure").is_file()
                                            else calibration.CPU_PRESSURE)
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "0::/kubepods/pod7\n" if str(self) ==
                        "/proc/self/cgroup" else real(self, *a, **k))
    monkeypatch.setattr(Path, "is_file", lambda self: str(self) == "/sys/fs/cgroup/kubepods/pod7/cpu.pressure")
    assert calibration._pressure_file() == Path("/sys/fs/cgroup/kubepods/pod7/cpu.pressure")
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    assert calibration._pressure_file() == calibration.CPU_PRESSURE
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "0::/\n" if str(self) ==
                        "/proc/self/cgroup" else real(self, *a, **k))  # a container's own cgroup namespace
    monkeypatch.setattr(Path, "is_file", lambda self: str(self) == "/sys/fs/cgroup/cpu.pressure")
    assert calibration._pressure_file() == Path("/sys/fs/cgroup/cpu.pressure")


def test_this_machines_cpu_pressure_only_grows():
    first = calibration._cpu_waiting_us()
    if first is None:
        pytest.skip(f"{calibration.CPU_PRESSURE} is not readable here")
    assert calibration._cpu_waiting_us() >= first >= 0


def test_an_unreadable_file_is_measured_over(calibrating, tmp_path):
    (tmp_path / "calibration.json").write_text("{not json")
    assert calibration.current() is not None and len(calibrating) == 1
    assert calibration.machine_key() in json.loads((tmp_path / "calibration.json").read_text())


def test_a_malformed_entry_is_measured_over_and_other_machines_are_kept(calibrating, tmp_path):
    other = {"cpu": "X", "torch": "1", "threads": 1, "seconds": 1.0, "measured_at": "then",
             "inference": FAST.__dict__, "training": FAST.__dict__}
    (tmp_path / "calibration.json").write_text(json.dumps({calibration.machine_key(): {"inference": 3},
                                                           "X | torch 1 | 1 thread": other}))
    calibration.current()
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert len(calibrating) == 1 and set(data) == {calibration.machine_key(), "X | torch 1 | 1 thread"}


def test_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("HEADWISE_TUNE", "yes")
    with pytest.raises(ValueError, match=r"HEADWISE_TUNE='yes' must be one of \('auto', 'off', 'cache'\)"):
        calibration.mode()


def test_no_measurement_under_torch_compile_or_a_transform(calibrating):
    calibration.forget()

    def f(x):
        calibration.current()
        return x * 2

    torch.func.vmap(f)(torch.ones(3))
    torch.compile(f, backend="eager", fullgraph=False)(torch.ones(3))
    assert calibrating == []


def test_the_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("HEADWISE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration.cache_file() == tmp_path / "headwise" / "calibration.json"


def test_headwise_tune_prints_both_columns_within_80(calibrating, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["tune"]) == 0
    out = capsys.readouterr().out
    assert "call_us" in out and "train, here" in out and str(calibration.cache_file()) in out.replace("\n", "")
    assert [line for line in out.splitlines() if len(line) > 80] == []
    assert len(calibrating) == 1
    assert main(["tune", "--show"]) == 0 and len(calibrating) == 1  # shows, measures nothing


def test_headwise_tune_show_without_a_calibration_says_so(calibrating, capsys):
    assert main(["tune", "--show"]) == 1
    assert "no calibration stored" in capsys.readouterr().out


def test_headwise_tune_on_a_noisy_machine_stores_nothing_and_says_why(calibrating, monkeypatch, capsys):
    def noisy(timing=None):
        raise calibration.MeasurementError("copy_ps: time against work fits with R^2 0.42")

    monkeypatch.setattr(calibration, "_measure", [noisy])
    assert main(["tune"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["headwise tune: copy_ps: time against work fits with R^2 0.42"]
    assert not calibration.cache_file().exists()


def test_a_measurement_that_fails_never_breaks_the_call_that_asked(calibrating, monkeypatch, caplog):
    """Whatever the measurement raises (a default device or dtype it did not expect, say), the
    module's call runs on the built-in costs and the reason says so."""
    def broken(timing=None):
        raise RuntimeError("meta tensors have no data")

    monkeypatch.setattr(calibration, "_measure", [broken])
    mha = headwise.MultiHeadAttention(64, 4).eval()
    x, mask = _padded_batch()
    with torch.no_grad():
        assert mha(x, mask).shape == x.shape
    assert "measurement failed: RuntimeError: meta tensors have no data" in mha.dispatch(x, mask).path_reason
    assert "meta tensors have no data" in caplog.text and not calibration.cache_file().exists()


def test_a_thread_count_without_costs_goes_back_to_the_built_in_ones(calibrating, monkeypatch):
    """Measured for one thread count, then asked for another with none stored (cache mode):
    the built-in costs serve again, as the reason says, not the other count's."""
    threads = torch.get_num_threads()
    calibration.current()
    assert policy.INFERENCE_COSTS == FAST
    monkeypatch.setenv("HEADWISE_TUNE", "cache")
    try:
        torch.set_num_threads(threads + 1)
        assert calibration.current() is None
        assert policy.INFERENCE_COSTS == policy.BUILT_IN_INFERENCE_COSTS
        assert policy.TRAINING_COSTS == policy.BUILT_IN_TRAINING_COSTS
        assert "built in" in calibration.describe()
    finally:
        torch.set_num_threads(threads)
