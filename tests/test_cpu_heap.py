"""``platform.keep_cpu_heap``: afterwards (and after building an ``LLM`` on the CPU) a 16 MiB
block comes from the heap, where glibc's defaults map fresh pages for it (mallinfo2's mmapped
bytes grow by the block)."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

PROBE = """
import ctypes, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep_cpu_heap":
    from specdec.platform import keep_cpu_heap
    assert keep_cpu_heap() and keep_cpu_heap()  # applied, then cached
elif sys.argv[1] == "LLM":
    from specdec import LLM
    LLM(max_model_len=64)
mapped = libc.mallinfo2().hblkhd
block = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
print((libc.mallinfo2().hblkhd - mapped) >> 20)
"""


@pytest.mark.parametrize("setup, mapped_mib", [("defaults", 16), ("keep_cpu_heap", 0),
                                               ("LLM", 0)])
def test_a_large_block_comes_from_the_heap_once_kept(setup, mapped_mib):
    run = subprocess.run([sys.executable, "-c", PROBE, setup], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) == mapped_mib
