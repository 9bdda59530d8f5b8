"""The GPU's SM clock and power draw while spans of benchmark work run, sampled by nvidia-smi.

bench/kernel.py --clocks wraps each method's timed measurement of a cell in ClockRecorder.span(). One background
`nvidia-smi --query-gpu=clocks.sm,<power> --format=csv,noheader,nounits -i <index> -lms <period>` samples for the
whole run: it starts with the recorder, which waits for its first sample once (its start-up, NVML's initialisation,
can outlast a ~100 ms measurement), and ends at close() (the recorder is a context manager). A reader thread stamps
each line with time.monotonic() as it arrives; a span notes when it starts and ends and takes the samples stamped in
between, so spans add no pause before the work they measure. summarize() turns the samples into row fields: medians
of the SM clock (MHz) and power draw (W), and the sample count. Should the benchmark die without close(), nvidia-smi
ends at its next line, on the closed pipe (SIGPIPE).

Power: power.draw.instant where the driver has it (on Ampere and later power.draw is an average over the last
second, which mostly reflects whatever ran before a 100 ms span), else power.draw.

Lag: the lines arrive within a millisecond of the timestamp nvidia-smi gives them, but what they read trails the
GPU by up to about 100 ms (an H200: the power reading fell to idle within 0.1 s of the end of a 2 s matmul loop, the
SM clock rose back to 1980 MHz in the same 0.1 s). A span should last about a second for its medians to describe
its work: over bench/kernel.py's 100 ms measurements they often read the idle GPU before them (our hd128 forward,
non-causal 8k: 1965 MHz / 122 W over 100 ms, 1650 MHz / 721 W over 1 s, 635 and 637 TFLOP/s), so --clocks times
each measurement for 1000 ms by default.

Which GPU: nvidia-smi numbers GPUs by PCI bus order and ignores CUDA_VISIBLE_DEVICES, so torch's device is looked up
in `nvidia-smi --query-gpu=index,uuid,pci.bus_id` by its UUID, then by its PCI (domain, bus, device) where torch
reports them, then, with one GPU listed, as that GPU; anything else leaves the clocks off.

Whatever fails (no nvidia-smi, no matching GPU, nvidia-smi silent at the start or exiting at any time) prints one
note and switches the recorder off: the benchmark goes on without the fields.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

PERIOD_MS = 10  # a --clocks measurement lasts ~1 s (warm-up + --rep-ms): about a hundred samples
READY_TIMEOUT_S = 5.0  # how long nvidia-smi may take to print its first sample
MAX_SAMPLES = 10_000  # the buffer's length: 100 s at 10 ms, longer than any span
CLOCK_FIELD, POWER_FIELD, COUNT_FIELD = "sm_clock_mhz", "power_w", "clock_samples"
SAMPLE_FIELDS = (CLOCK_FIELD, POWER_FIELD)  # the order of the values in nvidia-smi's lines
POWER_QUERIES = ("power.draw.instant", "power.draw")  # preferred first


class ClockUnavailable(Exception):
    """nvidia-smi cannot sample this GPU here; the message says why."""


# ------------------------------------------------------------------------------------------------ parsing
def parse_value(text: str) -> float | None:
    """One csv value of nvidia-smi (nounits): a float, or None for "[N/A]", "[Not Supported]", blanks and the like."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_line(line: str) -> dict[str, float] | None:
    """One sample line ("1980, 512.34") -> {"sm_clock_mhz": 1980.0, "power_w": 512.34}, without the values that are
    not numbers; None when no value is."""
    values = [parse_value(v) for v in line.split(",")] if line.strip() else []
    sample = {field: v for field, v in zip(SAMPLE_FIELDS, values) if v is not None}
    return sample or None


def summarize(samples: list[dict[str, float]]) -> dict:
    """Row fields of the samples: the median of each value where some sample has it, and the sample count."""
    fields = {}
    for field in SAMPLE_FIELDS:
        values = [s[field] for s in samples if field in s]
        if values:
            fields[field] = statistics.median(values)
    fields[COUNT_FIELD] = len(samples)
    return fields


