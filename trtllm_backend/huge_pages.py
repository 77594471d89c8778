"""Weights and KV segments on 2 MiB pages (transparent huge pages, asked for with madvise).

Why: a decode step streams every resident weight once. On 4 KiB pages that is a TLB miss per 4 KiB, and in a
virtual machine each miss walks the guest's and the host's page tables; the hardware prefetchers also restart
at every 4 KiB boundary. Measured on the 2-core VM against a twin engine on 4 KiB pages, the two taking turns
(`tools.bench_engine --huge-pages-ab`, results/engine/bench_engine_huge_pages_ab.txt): all-INT4 steps 1.12x faster at
batch 1, 1.06-1.09x at 8-32, 1.16x at 512 cached tokens; full precision 1.03-1.11x.

How: `empty` maps fresh anonymous memory itself (from malloc a large buffer may reuse heap pages that are
already resident on 4 KiB pages), one page's worth of address space more than it needs (never touched, so
never resident), starts the buffer on a 2 MiB boundary and madvises the whole pages inside it before anything
touches them; the tail past the last whole page stays on 4 KiB pages, so resident bytes are what the buffer
holds, as the memory account counts them. The mapping goes when the last tensor on it does. A layer's tensors are packed into one such buffer (`pack`): an INT4 layer of SmolLM2 is
2.2 MB of small tensors, none of which would fill a page alone. Where the kernel does not offer THP (another
OS, `never` in sysfs) madvise fails and the buffer is an ordinary one.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each packed tensor starts on a cache line (the kernels' vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting (always / madvise / never), or 'unavailable'."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def unavailable_reason() -> str | None:
    """Why buffers from `empty` will not be on huge pages on this machine (for a warning at load), or None."""
    mode = thp_mode()
    if mode in ("always", "madvise"):
        return None
    if mode == "unavailable":
        return f"this kernel has no transparent huge pages ({THP_SETTING} is missing)"
    return (
        f"transparent huge pages are off ({THP_SETTING}: {mode}); `echo madvise > {THP_SETTING}` on the "
        "host turns them on"
    )


def empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer of `nbytes` whose whole 2 MiB pages are asked for as huge pages (a plain buffer below
    one page's size, or where the OS has no MADV_HUGEPAGE)."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # MAP_PRIVATE: a shared anonymous mapping is shmem, whose huge pages follow another setting (shmem_enabled)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensors on it keep the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel built without THP: ordinary pages
        pass
    return raw[start : start + nbytes]


def empty_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, in a buffer from `empty`."""
    return empty(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` (contiguous, same dtypes, shapes and values) side by side in one buffer from
    `empty`; tensors on another device come back as they are. The buffer lives while any of them does."""
    cpu = [t for t in tensors if t.device.type == "cpu"]
    if not cpu:
        return list(tensors)
    buf = empty(sum(_padded(t) for t in cpu))
    out, at = [], 0
    for t in tensors:
        if t.device.type != "cpu":
            out.append(t)
            continue
        n = t.numel() * t.element_size()
        out.append(buf[at : at + n].view(t.dtype).view(t.shape).copy_(t))
        at += _padded(t)
    return out


def anon_huge_bytes() -> int:
    """This process's anonymous memory on huge pages (AnonHugePages of /proc/self/smaps_rollup; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
