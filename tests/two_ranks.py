"""Two ranks of one machine, and a free port for their rendezvous, for the tests that launch or check collectives
(imported by name: tests/ is on sys.path)."""

import socket


def free_port() -> int:
    """A localhost TCP port no process listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two_ranks(fn) -> dict:
    """Run fn(rank, port, results) in two processes (torch.multiprocessing), each joining the process group at
    tcp://127.0.0.1:port; returns `results`, the dict each rank writes what it found into."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(fn, args=(free_port(), results), nprocs=2)
    return dict(results)
