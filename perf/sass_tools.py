"""Reading compiled Triton kernels without a GPU: registers and spills, global loads, the SASS of a kernel's loop and
the order of its memory operations, through the tools Triton bundles (``cuobjdump``, ``nvdisasm``, ``ptxas``).
:mod:`ptx_check` and :mod:`deltanet_sass` print them.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(\S.*?);")
_MEMORY_OPS = ("LDG", "STG", "BAR", "ATOMG", "RED", "EXIT")


def _tools() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def sass(kernel) -> list[str]:
    """Every SASS instruction of the kernel's cubin, in order (``nvdisasm``)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        lines = subprocess.run([str(_tools() / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    return [m[1] for line in lines.splitlines() if (m := _INSTRUCTION.search(line))]


def memory_order(kernel, after: str = "ATOMG") -> str:
    """The global loads, stores, barriers and atomics after the kernel's first ``after`` instruction, runs of one
    kind counted (``LDGx17 BARx1 STGx7``): how many memory round trips a tail waits for one after another."""
    code = sass(kernel)
    start = next((i for i, ins in enumerate(code) if after in ins), len(code))
    runs: list[list] = []
    for ins in code[start:]:
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        kind = op.split(".")[0]
        if kind in _MEMORY_OPS:
            if runs and runs[-1][0] == kind:
                runs[-1][1] += 1
            else:
                runs.append([kind, 1])
    return " ".join(f"{kind}x{n}" for kind, n in runs)


def loop_sass(kernel) -> list[str]:
    """The SASS instructions of the kernel's longest loop (its K loop), from Triton's bundled nvdisasm."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        lines = subprocess.run([str(_tools() / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    lines = lines.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    loops = [(labels[m[1]], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\(\.(L_x_\d+)\)", line)) and labels.get(m[1], i) < i]
    if not loops:
        return []
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [m[1] for line in lines[start:end + 1] if (m := _INSTRUCTION.search(line))]


def loop_instructions(kernel) -> int:
    """SASS instructions in the kernel's longest loop (its K loop)."""
    return len(loop_sass(kernel))


def code_loads_at(sass: list[str]) -> str:
    """Where in the loop body the weight-code loads (``ld.global.nc``: LDG ... CONSTANT) are issued, as
    fractions of its length: a prefetch issued at the end of the body hides nothing."""
    at = [i for i, ins in enumerate(sass) if "LDG" in ins and "CONSTANT" in ins]
    return "code loads at " + (f"{at[0] / len(sass):.0%}-{at[-1] / len(sass):.0%} of the loop" if at else "-")


def resources(kernel, arch: int = 90) -> str:
    """Registers and stack (spills show as stack) of the cubin, from Triton's bundled cuobjdump; on Hopper
    also whether ptxas serialised the wgmma pipeline (its C7515 note, which Triton does not show): the
    prefill kernel's hot loop once compiled to the same PTX but serialised and ran 25% slower."""
    tools = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True).stdout
        serial = ""
        if arch == 90 and "wgmma" not in kernel.asm["ptx"]:
            serial = " | mma.sync"
        elif arch == 90:  # ptxas again on the PTX, only for its notes (about half a second)
            ptx.write_text(kernel.asm["ptx"])
            notes = subprocess.run([str(tools / "ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx), "-o",
                                    str(Path(tmp) / "k.o")], capture_output=True, text=True).stderr
            serial = " | WGMMA SERIALISED (C7515)" if "C7515" in notes else " | wgmma pipelined"
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (f"regs {found[1]:>3s} stack {found[2]:>4s} B" if found else "regs ?") + serial


def describe(kernel, stores: bool = False) -> str:
    ptx = kernel.asm["ptx"]
    loads = Counter(re.findall(r"ld\.global(?:\.\w+)*", ptx))
    copies = Counter(f"cp.async {m}B" for m in re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*, (0x\w+)", ptx))
    parts = [f"{n}x {op.removeprefix('ld.global.')}" for op, n in loads.most_common()]
    if stores:
        parts += [f"{n}x {op.removeprefix('st.global.')} store"
                  for op, n in Counter(re.findall(r"st\.global(?:\.\w+)*", ptx)).most_common()]
    parts += [f"{n}x {op.replace('0x10', '16').replace('0x8', '8').replace('0x4', '4')}" for op, n in copies.items()]
    return f"shared {kernel.metadata.shared / 1024:5.1f} KB | " + ", ".join(parts)
