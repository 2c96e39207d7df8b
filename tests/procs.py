"""A test helper: the live processes of a process group or a session, read from /proc."""
from __future__ import annotations

import os
from typing import List

#: /proc/PID/stat's fields after the command name: 0 the state, 2 the process group, 3 the session
_FIELD = {"pgid": 2, "sid": 3}


def live_pids(by: str, ident: int) -> List[int]:
    """The pids whose process group (``by="pgid"``) or session (``by="sid"``) is ``ident``, zombies
    left out (an orphan's zombie waits for init, which in a container may never reap it)."""
    index, found = _FIELD[by], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[index]) == ident and fields[0] != "Z":
            found.append(int(entry))
    return found
