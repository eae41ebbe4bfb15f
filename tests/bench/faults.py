"""The fault bench's runner: every system x fault row, RUNS times, one table (docs/benchmarks.md).

Run by tests/bench-faults.sh, which prepares the venv and the binaries and
passes their paths in the environment (BENCH_PYTHON, BENCH_WARDEN,
BENCH_TORCHRUN). Each run starts a real torch job of 2 ranks
(tests/bench/bench_train.py, or tests/fixtures/torch_plain.py for the
teardown check), waits for it to end or for the bound, and reads its
output:

  fault    the faulting rank's own time.time() just before the fault
  back     the max over the ranks of the time the first step of the next
           attempt completed (in process: the first step after the restart)
  detect   warden: the embedded agent's first rank.hang / rank.exception /
           rank.exited event at or after the fault (its tracing log, on the
           host's clock); NVRx: the first rank's "term_ex" log line (a rank
           taking RankShouldRestart); torchrun: none
  first-try recovery: one restart brought every rank of the job (2) back,
           and every rank finished with exit code 0
  identical weights: both ranks printed the same hash of the weights

Per-run lines go to the file named on the command line (one JSON object a
line); the table goes to stdout.

  python3 tests/bench/faults.py RUNS RAW_FILE [ROW ...]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.environ["BENCH_PYTHON"]
WARDEN = os.environ["BENCH_WARDEN"]
TORCHRUN = os.environ["BENCH_TORCHRUN"]
TRAIN = os.path.join(ROOT, "tests", "bench", "bench_train.py")
PLAIN = os.path.join(ROOT, "tests", "fixtures", "torch_plain.py")
#: After the fault, how long a run may take to come back before it is
#: stopped and counted as not recovered: warden's rows get 45 s (a frozen
#: rank waits out restart.in_process_timeout, 30 s, then restarts in job);
#: the others, whose every recovery takes seconds or never comes, 30 s.
BOUND_S = float(os.environ.get("BENCH_BOUND_S", "45"))
OTHER_BOUND_S = float(os.environ.get("BENCH_OTHER_BOUND_S", "30"))
#: The whole run, start to end, at most (imports on a loaded machine included).
RUN_LIMIT_S = float(os.environ.get("BENCH_RUN_LIMIT_S", "120"))
STEPS = int(os.environ.get("BENCH_STEPS", "40"))
STEP_MS = int(os.environ.get("BENCH_STEP_MS", "50"))
FAULT_STEP = int(os.environ.get("BENCH_FAULT_STEP", "20"))
#: The embedded agent: the README's default tick (100 ms), the hang floor
#: at 1 s (default 3 s; NVRx's soft timeout is set to the same 1 s), sources
#: that cannot work on this machine off, host memory thresholds off (other
#: helpers' builds share its memory).
AGENT_TOML = (
    '[hang]\nfloor = "1s"\n'
    "[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n"
    "[kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n"
)

LINE_T = re.compile(r"\bt=([0-9]+\.[0-9]{6})")
FAULT = re.compile(r"fault \w+ step=\d+ pid=\d+ t=([0-9]+\.[0-9]{6})")
STEPPING = re.compile(r"stepping key=(\S+?) rank=(\d+) step=\d+ pid=\d+ t=([0-9]+\.[0-9]{6})")
ATTEMPT = re.compile(r"attempt key=\S+? rank=(\d+) world=\d+ start=\d+ pid=(\d+)")
STEPPING_PID = re.compile(r"stepping key=\S+? rank=(\d+) step=\d+ pid=(\d+)")
DONE = re.compile(r"done elastic=\d+ rank=(\d+) world=\d+ pid=\d+ weights=([0-9a-f]{16})")
WORLD = re.compile(r"done elastic=\d+ rank=\d+ world=(\d+)")
DONE_PLAIN = re.compile(r"done weights=([0-9a-f]{64}) restart=\d+")
ISO = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")
DETECT_KINDS = ("rank.hang", "rank.exception", "rank.exited", "job.hang_verdict")


@dataclass
class Row:
    name: str
    system: str
    fault: str
    start: Callable[["Run"], list]  # -> list of Popen
    note: str = ""


@dataclass
class Run:
    row: Row
    index: int
    work: str
    out: str = ""
    procs: list = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_args(r: Run, system: str, fault: str) -> list:
    ck = os.path.join(r.work, "ckpt")
    st = os.path.join(r.work, "store")
    os.makedirs(ck, exist_ok=True)
    os.makedirs(st, exist_ok=True)
    return [
        TRAIN, "--system", system, "--steps", str(STEPS), "--step-ms", str(STEP_MS),
        "--checkpoint-dir", ck, "--store-dir", st, "--fault", fault, "--fault-rank", "1",
        "--fault-step", str(FAULT_STEP),
    ]  # fmt: skip


def popen(r: Run, argv: list, env: Optional[dict] = None, name: str = "job") -> subprocess.Popen:
    out = open(os.path.join(r.work, f"{name}.out"), "w")
    err = open(os.path.join(r.work, f"{name}.err"), "w")
    return subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)


def warden_env() -> dict:
    env = dict(os.environ)
    env.pop("WARDEN_SOCKET", None)
    # The embedded agent's events, stamped, in the launcher's stderr.
    env["RUST_LOG"] = "warn,warden_core::events=info"
    return env


def warden_job(mode: Optional[str], fault: str, plain: bool = False) -> Callable[[Run], list]:
    def start(r: Run) -> list:
        cfg = os.path.join(r.work, "agent.toml")
        with open(cfg, "w") as f:
            f.write(AGENT_TOML)
        job = f"bench-{r.row.name}-{r.index}"
        argv = [WARDEN, "--socket", os.path.join(r.work, "none.sock"), "run"]
        if mode:
            argv.append(mode)
        argv += ["--nproc-per-node", "2", "--rdzv-id", job, "--log-dir", os.path.join(r.work, "logs"),
                 "--agent-config", cfg, "--", PY]  # fmt: skip
        if plain:
            argv += [PLAIN, "--steps", str(STEPS), "--step-ms", str(STEP_MS), "--abort-at-exit-rank", "1"]
        else:
            argv += train_args(r, "warden", fault)
        return [popen(r, argv, warden_env())]

    return start


def torchrun_job(fault: str) -> Callable[[Run], list]:
    def start(r: Run) -> list:
        argv = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
        argv += train_args(r, "torchrun", fault)
        return [popen(r, argv)]

    return start


def nvrx_job(fault: str) -> Callable[[Run], list]:
    """Two ranks started directly (NVRx's Wrapper hosts its own TCPStore on MASTER_PORT)."""

    def start(r: Run) -> list:
        port = free_port()
        procs = []
        for rank in range(2):
            env = dict(os.environ)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            procs.append(popen(r, [PY] + train_args(r, "nvrx", fault), env, name=f"rank{rank}"))
        return procs

    return start


ROWS = [
    Row("warden-inproc-hang", "warden in process", "hang", warden_job(None, "hang")),
    Row("warden-inproc-transient", "warden in process", "transient", warden_job(None, "transient")),
    Row("warden-inproc-frozen", "warden in process", "stop", warden_job(None, "stop")),
    Row("warden-warm-crash", "warden warm in-job", "crash", warden_job("--standby", "crash")),
    Row("warden-cold-crash", "warden cold in-job", "crash", warden_job("--no-standby", "crash")),
    Row("torchrun-crash", "torchrun --max-restarts 3", "crash", torchrun_job("crash")),
    Row("torchrun-hang", "torchrun --max-restarts 3", "hang", torchrun_job("hang")),
    Row("nvrx-transient", "NVRx 0.4.1 Wrapper", "transient", nvrx_job("transient")),
    Row("nvrx-hang", "NVRx 0.4.1 Wrapper", "hang", nvrx_job("hang")),
    Row("nvrx-frozen", "NVRx 0.4.1 Wrapper", "stop", nvrx_job("stop")),
    Row("warden-teardown-abort", "warden (zero-code)", "abort at exit", warden_job(None, "none", plain=True)),
]


def read_all(r: Run) -> str:
    text = []
    for name in sorted(os.listdir(r.work)):
        if name.endswith(".out") or name.endswith(".err"):
            with open(os.path.join(r.work, name), errors="replace") as f:
                text.append(f.read())
    return "\n".join(text)


def fault_time(r: Run) -> Optional[float]:
    for name in sorted(os.listdir(r.work)):
        if name.endswith(".out"):
            with open(os.path.join(r.work, name), errors="replace") as f:
                m = FAULT.search(f.read())
                if m:
                    return float(m.group(1))
    return None


def stop(procs: list) -> None:
    """Ends what is left of a run: SIGTERM to each job's session, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session's stragglers too
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def detection(r: Run, text: str, t_fault: Optional[float]) -> Optional[float]:
    if t_fault is None:
        return None
    best = None
    if r.row.name.startswith("warden"):
        import calendar

        # The launcher's log may carry colour codes between a key and its value.
        for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
            m = ISO.search(line)
            if not m or not any(f"kind={k}" in line or f'kind="{k}"' in line for k in DETECT_KINDS):
                continue
            whole, _, frac = m.group(1).partition(".")
            t = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float("0." + (frac or "0"))
            if t >= t_fault - 0.01 and (best is None or t < best):
                best = t
    elif r.row.name.startswith("nvrx"):
        for line in text.splitlines():
            if line.startswith("nvrx-log ") and "term_ex" in line:
                t = float(LINE_T.search(line).group(1))
                if best is None or t < best:
                    best = t
    return best


def bound(row: Row) -> float:
    return BOUND_S if row.name.startswith("warden") else OTHER_BOUND_S


def one(row: Row, index: int, base: str) -> dict:
    work = tempfile.mkdtemp(prefix=f"{row.name}-{index}-", dir=base)
    r = Run(row, index, work)
    t0 = time.time()
    r.procs = row.start(r)
    timed_out = False
    while any(p.poll() is None for p in r.procs):
        now = time.time()
        t_fault = fault_time(r)
        if now - t0 > RUN_LIMIT_S or (t_fault is not None and now - t_fault > bound(row)):
            timed_out = True
            break
        time.sleep(0.2)
    stop(r.procs)
    codes = [p.returncode for p in r.procs]
    text = read_all(r)
    t_fault = fault_time(r)
    stepping: dict = {}
    done: dict = {}
    keys = set()
    # Two ranks share one stdout under torchrun: lines can run together, so
    # each record is matched by its exact shape, wherever it is.
    for m in STEPPING.finditer(text):
        keys.add(m.group(1))
        stepping.setdefault(m.group(2), float(m.group(3)))
    for m in DONE.finditer(text):
        done[m.group(1)] = m.group(2)
    for m in DONE_PLAIN.finditer(text):
        done[str(len(done))] = m.group(1)
    back = max(stepping.values()) - t_fault if t_fault is not None and len(stepping) == 2 else None
    det = detection(r, text, t_fault)
    weights = set(done.values())
    if row.name == "warden-teardown-abort":
        restarted = bool(re.search(r"\bstep \d+ restart=1\b", text))
        rec = {
            "row": row.name, "run": index, "exit_codes": codes, "timed_out": timed_out,
            "ended_with_result": codes == [0] and not restarted and len(done) == 2,
            "restarted": restarted, "ranks_done": len(done), "identical_weights": len(done) == 2 and len(weights) == 1,
        }  # fmt: skip
    else:
        recovered = (
            back is not None and len(keys) == 1 and len(done) == 2 and all(c == 0 for c in codes) and not timed_out
        )
        rec = {
            "row": row.name, "run": index, "exit_codes": codes, "timed_out": timed_out,
            "fault_t": t_fault, "back_s": back, "detect_t": det,
            # The ranks that did step again, whether or not every rank did.
            "back_some_s": max(stepping.values()) - t_fault if t_fault is not None and stepping else None,
            "detect_to_back_s": (t_fault + back - det) if back is not None and det is not None else None,
            "fault_to_detect_s": (det - t_fault) if det is not None and t_fault is not None else None,
            "attempts_after_fault": sorted(keys), "ranks_back": sorted(stepping), "ranks_done": len(done),
            "final_worlds": sorted(set(WORLD.findall(text))),
            "first_try": recovered, "identical_weights": len(done) == 2 and len(weights) == 1,
            "same_pids": same_pids(text), "warm": text.count("warm start from standby"),
        }  # fmt: skip
    rec["work"] = work
    return rec


def same_pids(text: str) -> Optional[bool]:
    """Whether every rank stepped again in the process it started in."""
    first: dict = {}
    later: dict = {}
    for m in ATTEMPT.finditer(text):
        first.setdefault(m.group(1), m.group(2))
    for m in STEPPING_PID.finditer(text):
        later.setdefault(m.group(1), m.group(2))
    if len(later) < 2:
        return None
    return all(first.get(k) == v for k, v in later.items())


def fmt_s(xs: list) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    runs = int(sys.argv[1])
    raw_path = sys.argv[2]
    only = sys.argv[3:]
    rows = [r for r in ROWS if not only or r.name in only]
    base = tempfile.mkdtemp(prefix="warden-bench-faults.")
    keep = os.environ.get("BENCH_KEEP") == "1"
    results: dict = {r.name: [] for r in rows}
    with open(raw_path, "a") as raw:
        for row in rows:
            for i in range(1, runs + 1):
                rec = one(row, i, base)
                results[row.name].append(rec)
                raw.write(json.dumps(rec) + "\n")
                raw.flush()
                short = {k: rec.get(k) for k in ("back_s", "fault_to_detect_s", "detect_to_back_s", "first_try",
                                                 "identical_weights", "same_pids", "exit_codes", "ended_with_result")}  # fmt: skip
                print(f"# {row.name} run {i}: {short}", file=sys.stderr, flush=True)
                if not keep:
                    shutil.rmtree(rec["work"], ignore_errors=True)
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    head = ("system", "fault", "fault -> every rank stepping", "detection -> stepping", "first-try", "same weights", "notes")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        rs = results[row.name]
        n = len(rs)
        if row.name == "warden-teardown-abort":
            ok = sum(1 for x in rs if x["ended_with_result"])
            codes = sorted({str(x["exit_codes"][0]) for x in rs})
            print(f"| {row.system} | {row.fault} | ended with the job's result {ok}/{n} | | | "
                  f"{sum(1 for x in rs if x['identical_weights'])}/{n} | exit codes {','.join(codes)} |")  # fmt: skip
            continue
        backs = [x["back_s"] for x in rs if x["first_try"]]
        dets = [x["detect_to_back_s"] for x in rs if x["first_try"] and x["detect_to_back_s"] is not None]
        first = sum(1 for x in rs if x["first_try"])
        same = sum(1 for x in rs if x["identical_weights"])
        notes = []
        sp = [x["same_pids"] for x in rs if x["first_try"]]
        if sp:
            notes.append(f"same pids {sum(1 for s in sp if s)}/{len(sp)}")
        if row.name.startswith("warden-warm"):
            notes.append(f"both ranks warm {sum(1 for x in rs if x['warm'] >= 2)}/{n}")
        fd = [x["fault_to_detect_s"] for x in rs if x["fault_to_detect_s"] is not None]
        if fd:
            notes.append(f"fault -> detection {statistics.median(fd):.2f} s")
        shrunk = sum(1 for x in rs if x.get("final_worlds") == ["1"])
        if shrunk:
            some = [x["back_some_s"] for x in rs if x.get("final_worlds") == ["1"] and x["back_some_s"] is not None]
            notes.append(f"{shrunk}/{n} went on with 1 rank of 2, the other ended (its survivor stepping {fmt_s(some)})")
        to = sum(1 for x in rs if x["timed_out"])
        if to:
            notes.append(f"{to}/{n} stopped at the {bound(row):.0f} s bound")
        print(f"| {row.system} | {row.fault} | {fmt_s(backs)} | {fmt_s(dets)} | {first}/{n} | {same}/{n} | {'; '.join(notes)} |")
    print(f"\nraw per-run lines: {raw_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
