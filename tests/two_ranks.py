"""Two ranks of one machine for the tests that check a collective against a reference (imported by name: tests/
is on sys.path)."""

import socket


def spawn_two_ranks(fn) -> dict:
    """Run fn(rank, port, results) in two processes (torch.multiprocessing), each joining the process group at
    tcp://127.0.0.1:port; returns `results`, the dict each rank writes what it found into."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(fn, args=(port, results), nprocs=2)
    return dict(results)
