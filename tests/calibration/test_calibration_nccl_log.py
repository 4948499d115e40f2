"""calibration.harness.nccl_log: NCCL's NCCL_DEBUG_SUBSYS=TUNING table read back, in the
printf formats of NCCL 2.27.5 (src/graph/tuning.cc, src/init.cc, src/debug.cc)."""
from calibration.harness.nccl_log import choices_for, parse_tuning, reported_choice

PREFIX = "dgx01:4242:4242 [0] NCCL INFO "
ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
PROTOS = ("LL", "LL128", "Simple")
FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


def _tuning_log(cells, nranks=8) -> str:
    """What rank 0 prints: the INIT line, then per block of 3 algorithms the header rows and
    one "%13s |" row per function of "%8.1f/%6.1f |" cells (latency us / bandwidth GB/s)."""
    lines = [f"{PREFIX}comm 0x55d0c0 rank 0 nRanks {nranks} nNodes 1 localRanks {nranks} localRank 0 MNNVL 0"]
    for block in range(3):
        algos = ALGOS[3 * block:3 * block + 3]
        lines.append(PREFIX + "  Algorithm   |" + "".join(" %14s   %14s   %14s |" % ("", a, "") for a in algos))
        lines.append(PREFIX + "  Protocol    |" + "".join(" %14s |" % p for _ in range(3) for p in PROTOS))
        lines.append(PREFIX + " Max NThreads |" + "".join(" %14d |" % 512 for _ in algos for _ in PROTOS))
        for f in FUNCS:
            lines.append(PREFIX + "%13s |" % f + "".join("%8.1f/%6.1f |" % cells(f, a, p) for a in algos
                                                          for p in PROTOS))
    return "\n".join(lines) + "\n"


def _cells(func, algo, proto):
    if algo == "Ring":
        return {"LL": (10.8, 160.0), "LL128": (27.3, 378.0), "Simple": (32.2, 411.4)}[proto]
    return (0.0, 0.0)


def test_tuning_table_is_read_back_per_communicator():
    log = "unrelated line\n" + _tuning_log(_cells) + _tuning_log(_cells, nranks=2)
    comms = parse_tuning(log)
    assert [c["nranks"] for c in comms] == [8, 2]
    row = comms[0]["table"]["all_gather"]
    assert row["Ring/LL128"] == [27.3, 378.0] and row["PAT/Simple"] == [0.0, 0.0]
    assert len(row) == len(ALGOS) * len(PROTOS)


def test_reported_choice_is_ncclTopoGetAlgoInfo_rule():
    row = parse_tuning(_tuning_log(_cells))[0]["table"]["all_gather"]
    assert [reported_choice(row, s) for s in (4096, 1 << 24, 1 << 30)] == ["Ring/LL", "Ring/LL128", "Ring/Simple"]
    records = [{"kind": "collective", "op": "all_gather", "size_bytes": 4096, "ranks": 8},
               {"kind": "collective", "op": "all_gather", "size_bytes": 4096, "ranks": 4},   # no table for 4
               {"kind": "gemm"}]
    assert choices_for(records, parse_tuning(_tuning_log(_cells))) == [
        {"op": "all_gather", "size_bytes": 4096, "ranks": 8, "nccl_choice": "Ring/LL"}]


def test_gloo_logs_record_nothing():
    assert parse_tuning("[W socket.cpp] gloo connected\n") == []
