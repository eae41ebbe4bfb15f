"""Heal against checkpoint restart, side by side (docs/benchmarks.md, "Heal from a live replica").

The same job (examples/heal/ddp.py: 4 ranks, gloo, CPU, plain DDP, a
checkpoint every 40 steps, 30 ms steps), the same fault (rank 1 SIGKILLed from
outside once it logged step 60, i.e. 20 steps after a checkpoint) and the same
machine, in one run, alternating:
  heal              warden run, the state declared (warden.heal): the rank is healed
  checkpoint        warden run, EXAMPLE_HEAL=0: today's in-job restart from the tier
  torchft-defaults  torchft 0.2.0 as shipped (tests/bench/heal_torchft.py): its
                    Manager, DDP and Optimizer on ProcessGroupGloo, 4 replica groups,
                    the replacement started cold right after the kill
  torchft-tuned     the same with its DDP comm hook's one-line patch, the
                    replacement pre-started, the lighthouse's join timeout 100 ms
  torchrun          torchrun --max-restarts 3: every rank restarts from the
                    newest checkpoint (tests/bench/torchrun_ddp.py)
--example hsdp runs the heal and checkpoint rows on examples/heal/hsdp.py
instead (FSDP2 over a 2 x 2 mesh ("replicate", "shard"); the same fault:
rank 1's replacement takes its shards from rank 3); torchft and torchrun
have no HSDP row here. The torchft rows need tests/bench/torchft_venv.sh run once. --torchft-midstep
(a side experiment, another fault) kills the torchft group only once its
next quorum request reached the lighthouse: inside the step, not before it.

Per run: the seconds from the kill (this script's clock, just after kill())
to every rank logging a step (the log's own time.time()), the steps redone
(the most (rank, step) pairs any rank logged again), whether the digests equal
the fault-free run's (each system's own fault-free run: torchft averages
its gradients in another order than DDP), and whether it recovered at the first try (exit 0 with
one heal, or one in-job restart), and for warden's rows whether every survivor logged its steps
from one pid (it kept its process, and a GPU's CUDA context with it). Prints one JSON line per run
and a table.

  python tests/bench/heal.py --runs 10 [--rows heal,checkpoint,torchft-defaults,torchft-tuned,torchrun]
      [--example ddp|hsdp] [--warden target/debug/warden] [--python .venv/bin/python] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import heal_torchft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, CKPT, KILL_AT, VICTIM = 100, 40, 60, 1


def read(log: str) -> list[list[str]]:
    try:
        with open(log) as f:
            return [l.split() for l in f]
    except FileNotFoundError:
        return []


def one(a, work: str, job: str, heal: bool, kill: bool) -> dict:
    log = os.path.join(work, f"{job}.log")
    env = dict(os.environ, EXAMPLE_LOG=log, EXAMPLE_STEPS=str(STEPS), EXAMPLE_CKPT_EVERY=str(CKPT),
               EXAMPLE_STEP_MS="30", EXAMPLE_HEAL="1" if heal else "0",
               WARDEN_HEAL_STORE_DIR=os.path.join(work, f"{job}-stores"))
    env.pop("WARDEN_SOCKET", None)
    err = open(os.path.join(work, f"{job}.err"), "w")
    p = subprocess.Popen([a.warden, "--socket", os.path.join(work, "none.sock"), "run", "--nproc-per-node", "4",
                          "--rdzv-id", job, "--log-dir", os.path.join(work, "logs"), "--",
                          a.python, os.path.join(ROOT, f"examples/heal/{a.example}.py")],
                         stdout=subprocess.DEVNULL, stderr=err, env=env)
    killed = None
    deadline = time.monotonic() + 600
    while p.poll() is None and time.monotonic() < deadline:
        if kill and killed is None:
            for f in read(log):
                if len(f) == 7 and f[1] == "step" and int(f[2]) >= KILL_AT and int(f[4]) == VICTIM:
                    os.kill(int(f[6]), signal.SIGKILL)
                    killed = time.time()
                    break
        time.sleep(0.005)
    if p.poll() is None:
        p.kill()
    rc = p.wait()
    lines = read(log)
    steps = [f for f in lines if len(f) == 7 and f[1] == "step"]
    done = {int(f[3]): f[5] for f in lines if len(f) == 6 and f[1] == "done"}
    back = last_survivor = replacement = None
    if killed:
        first = {}
        for f in steps:
            if float(f[0]) > killed:
                first.setdefault(int(f[4]), float(f[0]))
        if len(first) == 4:
            back = max(first.values()) - killed
            # Who came back last: the replacement, or a survivor.
            last_survivor = max(t for r, t in first.items() if r != VICTIM) - killed
            replacement = first[VICTIM] - killed
    # The survivors keep their processes (and with them a GPU's CUDA context):
    # every rank but the victim logged its steps from one pid.
    pids = collections.defaultdict(set)
    for f in steps:
        pids[int(f[4])].add(f[6])
    kept = all(len(p) == 1 for r, p in pids.items() if r != VICTIM) if pids else False
    seen = collections.Counter((int(f[4]), int(f[2])) for f in steps)
    redone = collections.Counter(r for (r, _), c in seen.items() if c > 1)
    errtext = open(os.path.join(work, f"{job}.err")).read()
    restarts = errtext.count("restarting in job")
    heals = errtext.count("heal started in ")
    first_try = rc == 0 and ((heal and heals == 1 and restarts == 0) or (not heal and restarts == 1)) if kill else rc == 0
    return {"job": job, "mode": "heal" if heal else "checkpoint", "rc": rc, "back_s": back,
            "redone": max(redone.values(), default=0), "digests": done, "first_try": first_try,
            "survivors_kept_pids": kept, "replacement_first_step_s": replacement,
            "survivors_first_step_s": last_survivor, **(split(work, job, errtext) if heal and kill else {})}


def show_logs(work: str, job: str) -> None:
    """The end of a failed run's rank logs and the launcher's, on stderr:
    where only this output comes back (a GPU machine's run)."""
    for path in sorted(glob.glob(os.path.join(work, "logs", job, "**", "rank_*.stderr.log"), recursive=True))[:8]:
        print(f"--- {path}:\n" + "".join(open(path, errors="replace").readlines()[-20:]), file=sys.stderr)
    err = os.path.join(work, f"{job}.err")
    if os.path.exists(err):
        print("--- the launcher:\n" + "".join(open(err, errors="replace").readlines()[-25:]), file=sys.stderr)


def split(work: str, job: str, launcher_err: str) -> dict:
    """Where a heal's time went, from what the launcher and the replacement
    say: the launcher's "heal started in X s" (from the failure seen to the
    replacement's process started from a standby), the replacement's
    "CUDA ready ... in X s" (the example's first CUDA call: the context; GPU
    runs only) and its "healed from rank ... in X s" (warden.heal's resume:
    the all_gather of steps, the state received and loaded). The rest of
    the kill -> every rank stepping (detection, the process group's rebuild,
    the first step) is what these do not cover."""
    out = {}
    m = re.search(r"heal started in ([0-9.]+)s", launcher_err)
    if m:
        out["heal_started_s"] = float(m.group(1))
    for path in sorted(glob.glob(os.path.join(work, "logs", job, "**", f"rank_{VICTIM}.stderr.log"), recursive=True)):
        text = open(path, errors="replace").read()
        for key, pat in (("cuda_ready_s", r"CUDA ready on \S+ in ([0-9.]+) s"),
                         ("resume_s", r"healed from rank \d+ at step \d+: \d+ bytes in ([0-9.]+) s")):
            found = re.findall(pat, text)
            if found:
                out[key] = float(found[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--example", choices=("ddp", "hsdp"), default="ddp")
    ap.add_argument("--warden", default=os.path.join(ROOT, "target/debug/warden"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--rows", default="heal,checkpoint,torchft-defaults,torchft-tuned,torchrun")
    ap.add_argument("--torchft-stock", default=os.path.join(ROOT, "target/bench-torchft-stock"))
    ap.add_argument("--torchft-patched", default=os.path.join(ROOT, "target/bench-torchft-patched"))
    ap.add_argument("--out", help="append every run's JSON line to this file too")
    ap.add_argument("--torchft-midstep", action="store_true",
                    help="torchft rows only: kill the victim once its next quorum request reached the "
                         "lighthouse (in the step, not before it): a side experiment, another fault")
    a = ap.parse_args()
    modes = a.rows.split(",")
    unknown = set(modes) - {"heal", "checkpoint", "torchft-defaults", "torchft-tuned", "torchrun"}
    if unknown:
        ap.error(f"unknown rows: {sorted(unknown)}")
    if a.example != "ddp" and set(modes) - {"heal", "checkpoint"}:
        ap.error(f"--example {a.example}: only the heal and checkpoint rows run it")
    work = tempfile.mkdtemp(prefix="warden-bench-heal.")
    # Job ids unique to this run: the checkpoint tier is the host's, keyed
    # by job id, and a first attempt restores what a job of that id saved.
    tag = os.path.basename(work).rsplit(".", 1)[-1]
    steps = dict(steps=STEPS, ckpt=CKPT, kill_at=KILL_AT, victim=VICTIM)

    def run(mode: str, job: str, kill: bool) -> dict:
        if mode in ("heal", "checkpoint"):
            return one(a, work, job, mode == "heal", kill)
        if mode.startswith("torchft"):
            return heal_torchft.torchft_one(a, work, job, mode == "torchft-tuned", kill,
                                            midstep=a.torchft_midstep and kill, **steps)
        return heal_torchft.torchrun_one(a, work, job, kill, **steps)

    # One fault-free run per system: its digest is what a recovery must end with.
    family = {"heal": "warden", "checkpoint": "warden", "torchft-defaults": "torchft",
              "torchft-tuned": "torchft", "torchrun": "torchrun"}
    want = {}
    for fam in dict.fromkeys(family[m] for m in modes):
        ref = run({"warden": "heal", "torchft": "torchft-defaults"}.get(fam, fam), f"ref-{fam}-{tag}", False)
        got = set(ref["digests"].values())
        if not (ref["rc"] == 0 and len(ref["digests"]) == 4 and len(got) == 1):
            # What went wrong, where only this output comes back (a GPU run).
            show_logs(work, ref["job"])
            raise SystemExit(f"the fault-free {fam} run failed: {ref}")
        want[fam] = got
        print(json.dumps({"reference": fam, **ref}), flush=True)
    out = open(a.out, "a") if a.out else None
    rows = collections.defaultdict(list)
    for i in range(a.runs):
        for mode in modes:
            r = run(mode, f"{mode}-{i}-{tag}", True)
            r["identical"] = len(r["digests"]) == 4 and set(r["digests"].values()) == want[family[mode]]
            r["load"] = os.getloadavg()[0]
            if r["rc"] != 0 and mode in ("heal", "checkpoint"):
                show_logs(work, r["job"])
            print(json.dumps(r), flush=True)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
            rows[r["mode"]].append(r)
    print(f"\n{'mode':<17} {'fault -> every rank stepping (s)':<36} {'steps redone':<13} {'identical':<10} first try")
    for mode, rs in rows.items():
        t = sorted(r["back_s"] for r in rs if r["back_s"] is not None)
        span = f"median {statistics.median(t):.2f}, {t[0]:.2f}-{t[-1]:.2f}" if t else "-"
        red = sorted(r["redone"] for r in rs)
        print(f"{mode:<17} {span:<36} {red[0]}-{red[-1]:<11} {sum(r['identical'] for r in rs)}/{len(rs):<8} "
              f"{sum(r['first_try'] for r in rs)}/{len(rs)}")
    heals = rows.get("heal", [])
    parts = [k for k in ("survivors_first_step_s", "replacement_first_step_s", "heal_started_s", "cuda_ready_s",
                         "resume_s") if any(r.get(k) is not None for r in heals)]
    if parts:
        print("\nheal, where the time went (median s: from the kill, every rank's and the survivors' and the "
              "replacement's first step after it; the launcher's start of the replacement from the failure seen; "
              "the replacement's CUDA context and its resume):")
        for k in ["back_s", *parts]:
            v = sorted(r[k] for r in heals if r.get(k) is not None)
            if v:
                print(f"  {k:<25} median {statistics.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f}), {len(v)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
