"""SLURM hostlists ("jean-zay-[1-3,7],gpu[01-02]") expanded to host names."""

from __future__ import annotations

import itertools
import shutil
import subprocess


def parse_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist in pure Python, keeping zero padding and bracket order."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_item(item))
    return hosts


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist with `scontrol show hostnames` when available, else in Python."""
    if not hostlist.strip():
        return []
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", hostlist],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            result = None
        # scontrol is the authority on syntax; fall back only when it cannot answer
        if result is not None and result.returncode == 0 and result.stdout.strip():
            return result.stdout.split()
    return parse_hostlist(hostlist)


def _split_top_level(hostlist: str) -> list[str]:
    """Split on commas that are outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    items, current, depth = [], [], 0
    for char in hostlist:
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in hostlist {hostlist!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {hostlist!r}")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {hostlist!r}")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    """Expand one host pattern; several brackets multiply out left to right."""
    pieces: list[list[str]] = []
    rest = item
    while "[" in rest:
        prefix, _, after = rest.partition("[")
        inside, closed, rest = after.partition("]")
        if not closed:
            raise ValueError(f"unbalanced '[' in hostlist item {item!r}")
        pieces.append([prefix])
        pieces.append(_expand_ranges(inside, item))
    pieces.append([rest])
    return ["".join(parts) for parts in itertools.product(*pieces)]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    """Expand "01-03,7" to ["01", "02", "03", "7"]; the width of the low end sets padding."""
    values: list[str] = []
    for part in ranges.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in hostlist item {item!r}")
        if not dash:
            values.append(low)
            continue
        start, stop = int(low), int(high)
        if stop < start:
            raise ValueError(f"descending range {part!r} in hostlist item {item!r}")
        width = len(low)
        values.extend(str(number).zfill(width) for number in range(start, stop + 1))
    return values
