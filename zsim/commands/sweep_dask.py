"""The Dask executor of `zsim sweep`: the points run on the workers of a Dask distributed
cluster (`--executor dask --scheduler tcp://HOST:8786`).

Why Dask rather than Ray: DeepSpeed users' clusters are Slurm or PBS machines, where
dask-jobqueue starts a scheduler and workers as ordinary batch jobs with no daemon or head
node to administer; a sweep point is a pure function of a small picklable input, which is
exactly a Dask future; and the client is a pip dependency (the `distributed` extra) without
a runtime of its own. The scenario is read here and sent once to every worker, so the
workers need zsim installed but not the scenario file.
"""
from __future__ import annotations

from zsim.commands.sweep import point_row
from zsim.errors import ZsimInputError

CONNECT_TIMEOUT_S = 5
CHUNK_POINTS = 16     # points per task: a Dask task costs about a millisecond of scheduling


def _rows(base, chunk):
    return [point_row(base, index, assignments) for index, assignments in chunk]


def dask_rows(base, todo, scheduler: str):
    """Yield the rows of `todo` ((index, assignments) pairs) as their tasks finish."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise ZsimInputError("--scheduler", scheduler,
                             "the Dask executor needs the distributed extra: pip install -e '.[distributed]'") from None
    try:
        client = Client(scheduler, timeout=f"{CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError, ValueError) as err:
        raise ZsimInputError("--scheduler", scheduler,
                             f"no Dask scheduler answered there within {CONNECT_TIMEOUT_S} s "
                             f"({type(err).__name__}); start one (dask scheduler) or fix the address") from None
    try:
        shared = client.scatter(base, broadcast=True)
        chunks = [todo[i:i + CHUNK_POINTS] for i in range(0, len(todo), CHUNK_POINTS)]
        futures = [client.submit(_rows, shared, chunk, pure=False) for chunk in chunks]
        for future in as_completed(futures):
            yield from future.result()
    finally:
        client.close()
