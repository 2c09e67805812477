"""Zeroes, in place, the payload of every CUDA fatbin entry of shared libraries but one architecture's.

Used on fbgemm-gpu's CUDA wheel before it is carried to a lent GPU machine (scripts/gpu_stack.sh): the
wheel holds SASS for sm_80, sm_90 and sm_100, and the zeroed entries compress to almost nothing, which
brings the H200's part under what one call carries. Sizes, headers and every other byte are left
as they are, so the loader still finds the kept entry; the others can no longer run.

    python scripts/fatbin_keep_arch.py 90 fbgemm_gpu/*.so
"""

from __future__ import annotations

import mmap
import struct
import sys

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries that follow
ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, payload size
ARCH_OFFSET = 28  # within an entry header: the SM number (90 for sm_90)


def keep_arch(path: str, arch: int) -> int:
    """Zeroes every entry of ``path``'s fatbins whose SM is not ``arch``; returns the bytes zeroed."""
    zeroed = 0
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = m.find(FATBIN_MAGIC)
        while at != -1:
            _, _, header_size, size = HEADER.unpack_from(m, at)
            if header_size != HEADER.size or at + header_size + size > len(m):
                at = m.find(FATBIN_MAGIC, at + 4)  # the magic's bytes inside something else
                continue
            entry, end = at + header_size, at + header_size + size
            while entry < end:
                _, _, entry_header, payload = ENTRY.unpack_from(m, entry)
                (sm,) = struct.unpack_from("<I", m, entry + ARCH_OFFSET)
                if sm != arch:
                    m[entry + entry_header:entry + entry_header + payload] = bytes(payload)
                    zeroed += payload
                entry += entry_header + payload
            at = m.find(FATBIN_MAGIC, end)
        m.flush()
    return zeroed


def main() -> None:
    arch, paths = int(sys.argv[1]), sys.argv[2:]
    total = sum(keep_arch(p, arch) for p in paths)
    print(f"zeroed {total / 2**20:.0f} MiB of other architectures' code in {len(paths)} files")


if __name__ == "__main__":
    main()
