"""Hardware profiles: what the planner and the simulator assume about a machine.

Profiles are data (``configs/hardware.json``), not code branches. Figures come from datasheets
and the RoundPipe paper (arXiv 2604.27085); achieved PCIe bandwidth is usually well under
nominal, so the profiles carry an efficiency factor, and :func:`probe` measures a real machine.
Pageable-memory bandwidth (``pageable_h2d_gbps`` / ``pageable_d2h_gbps``, what a run with
``host_memory="pageable"`` is timed at): ``rtx4090x8``'s 12.5 GB/s each way is an assumption,
half its pinned 25, not a measurement; ``cpu``'s equals its pinned figures (virtual workers copy
the same either way); the other profiles have none (docs/compiler.md, hardware profiles).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources

from rpcompile.choices import check_option
from rpcompile.errors import InvalidInput

__all__ = [
    "Hardware",
    "Link",
    "get_hardware",
    "get_link",
    "host_ram",
    "host_ram_bytes",
    "list_hardware",
    "list_links",
    "probe",
    "seconds_per_call",
]


@dataclass(frozen=True)
class Hardware:
    """One server: ``gpus`` identical GPUs joined to the host by PCIe (no P2P assumed)."""

    name: str
    gpu: str
    gpus: int
    matmul_tflops: float  # dense low-precision matmul throughput one GPU sustains (TFLOP/s)
    memory_gib: float  # device memory per GPU
    h2d_gbps: float  # achieved host-to-device bandwidth per GPU link (GB/s), one direction
    d2h_gbps: float  # achieved device-to-host bandwidth per GPU link (GB/s)
    host_mem_gbps: float  # host memory bandwidth shared by all links and the optimizer (GB/s)
    optimizer_params_per_s: float  # CPU optimizer throughput (parameters updated per second)
    mfu: float = 0.5  # fraction of matmul_tflops the cost model assumes a layer achieves
    transfer_latency_us: float = 10.0  # fixed cost of one DMA / kernel launch
    memory_reserve_gib: float = 1.5  # left free for the CUDA context and fragmentation
    # h2d_gbps / d2h_gbps are copies from and to pinned host memory (the runtime's default).
    # Copies from pageable memory go through a driver staging buffer and are slower; 0 means
    # the profile does not know them (probe() measures them on a GPU).
    pageable_h2d_gbps: float = 0.0
    pageable_d2h_gbps: float = 0.0
    host_ram_gib: float = 0.0  # host RAM of the server (0: not known; plan --host-ram)
    # Virtual workers: how many of their computes the machine's CPU cores run at full speed
    # at once (probe: the cores over the intra-op threads each compute uses; a measurement
    # may give a fraction); the simulator shares them among the computes, copies and host
    # operations running at once. 0: each worker computes on its own device (a GPU),
    # nothing shared.
    shared_cores: float = 0
    # Virtual workers: the CPU time (microseconds) the runtime spends on a compute or host
    # action besides its work (the main thread submitting it, its thread taking it and
    # handling its events; a compute's binding of inputs and gradient buffer). The simulator
    # adds it to those actions' work; a transfer's is in its copy rate, h2d_gbps / d2h_gbps.
    # rpcompile.runtime.calibrate measures both on a run of the runtime. 0: not counted (a
    # GPU worker's launches overlap its device's work).
    action_overhead_us: float = 0.0
    # Whether the host's optimizer driver keeps its undo journal (PlanOptions.undo_journal,
    # rpcompile.runtime.optim ``rollback``): a copy of what each OPT and SHADOW changes,
    # taken before it changes it, which the simulator and the planner's bound charge to
    # those actions. A property of how the run uses the host, not of the machine, carried
    # here because the profile is what reaches every replay and bound of the search;
    # compile() sets it from the training option (with_undo_journal).
    undo_journal: bool = True
    # Which host memory the run copies from and to (PlanOptions.host_memory): "pinned" (the
    # host store and staging buffers page-locked; transfers at h2d_gbps / d2h_gbps) or
    # "pageable" (nothing pinned; transfers at pageable_h2d_gbps / pageable_d2h_gbps). Like
    # undo_journal, a property of the run carried on the profile, so that every replay and
    # bound of the search times transfers at one bandwidth (link_h2d_gbps / link_d2h_gbps);
    # compile() sets it from the training option (with_host_memory).
    host_memory: str = "pinned"
    # The network to the other servers of a data-parallel run (what REDUCE actions use);
    # None: the profile is of one server alone (with_link() adds one).
    link: Link | None = None

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def usable_memory_bytes(self) -> int:
        return int((self.memory_gib - self.memory_reserve_gib) * 2**30)

    def compute_ms(self, flops: float) -> float:
        """Milliseconds one GPU needs for ``flops`` at the profile's assumed efficiency."""
        return flops / (self.matmul_tflops * 1e12 * self.mfu) * 1e3

    @property
    def link_h2d_gbps(self) -> float:
        """The host-to-device bandwidth transfers are timed at: pinned or pageable, as
        :attr:`host_memory` says (the simulator and the partitioner's bounds read this)."""
        return self.pageable_h2d_gbps if self.host_memory == "pageable" else self.h2d_gbps

    @property
    def link_d2h_gbps(self) -> float:
        """The device-to-host bandwidth transfers are timed at (see :attr:`link_h2d_gbps`)."""
        return self.pageable_d2h_gbps if self.host_memory == "pageable" else self.d2h_gbps

    def h2d_ms(self, nbytes: float) -> float:
        return nbytes / (self.link_h2d_gbps * 1e9) * 1e3 if nbytes else 0.0

    def d2h_ms(self, nbytes: float) -> float:
        return nbytes / (self.link_d2h_gbps * 1e9) * 1e3 if nbytes else 0.0

    def with_gpus(self, gpus: int) -> Hardware:
        return replace(self, gpus=gpus)

    def with_link(self, link: Link | str | None) -> Hardware:
        """The profile joined to other servers by ``link`` (a preset name or a
        :class:`Link`; None: no link)."""
        return replace(self, link=None if link is None else get_link(link))

    def with_undo_journal(self, on: bool) -> Hardware:
        """The profile as a run with the undo journal on (the default) or off times it."""
        return self if self.undo_journal == on else replace(self, undo_journal=bool(on))

    def with_host_memory(self, kind: str) -> Hardware:
        """The profile as a run from ``kind`` host memory times it: ``"pinned"`` (transfers
        at ``h2d_gbps`` / ``d2h_gbps``) or ``"pageable"`` (at ``pageable_h2d_gbps`` /
        ``pageable_d2h_gbps``, as RoundPipe's ``pin_model="off"``). Raises ``ValueError``,
        naming the profile and the fix, when pageable is asked of a profile without pageable
        figures."""
        check_option("host_memory", kind)
        if kind == "pageable" and not (self.pageable_h2d_gbps > 0 and self.pageable_d2h_gbps > 0):
            raise InvalidInput(
                f"host_memory='pageable' needs the pageable-memory bandwidth of the "
                f"{self.name!r} profile, which has none (pageable_h2d_gbps="
                f"{self.pageable_h2d_gbps:g}, pageable_d2h_gbps={self.pageable_d2h_gbps:g}): "
                f"plan with a profile that has them (`rpcompile hardware` lists them; "
                f"rtx4090x8 does), measure this machine with rpcompile.hardware.probe() on "
                f"its GPU, or give the profile pageable_h2d_gbps and pageable_d2h_gbps "
                f"(dataclasses.replace(hw, pageable_h2d_gbps=..., pageable_d2h_gbps=...)); or "
                f"keep host_memory='pinned'")
        return self if self.host_memory == kind else replace(self, host_memory=kind)

    def pageable(self) -> Hardware:
        """``with_host_memory("pageable")``: the profile with transfers timed at its
        pageable-memory bandwidth; raises when the profile lacks it."""
        return self.with_host_memory("pageable")

    def describe_host_memory(self, option: str = "host_memory='pageable'") -> str:
        """One line: which host memory the plan assumes and the link bandwidth that gives
        (what ``rpcompile plan`` and ``Compiled.explain()`` print); ``option``: how the
        caller's user asks for pageable memory."""
        known = self.pageable_h2d_gbps > 0 and self.pageable_d2h_gbps > 0
        if self.host_memory == "pageable":
            return (f"pageable host memory ({option}: nothing pinned), H2D "
                    f"{self.link_h2d_gbps:g} GB/s, D2H {self.link_d2h_gbps:g} GB/s per GPU; "
                    f"pinned would be {self.h2d_gbps:g}/{self.d2h_gbps:g} GB/s")
        other = (f"pageable would be {self.pageable_h2d_gbps:g}/{self.pageable_d2h_gbps:g} "
                 f"GB/s ({option})" if known else
                 "pageable bandwidth unknown for this profile (hardware.probe() measures it "
                 "on a GPU)")
        return (f"pinned host memory (the runtime pins its host store and staging buffers), "
                f"H2D {self.h2d_gbps:g} GB/s, D2H {self.d2h_gbps:g} GB/s per GPU; {other}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Link:
    """The network between servers (one NIC per server, full duplex): what data parallel
    across servers reduces its gradients over. ``gbit_per_s`` is the nominal line rate;
    ``efficiency`` the fraction a host-memory all-reduce (gloo over TCP) achieves of it."""

    key: str
    name: str
    gbit_per_s: float
    efficiency: float = 0.9
    latency_us: float = 30.0  # one message's fixed cost (TCP round trip, gloo's step)

    @property
    def bytes_per_ms(self) -> float:
        return self.gbit_per_s * self.efficiency * 1e9 / 8 / 1e3

    def allreduce_ms(self, nbytes: float, nodes: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``nodes`` servers: each sends and receives
        ``2 (n - 1) / n`` of the bytes, in ``2 (n - 1)`` steps (reduce-scatter, all-gather)."""
        if nodes <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (nodes - 1)
        return steps / nodes * nbytes / self.bytes_per_ms + steps * self.latency_us * 1e-3

    def reduce_ms(self, nbytes: float, nodes: int) -> float:
        """Gloo's reduce of ``nbytes`` to one rank over ``nodes`` servers: a ring
        reduce-scatter (each rank sends and receives ``(n - 1) / n`` of the bytes, ``n - 1``
        steps), then the root receives the other ``n - 1`` chunks (``(n - 1) / n`` of the
        bytes through its one link, one step): ``2 (n - 1) / n`` of the bytes at the root's
        link, as much as an all-reduce, in ``n`` steps."""
        if nodes <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (nodes - 1) / nodes * nbytes / self.bytes_per_ms + \
            nodes * self.latency_us * 1e-3

    def broadcast_ms(self, nbytes: float, nodes: int) -> float:
        """Gloo's broadcast of ``nbytes`` from one rank over ``nodes`` servers: a binomial
        tree, ``ceil(log2 n)`` rounds, each moving the whole buffer."""
        if nodes <= 1 or nbytes <= 0:
            return 0.0
        rounds = (nodes - 1).bit_length()
        return rounds * (nbytes / self.bytes_per_ms + self.latency_us * 1e-3)


@cache
def _file() -> dict[str, dict]:
    text = resources.files("rpcompile").joinpath("configs/hardware.json").read_text()
    return json.loads(text)


def _table() -> dict[str, dict]:
    return {k: v for k, v in _file().items() if k != "links"}


def list_links() -> list[str]:
    return sorted(_file()["links"])


def get_link(name: str | Link) -> Link:
    """The named inter-server link preset (``eth25``, ``eth100``); raises ``ValueError``
    listing the known names when there is none."""
    if isinstance(name, Link):
        return name
    links = _file()["links"]
    if not isinstance(name, str) or name not in links:
        raise InvalidInput(f"unknown link {name!r}; known: {', '.join(sorted(links))}")
    return Link(key=name, **links[name])


def list_hardware() -> list[str]:
    return sorted(_table())


def get_hardware(name: str | Hardware) -> Hardware:
    """The named profile; raises ``ValueError`` listing the known names when there is none."""
    if isinstance(name, Hardware):
        return name
    table = _table()
    if name not in table:
        raise InvalidInput(f"unknown hardware profile {name!r}; known: {', '.join(sorted(table))}")
    row = dict(table[name])
    if "link" in row:
        row["link"] = get_link(row["link"])
    return Hardware(name=name, **row)


def probe(device: str = "auto", size: int | None = None, repeats: int = 3,
          min_seconds: float = 0.02, fresh: bool = False) -> Hardware:
    """Measure this machine: matmul throughput, device memory, host<->device copy bandwidth,
    host memory bandwidth and the fused-AdamW rate, as a :class:`Hardware` named ``probed``.

    ``device``: ``"cuda"`` (GPU 0; every visible GPU counted), ``"cpu"`` (virtual workers) or
    ``"auto"``. Achieved PCIe bandwidth is often far below the datasheet, so plan with a
    probe where the profile table has no entry for the machine. ``size``: the side of the
    square matmul (default 4096 in bf16 on CUDA, 2048 in fp32 on the CPU).

    Each figure is the best of ``repeats`` timed windows; a window repeats its operation until
    it lasts ``min_seconds``, so neither launch overhead nor the synchronize that ends it
    (tens of microseconds, as long as one matmul on a fast GPU) is counted as work. The result
    is kept for the process: a later call with the same arguments returns it (every compile
    without a hardware profile asks for one) unless ``fresh`` is true.
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise InvalidInput("probe(device='cuda') needs a CUDA device; use device='cpu'")
    key = (device, size, repeats, min_seconds)
    if fresh or key not in _PROBED:
        _PROBED[key] = _probe(cuda, size or (4096 if cuda else 2048), repeats, min_seconds)
    return _PROBED[key]


_PROBED: dict[tuple, Hardware] = {}


def _probe(cuda: bool, size: int, repeats: int, min_seconds: float) -> Hardware:
    import torch

    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def seconds(fn) -> float:
        return seconds_per_call(fn, sync, repeats, min_seconds)

    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    out = torch.empty(size, size, device=dev, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: library handles, kernel selection
    tflops = 2 * size**3 / seconds(lambda: torch.mm(a, b, out=out)) / 1e12

    nbytes = 64 * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / seconds(lambda: other.copy_(host, non_blocking=cuda)) / 1e9
    d2h = nbytes / seconds(lambda: host.copy_(other, non_blocking=cuda)) / 1e9
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    # Virtual workers copy with the CPU whichever host memory it is: the same figures.
    pageable_h2d = nbytes / seconds(lambda: other.copy_(pageable)) / 1e9 if cuda else h2d
    pageable_d2h = nbytes / seconds(lambda: pageable.copy_(other)) / 1e9 if cuda else d2h
    scratch = torch.empty_like(host)
    host_bw = 2 * nbytes / seconds(lambda: scratch.copy_(host)) / 1e9

    n = 4 * 2**20
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.zeros(n)
    opt = torch.optim.AdamW([param], fused=True)
    opt.step()
    opt_rate = n / seconds_per_call(opt.step, lambda: None, repeats, min_seconds)

    if cuda:
        props = torch.cuda.get_device_properties(0)
        name, gpus, mem_gib = props.name, torch.cuda.device_count(), props.total_memory / 2**30
        shared = 0
    else:
        name, gpus = "CPU (virtual workers)", max(1, _cpu_cores() // 2)
        mem_gib = 4.0
        # The matmul above ran at the intra-op thread count the workers compute with (torch's,
        # process-wide); one compute occupies that many cores.
        shared = max(1, _cpu_cores() // torch.get_num_threads())
    return Hardware(
        name="probed", gpu=name, gpus=gpus, matmul_tflops=tflops, memory_gib=mem_gib,
        h2d_gbps=h2d, d2h_gbps=d2h, host_mem_gbps=host_bw, optimizer_params_per_s=opt_rate,
        mfu=0.5 if cuda else 0.8, memory_reserve_gib=1.5 if cuda else 0.0,
        pageable_h2d_gbps=pageable_h2d, pageable_d2h_gbps=pageable_d2h,
        host_ram_gib=host_ram_bytes() / 2**30, shared_cores=shared,
    )


def _cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS says)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def seconds_per_call(fn: Callable[[], object], sync: Callable[[], object], repeats: int = 3,
                     min_seconds: float = 0.02, max_calls: int = 1 << 16) -> float:
    """Seconds one call of ``fn`` takes: the best of ``repeats`` windows, each ``calls`` calls
    between two ``sync()`` (a device synchronize, for work a call only enqueues), over
    ``calls``. ``calls`` doubles (at most to ``max_calls``) until a window lasts
    ``min_seconds``, so the synchronize and the first launch weigh little in it."""
    calls = 1
    while True:
        elapsed = _window(fn, sync, calls)
        if elapsed >= min_seconds or calls >= max_calls:
            break
        calls = min(max_calls, calls * 2)
    best = elapsed
    for _ in range(repeats - 1):
        best = min(best, _window(fn, sync, calls))
    return best / calls


def _window(fn: Callable[[], object], sync: Callable[[], object], calls: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return time.perf_counter() - start


def host_ram(stated: int | None, hw: Hardware | None = None,
             option: str = "host_ram_bytes") -> tuple[int, str]:
    """(bytes, where the figure comes from) of the host RAM a plan's host state must fit:
    ``stated`` (what the option named ``option`` said), else ``hw``'s ``host_ram_gib`` (a
    profiled server), else this machine's (:func:`host_ram_bytes`; 0 where the OS does not
    say, and no check can be made)."""
    if stated is not None:
        return int(stated), option
    if hw is not None and hw.host_ram_gib:
        return int(hw.host_ram_gib * 2**30), f"the {hw.name} profile"
    return host_ram_bytes(), "this machine's, probed"


def host_ram_bytes() -> int:
    """Physical RAM of this machine (0 where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
