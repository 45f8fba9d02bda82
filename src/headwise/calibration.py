"""This machine's unit costs for "auto": measured once, kept on disk per CPU, torch version
and thread count.

"auto" prices the module's packed path against its dense one, and the ``varlen`` kernel
against SDPA with a mask, from unit costs (:class:`headwise.policy.Costs`: microseconds a
call, picoseconds a multiply-add, ...). Costs measured on one CPU misprice another: an
Intel Xeon ran the dense path faster where the AMD constants priced packing cheaper. So
the first decision that reads them measures this machine (about a second, the procedure
of :mod:`headwise.tune`), stores the result in a JSON file, and every later process on the
same machine, torch and thread count reads it back. ``headwise tune`` measures again. A
measurement is not kept where its timings scatter, or where other work kept tasks waiting for a
CPU while it ran (Linux's pressure stall information, ``/proc/pressure/cpu``): its costs would
price that load, not the machine. The built-in costs then serve, and the next process measures
again.

``HEADWISE_TUNE`` chooses: ``auto`` (the default) as above; ``off``: the built-in costs
of :mod:`headwise.policy`, never measured nor read from disk, and no packing choice measured
either (``headwise.module.measured``; the test suite runs so, for decisions that do not depend
on the machine); ``cache``: the stored costs where there are
any, never a measurement. ``HEADWISE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/headwise``, else
``~/.cache/headwise``) holds the file.

The measured costs are assigned to :data:`headwise.policy.INFERENCE_COSTS` and
:data:`~headwise.policy.TRAINING_COSTS`, so every memo keyed on ``policy.GENERATION``
forgets decisions made before; :func:`describe` says where the costs in use come from,
and ``dispatch()`` prints it beside every estimate.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from headwise import policy

__all__ = ["Calibration", "MeasurementError", "cache_file", "calibrate", "cpu_name", "current", "describe",
           "machine_key"]

logger = logging.getLogger(__name__)

MODES = ("auto", "off", "cache")
FILE_NAME = "calibration.json"


class MeasurementError(RuntimeError):
    """A measurement too noisy to keep (a machine busy with other work): nothing is stored."""


@dataclass(frozen=True)
class Calibration:
    """Unit costs measured on one machine.

    Attributes:
        inference: the costs of a forward under ``no_grad``.
        training: the costs of a forward and its backward.
        cpu: the CPU model (:func:`cpu_name`).
        torch: the torch version.
        threads: torch's intra-op threads during the measurement.
        seconds: how long the measurement took.
        measured_at: when, as a UTC ISO date and time.
    """

    inference: policy.Costs
    training: policy.Costs
    cpu: str
    torch: str
    threads: int
    seconds: float
    measured_at: str

    @property
    def key(self) -> str:
        return _key(self.cpu, self.torch, self.threads)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        """A stored entry; ValueError where it is not one (a hand-edited or older file)."""
        try:
            costs = {kind: policy.Costs(**{k: float(v) for k, v in data[kind].items()})
                     for kind in ("inference", "training")}
            return cls(costs["inference"], costs["training"], str(data["cpu"]), str(data["torch"]),
                       int(data["threads"]), float(data["seconds"]), str(data["measured_at"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a calibration entry: {e}") from e


def cpu_name() -> str:
    """The CPU model, as ``/proc/cpuinfo`` (or the platform) names it (read once a process).

    >>> isinstance(cpu_name(), str)
    True
    """
    return _cpu_name()


@functools.cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _key(cpu: str, version: str, threads: int) -> str:
    return f"{cpu} | torch {version} | {threads} thread{'s' if threads != 1 else ''}"


def machine_key() -> str:
    """What a calibration holds for: this CPU, this torch, torch's thread count now."""
    return _key(cpu_name(), torch.__version__, torch.get_num_threads())


def cache_file() -> Path:
    """The JSON file of stored calibrations, one entry per :func:`machine_key`."""
    base = os.environ.get("HEADWISE_CACHE_DIR")
    if base:
        return Path(base) / FILE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "headwise" / FILE_NAME


def mode() -> str:
    """``HEADWISE_TUNE``: ``auto`` (default), ``off`` or ``cache``."""
    value = os.environ.get("HEADWISE_TUNE", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"HEADWISE_TUNE={value!r} must be one of {MODES}: 'auto' measures this machine at first "
                         "use, 'cache' only reads stored costs, 'off' keeps the built-in ones")
    return value