# ---------------------------------------------------------------------------------------- which GPU
@dataclass(frozen=True)
class SmiGpu:
    """One GPU as `nvidia-smi --query-gpu=index,uuid,pci.bus_id` lists it."""

    index: int
    uuid: str
    bus: tuple[int, int, int] | None  # PCI (domain, bus, device)


def parse_bus_id(text: str) -> tuple[int, int, int] | None:
    """nvidia-smi's PCI bus id "00000000:1B:00.0" (hex domain:bus:device.function) -> (domain, bus, device)."""
    try:
        domain, bus, rest = text.strip().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def normalize_uuid(uuid: str | None) -> str | None:
    """A GPU UUID without nvidia-smi's "GPU-" prefix, lower-case: torch and nvidia-smi spell it differently."""
    if not uuid:
        return None
    uuid = str(uuid).strip().lower()
    return uuid[len("gpu-"):] if uuid.startswith("gpu-") else uuid


def parse_gpu_listing(lines) -> list[SmiGpu]:
    """`nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader` -> its GPUs (unreadable lines skipped)."""
    gpus = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            gpus.append(SmiGpu(int(parts[0]), parts[1], parse_bus_id(parts[2])))
    return gpus


def smi_index(gpus: list[SmiGpu], uuid: str | None, bus: tuple[int, int, int] | None) -> int | None:
    """nvidia-smi's index of the GPU torch knows by uuid and PCI bus: the UUID's match, else the bus's, else the
    only GPU listed; None when none of these settles it."""
    by_uuid = [g for g in gpus if uuid is not None and normalize_uuid(g.uuid) == normalize_uuid(uuid)]
    by_bus = [g for g in gpus if bus is not None and g.bus == bus]
    for matches in (by_uuid, by_bus, gpus):
        if len(matches) == 1:
            return matches[0].index
    return None


def torch_identity(device: int) -> tuple[str | None, tuple[int, int, int] | None]:
    """(UUID, PCI (domain, bus, device)) of torch's CUDA device, each None where torch does not report it."""
    try:
        import torch

        props = torch.cuda.get_device_properties(device)
    except Exception:  # no CUDA build, no driver: the listing alone may still settle it
        return None, None
    uuid = getattr(props, "uuid", None)
    pci = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return (str(uuid) if uuid else None), (tuple(pci) if None not in pci else None)


