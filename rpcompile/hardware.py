"""Hardware profiles: what the planner and the simulator assume about a machine.

Profiles are data (``configs/hardware.json``), not code branches. Figures come from datasheets
and the RoundPipe paper (see shared/REFERENCE.md); achieved PCIe bandwidth is usually well under
nominal, so the profiles carry an efficiency factor, and :func:`probe` measures a real machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources

__all__ = ["Hardware", "get_hardware", "list_hardware"]


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

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def usable_memory_bytes(self) -> int:
        return int((self.memory_gib - self.memory_reserve_gib) * 2**30)

    def compute_ms(self, flops: float) -> float:
        """Milliseconds one GPU needs for ``flops`` at the profile's assumed efficiency."""
        return flops / (self.matmul_tflops * 1e12 * self.mfu) * 1e3

    def h2d_ms(self, nbytes: float) -> float:
        return nbytes / (self.h2d_gbps * 1e9) * 1e3 if nbytes else 0.0

    def d2h_ms(self, nbytes: float) -> float:
        return nbytes / (self.d2h_gbps * 1e9) * 1e3 if nbytes else 0.0

    def with_gpus(self, gpus: int) -> Hardware:
        return replace(self, gpus=gpus)

    def to_dict(self) -> dict:
        return asdict(self)


@cache
def _table() -> dict[str, dict]:
    text = resources.files("rpcompile").joinpath("configs/hardware.json").read_text()
    return json.loads(text)


def list_hardware() -> list[str]:
    return sorted(_table())


def get_hardware(name: str | Hardware) -> Hardware:
    """The named profile; raises ``ValueError`` listing the known names when there is none."""
    if isinstance(name, Hardware):
        return name
    table = _table()
    if name not in table:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(table))}")
    return Hardware(name=name, **table[name])