def _read_all(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("headwise: ignoring the unreadable calibration file %s (%s)", path, e)
        return {}
    return data if isinstance(data, dict) else {}


def stored(key: str | None = None) -> Calibration | None:
    """The stored calibration for ``key`` (None: this machine's now), or None."""
    entry = _read_all(cache_file()).get(key or machine_key())
    if entry is None:
        return None
    try:
        return Calibration.from_json(entry)
    except ValueError as e:
        logger.warning("headwise: ignoring the calibration entry %r of %s (%s)", key, cache_file(), e)
        return None


def store(calibration: Calibration) -> Path:
    """Write ``calibration`` under its key (other machines' entries kept); the file's path.
    Written to a temporary file and renamed, so a reader never sees half of it."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_all(path)
    data[calibration.key] = calibration.to_json()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


_lock = threading.RLock()
# "threads": the thread count whose costs are in use (None: none loaded yet); the CPU and the
# torch version do not change within a process, so it is the one part of machine_key() to watch.
_state: dict = {"threads": None, "calibration": None, "source": "built in", "measuring": False}
_measure: list[Callable[[Any], tuple[policy.Costs, policy.Costs]]] = []


def measure_with(fn: Callable[[Any], tuple[policy.Costs, policy.Costs]]) -> None:
    """Register the measurement (:func:`headwise.tune.measure`; the package does this at
    import, so that this low layer never imports the module it measures)."""
    _measure[:] = [fn]


# Linux's pressure stall information: the microseconds, summed since boot, during which some
# runnable task waited for a CPU. Read before and after the measurement, it says how much other
# work competed with it, which the fits alone do not: a load that slows every point alike keeps
# them on a line. Measured on an Intel Xeon with 2 cores (torch 2.13): 0.2% of the measurement
# on a quiet machine; 46-99% beside one other busy process; and during a CI run's builds, a
# measurement whose fits held priced packing 14x and a GEMM 2.7x dearer than the same machine
# quiet, and "auto" kept that until `headwise tune`.
# Within a container, its own cgroup's file counts only the waiting of its own tasks (a host's
# other tenants on other CPUs do not refuse a measurement); the system's file serves elsewhere.
CPU_PRESSURE = Path("/proc/pressure/cpu")
MAX_WAITING = 0.1  # the share of the measurement's wall time that other work may keep a task waiting


def _own_cgroup() -> Path | None:
    """This process's cgroup-v2 directory (None: not Linux). In a container with its own cgroup
    namespace the path reads "/", and /sys/fs/cgroup is the container's own cgroup; on a host's
    root cgroup that directory has no ``cpu.pressure`` nor ``cpu.max``, and the system's serve."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return Path("/sys/fs/cgroup", line[3:].strip("/"))
    except OSError:
        pass
    return None


def _pressure_file() -> Path:
    """This process's cgroup's CPU pressure file (cgroup v2) where there is one, else the system's."""
    own = _own_cgroup()
    if own is not None and (own / "cpu.pressure").is_file():
        return own / "cpu.pressure"
    return CPU_PRESSURE


def _usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, and its cgroup's quota (cgroup v2 ``cpu.max``)."""
    cpus: float = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    own = _own_cgroup()
    try:
        quota, period = (own / "cpu.max").read_text().split()[:2] if own is not None else ("max", "1")
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def _cpu_waiting_us() -> int | None:
    """Microseconds some runnable task has waited for a CPU, summed since boot or since its cgroup
    began (None: not Linux, or a kernel without pressure stall information)."""
    try:
        lines = _pressure_file().read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                if field.startswith("total="):
                    try:
                        return int(field.removeprefix("total="))
                    except ValueError:
                        return None
    return None


def _check_quiet(waited_before: int | None, seconds: float) -> None:
    """Raise MeasurementError where other work kept tasks waiting for a CPU for more than
    :data:`MAX_WAITING` of a measurement that started at ``waited_before`` and took ``seconds``.

    Not where torch runs more threads than the process has CPUs (a container's quota below the
    host's cores, say): its own threads then wait for each other, and the measurement prices the
    way it runs, as it did before this check."""
    waited_after = _cpu_waiting_us()
    if waited_before is None or waited_after is None or seconds <= 0:
        return
    if torch.get_num_threads() > _usable_cpus():  # its own threads wait too: the costs of how it runs
        return
    share = (waited_after - waited_before) / 1e6 / seconds
    if share > MAX_WAITING:
        raise MeasurementError(
            f"the machine was busy: for {share:.0%} of the {seconds:.1f} s measurement some task waited for a CPU "
            f"({_pressure_file()}; kept up to {MAX_WAITING:.0%}), so the costs would price that load, not this "
            "machine; `headwise tune` measures again when the machine is quiet")


def calibrate(save: bool = True, timing: object = None) -> Calibration:
    """Measure this machine's unit costs now, use them from now on, and (``save``) store them.

    Args:
        save: store them in :func:`cache_file` for later processes.
        timing: how long the measurement times each point (:class:`headwise.tune.Timing`;
            None: about a second in all).

    Returns:
        The new :class:`Calibration`.

    Raises:
        MeasurementError: the timings scattered too much to fit, or other work kept tasks
            waiting for a CPU during the measurement (a busy machine, where Linux reports it);
            the costs in use stay as they were.
        RuntimeError: no measurement registered (``headwise`` not imported).
    """
    if not _measure:
        raise RuntimeError("no measurement registered: import headwise first (it registers headwise.tune.measure)")
    waited, start = _cpu_waiting_us(), time.perf_counter()
    _state["measuring"] = True
    try:
        inference, training = _measure[0](timing)
    finally:
        _state["measuring"] = False
    _check_quiet(waited, time.perf_counter() - start)
    calibration = Calibration(inference, training, cpu_name(), torch.__version__, torch.get_num_threads(),
                              time.perf_counter() - start, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    where = "not stored"
    if save:
        try:
            where = f"stored in {store(calibration)}"
        except OSError as e:  # a read-only home: the costs still serve this process
            where = f"not stored ({e})"
    _use(calibration, f"measured on this machine in {calibration.seconds:.1f} s, {calibration.measured_at}")
    logger.info("headwise: measured the unit costs of %s in %.1f s (%s; `headwise tune` measures again)",
                calibration.key, calibration.seconds, where)
    return calibration


def _use(calibration: Calibration | None, source: str) -> None:
    """Serve ``calibration``'s costs (None: the built-in ones, restored where measured ones
    served before, e.g. for another thread count; costs a caller assigned are left alone)."""
    previous = _state["calibration"]
    _state.update(threads=torch.get_num_threads(), calibration=calibration, source=source)
    if calibration is not None:
        costs = (calibration.inference, calibration.training)
    elif previous is not None:
        costs = (policy.BUILT_IN_INFERENCE_COSTS, policy.BUILT_IN_TRAINING_COSTS)
    else:
        return
    if (policy.INFERENCE_COSTS, policy.TRAINING_COSTS) != costs:
        policy.INFERENCE_COSTS, policy.TRAINING_COSTS = costs  # each assignment counts a policy GENERATION


def current() -> Calibration | None:
    """This machine's calibration in use, loading or measuring it as :data:`HEADWISE_TUNE
    <headwise.calibration>` says where this process has none yet; None where the built-in
    costs serve (``off``, ``cache`` without an entry, under torch.compile or a torch.func
    transform, where no measurement may run).

    Cheap after the first call (the thread count compared with the one loaded): the module
    and dispatch call it before every decision that reads the costs.
    """
    if torch.compiler.is_compiling() or _state["measuring"]:  # no file or timing in a trace; the measurement's calls
        return _state["calibration"]
    if _state["threads"] == torch.get_num_threads():
        return _state["calibration"]
    if policy.functorch_active() or policy.forward_ad_active():
        return _state["calibration"]  # no timing inside a transform
    with _lock:
        if _state["threads"] == torch.get_num_threads():
            return _state["calibration"]
        key = machine_key()
        chosen = mode()
        if chosen == "off":
            _use(None, "built in (HEADWISE_TUNE=off)")
            return None
        found = stored(key)
        if found is not None:
            _use(found, f"measured on this machine {found.measured_at} ({cache_file()})")
            return found
        if chosen == "cache" or not _measure:
            _use(None, f"built in (no calibration stored for {key}; `headwise tune` measures it)")
            return None
        try:
            return calibrate()
        except MeasurementError as e:  # this process keeps the built-in costs; the next one measures again
            logger.warning("headwise: kept the built-in unit costs: %s", e)
            _use(None, f"built in (this machine's measurement was too noisy to keep: {e})")
            return None
        except Exception as e:  # noqa: BLE001 - a measurement never breaks the call that asked for it
            logger.warning("headwise: kept the built-in unit costs: the measurement failed (%s: %s)",
                           type(e).__name__, e)
            _use(None, f"built in (this machine's measurement failed: {type(e).__name__}: {e})")
            return None


def describe() -> str:
    """Where the unit costs in use come from, for ``dispatch()`` and ``headwise tune``.

    >>> describe().startswith("unit costs")
    True
    """
    return f"unit costs {_state['source']}" if _state["threads"] is not None else "unit costs built in (not yet loaded)"


def forget() -> None:
    """Drop this process's calibration: the next decision loads or measures again, and the
    built-in costs are restored until then (for tests and ``headwise tune``)."""
    _state.update(threads=None, calibration=None, source="built in", measuring=False)
    policy.INFERENCE_COSTS = policy.BUILT_IN_INFERENCE_COSTS
    policy.TRAINING_COSTS = policy.BUILT_IN_TRAINING_COSTS