# ------------------------------------------------------------------------------------------------ sampling
def _run_smi(executable: str, args: list[str]) -> list[str]:
    """nvidia-smi's stdout lines for a one-shot query; ClockUnavailable when it fails."""
    try:
        done = subprocess.run([executable, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClockUnavailable(f"{executable} {' '.join(args)}: {type(e).__name__}: {e}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ClockUnavailable(f"{executable} exited with {done.returncode}: {said[0] if said else 'no message'}")
    return done.stdout.splitlines()


def power_query(executable: str, index: int) -> str:
    """The first of POWER_QUERIES that this driver answers with a number for GPU index."""
    for query in POWER_QUERIES[:-1]:
        try:
            lines = _run_smi(executable, [f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(index)])
        except ClockUnavailable:
            continue  # an unknown field: an older driver
        if lines and parse_value(lines[0]) is not None:
            return query
    return POWER_QUERIES[-1]


class ClockRecorder:
    """The clocks of one benchmark run: one nvidia-smi samples GPU `index` from the recorder's creation to close()
    (or the end of its with block), and span() takes the samples stamped while its body runs. With index None, or
    once nvidia-smi fails, the recorder is off (note says why, printed once through say) and spans yield None."""

    def __init__(self, index: int | None, period_ms: int = PERIOD_MS, power: str = POWER_QUERIES[-1],
                 executable: str = "nvidia-smi", note: str = "", say=print, ready_timeout_s: float = READY_TIMEOUT_S):
        self.index, self.period_ms, self.power, self.executable = index, period_ms, power, executable
        self.note = ""
        self.say = say
        self.process: subprocess.Popen | None = None
        self._samples = collections.deque(maxlen=MAX_SAMPLES)  # (arrival time.monotonic(), sample), oldest first
        self._lock = threading.Lock()
        self._ready = threading.Event()  # set at the first sample, or when nvidia-smi's output ends
        self._ended = False  # nvidia-smi's output ended: it exited
        self._message = ""  # nvidia-smi's last line without a number: why it exits, should it
        if index is None:
            self._switch_off(note or "no GPU index")
        else:
            self._start(ready_timeout_s)

    @classmethod
    def for_torch_device(cls, device: int, period_ms: int = PERIOD_MS, say=print) -> ClockRecorder:
        """The recorder of torch's CUDA device `device` (its nvidia-smi index found as the module docstring says)."""
        executable = shutil.which("nvidia-smi")
        if executable is None:
            return cls(None, period_ms, note="nvidia-smi not found on PATH", say=say)
        try:
            listing = _run_smi(executable, ["--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"])
        except ClockUnavailable as e:
            return cls(None, period_ms, executable=executable, note=str(e), say=say)
        gpus = parse_gpu_listing(listing)
        uuid, bus = torch_identity(device)
        index = smi_index(gpus, uuid, bus)
        if index is None:
            note = (f"cannot tell which of nvidia-smi's {len(gpus)} GPUs is cuda:{device} "
                    f"(torch reports UUID {uuid}, PCI {bus})")
            return cls(None, period_ms, executable=executable, note=note, say=say)
        return cls(index, period_ms, power_query(executable, index), executable, say=say)

    @property
    def active(self) -> bool:
        return not self.note

    @property
    def description(self) -> str:
        """What the recorder samples, or why it does not (for the results' environment)."""
        if not self.active:
            return f"off: {self.note}"
        return f"nvidia-smi -i {self.index} clocks.sm,{self.power} every {self.period_ms} ms"

    @contextlib.contextmanager
    def span(self):
        """Yields a list that holds the samples stamped while the body ran once it ends; None while the recorder is
        off. Spans do not overlap: each drops the samples before its end from the buffer."""
        if not self._sampling():
            yield None
            return
        samples: list[dict[str, float]] = []
        start = time.monotonic()
        try:
            yield samples
        finally:
            end = time.monotonic()
            with self._lock:
                while self._samples and self._samples[0][0] <= end:
                    stamp, sample = self._samples.popleft()
                    if stamp > start:
                        samples.append(sample)
            self._sampling()  # nvidia-smi exited during the span: this span keeps its samples, later ones get None

    def close(self) -> None:
        """Ends nvidia-smi (again: nothing); spans afterwards yield None."""
        self.note = self.note or "closed"
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=2)
        self.process.stdout.close()

    def __enter__(self) -> ClockRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, ready_timeout_s: float) -> None:
        command = [self.executable, f"--query-gpu=clocks.sm,{self.power}", "--format=csv,noheader,nounits",
                   "-i", str(self.index), "-lms", str(self.period_ms)]
        stdbuf = shutil.which("stdbuf")
        if stdbuf:  # line-buffered output, should nvidia-smi buffer a pipe: lines arrive when sampled
            command = [stdbuf, "-oL", *command]
        try:  # stderr into the pipe too: one reader, and a message to note should nvidia-smi exit
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self._switch_off(f"{command[0]}: {type(e).__name__}: {e}")
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if self._ready.wait(ready_timeout_s):
            self._sampling()  # notes an nvidia-smi that exited at once
            return
        printed = f" (it printed {self._message!r})" if self._message else ""
        self.close()
        self._switch_off(f"nvidia-smi printed no sample within {ready_timeout_s:g} s{printed}")

    def _read(self) -> None:
        """The reader thread: every sample with its arrival time into the buffer, until nvidia-smi's output ends."""
        for line in iter(self.process.stdout.readline, ""):
            sample = parse_line(line)
            if sample is None:
                self._message = line.strip() or self._message
                continue
            with self._lock:  # stamped under the lock: a span's end never misses a sample stamped before it
                self._samples.append((time.monotonic(), sample))
            self._ready.set()
        self._ended = True
        self._ready.set()

    def _sampling(self) -> bool:
        """Whether the recorder is on; when nvidia-smi has exited, it notes why and switches off."""
        if self.active and self._ended:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=2)  # its output ended: it is exiting
            self.close()
            self._switch_off(f"nvidia-smi exited with {self.process.returncode}: {self._message or 'no message'}")
        return self.active

    def _switch_off(self, reason: str) -> None:
        self.note = reason
        self.say(f"note: --clocks: no SM clock / power fields from here on: {reason}")
