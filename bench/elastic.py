"""Elastic against requeue on the real Slurm test cluster (root): what losing one node of three costs.

    python bench/elastic.py [--rounds 1] [--epochs 20] [--out DIR]

The same job three ways: ps-per-node on 3 nodes (2 CPUs each), keras_distrib.fit with a
checkpoint every 2 s, heartbeat timeout 10 s.
* undisturbed: scripts/sbatch/elastic.sbatch, nothing cut;
* elastic: the same template; n3's link is cut once epoch 2 has a checkpoint and comes back
  LINK_DOWN seconds later: the job goes on on n1 and n2, and n3 rejoins at the next checkpoint;
* elastic, never back: n3's link stays cut until the job's end (a dead node);
* requeue: scripts/sbatch/ps-per-node.sbatch (--requeue), the same cut: the job requeues
  itself and starts again (on all 3 nodes once n3 is back), resuming from the checkpoint.
Time lost = the job's wall time (sbatch to its end) minus the undisturbed one. Slurm's own
requeue delay is measured apart: from n3's link back to the requeued job RUNNING again.
Steps/s per epoch (the chief's epoch lines) on 3 nodes, on the 2 left, and after n3 rejoined.
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import REPO, Comparison, parser, print_table, save

sys.path.insert(0, str(REPO / "scripts" / "testcluster"))
sys.path.insert(0, str(REPO / "tests" / "slurm"))

LINK_DOWN = 20.0  # seconds n3 is cut off, in both disturbed runs
EPOCH_LINE = re.compile(r"^\[n1 chief:0\] keras_distrib: epoch (\d+)/\d+: [0-9.]+ s, ([0-9.]+) steps/s")


def wait_for(path: Path, text: str, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.2)
    return None


def phases_of(text: str) -> dict[str, list[float]]:
    """The chief's steps/s per epoch, by membership: on 3 nodes, on the 2 left, after n3 rejoined."""
    phases: dict[str, list[float]] = {"3 nodes": [], "2 nodes": [], "rejoined": []}
    phase, first = "3 nodes", True
    for line in text.splitlines():
        if "lost n3; continuing on 2 nodes" in line:
            phase, first = "2 nodes", True
        elif "n3 rejoined; continuing on 3 nodes" in line:
            phase, first = "rejoined", True
        elif m := EPOCH_LINE.match(line):
            if not first:  # each generation's first epoch holds its start-up and traces
                phases[phase].append(float(m.group(2)))
            first = False
    return phases


def run_job(cluster, work: Path, name: str, template: str, epochs: int, cut: bool, for_good: bool = False) -> dict:
    """One job from sbatch to its end; with ``cut``, n3's link is down for LINK_DOWN s after epoch 2's first checkpoint
    (``for_good``: until the job's end)."""
    out, ck = work / f"{name}.out", work / f"{name}-ck"
    argv = ["sbatch", "--parsable", "-N3", "--cpus-per-task=2", "-o", str(out), "--open-mode=append",
            str(REPO / "scripts" / "sbatch" / template), "--heartbeat-timeout", "10", "--checkpoint-every", "2s",
            "fit.py", str(ck), str(epochs), "200"]
    started = time.monotonic()
    job = int(cluster.head(argv, cwd=work, check=True, timeout=60).stdout.split(";")[0])
    requeue_delay = None
    try:
        if cut:
            if wait_for(out, "Epoch 2/", 300) is None:
                raise RuntimeError(f"{name}: no epoch 2 within 300 s:\n{out.read_text(errors='replace')[-3000:]}")
            first = {p.name for p in ck.glob("ckpt-*")}
            deadline = time.monotonic() + 60
            while not {p.name for p in ck.glob("ckpt-*")} - first and time.monotonic() < deadline:
                time.sleep(0.2)
            cluster.set_link("n3", up=False)
            cut_at = time.monotonic()
            try:
                requeued = wait_for(out, "requeued job", LINK_DOWN) if template != "elastic.sbatch" else None
                if for_good:
                    wait_for(out, "ending the step (scancel ", 900)
                else:
                    time.sleep(max(0.0, cut_at + LINK_DOWN - time.monotonic()))
            finally:
                cluster.set_link("n3", up=True)
            if requeued is not None:  # the scheduler's part: from n3 back to the job running again
                back_at = time.monotonic()
                while "RUNNING" not in cluster.head(["squeue", "-h", "-j", str(job), "-o", "%T"]).stdout:
                    time.sleep(0.2)
                requeue_delay = time.monotonic() - back_at
        result = cluster.wait_job(job, timeout=900)
        while result == "REQUEUED":
            result = cluster.wait_job(job, timeout=900)
    finally:
        cluster.head(["scancel", str(job)], timeout=30)
    seconds = time.monotonic() - started
    text = out.read_text(errors="replace")
    if result != "COMPLETED":
        raise RuntimeError(f"{name}: {result}:\n{text[-3000:]}")
    phases = phases_of(text)
    print(f"  {name}: {seconds:.1f} s" + (f", requeue delay {requeue_delay:.1f} s" if requeue_delay else "")
          + "".join(f", {k} {statistics.median(v):.0f} steps/s" for k, v in phases.items() if v), file=sys.stderr,
          flush=True)
    return {"seconds": seconds, "requeue_delay": requeue_delay, "phases": phases}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20, help="epochs of 200 steps (default 20)")
    p.set_defaults(rounds=1)
    args = p.parse_args()
    from slurm_cluster import SlurmTestCluster
    from test_elastic_slurm import FIT

    ok, why = SlurmTestCluster.available()
    if not ok:
        sys.exit(f"bench/elastic.py needs the real Slurm test cluster: {why}")
    epochs = 4 if args.smoke else args.epochs
    lost = Comparison(f"seconds lost to one node's loss ({LINK_DOWN:.0f} s)", "elastic", "requeue", "s",
                      target="elastic < requeue")
    gone = Comparison("seconds lost: node back after 20 s vs never (elastic)", "back", "never", "s")
    # The emulated nodes share this machine's cores: fewer nodes, less contention (not a cluster's figure).
    rates = Comparison("steps/s on the 2 nodes left vs on 3", "2 nodes", "3 nodes", "steps/s")
    back = Comparison("steps/s after n3 rejoined vs before it was lost", "rejoined", "3 nodes", "steps/s",
                      target="about 1")
    delays: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp, SlurmTestCluster(Path(tmp) / "cluster") as cluster:
        work = Path(tmp) / "work"
        work.mkdir()
        (work / "fit.py").write_text(FIT)
        for r in range(args.rounds):
            base = run_job(cluster, work, f"undisturbed-{r}", "elastic.sbatch", epochs, cut=False)
            elastic = run_job(cluster, work, f"elastic-{r}", "elastic.sbatch", epochs, cut=True)
            never = run_job(cluster, work, f"elastic-never-{r}", "elastic.sbatch", epochs, cut=True, for_good=True)
            requeue = run_job(cluster, work, f"requeue-{r}", "ps-per-node.sbatch", epochs, cut=True)
            gone.a.append(elastic["seconds"] - base["seconds"])
            gone.b.append(never["seconds"] - base["seconds"])
            lost.a.append(elastic["seconds"] - base["seconds"])
            lost.b.append(requeue["seconds"] - base["seconds"])
            if requeue["requeue_delay"] is not None:
                delays.append(requeue["requeue_delay"])
            phases = never["phases"]  # the longest stretch on 2 nodes
            if phases["2 nodes"] and phases["3 nodes"]:
                rates.a.append(statistics.median(phases["2 nodes"]))
                rates.b.append(statistics.median(phases["3 nodes"]))
            phases = elastic["phases"]
            if phases["rejoined"] and phases["3 nodes"]:
                back.a.append(statistics.median(phases["rejoined"]))
                back.b.append(statistics.median(phases["3 nodes"]))
    comparisons = [c for c in (lost, gone, rates, back) if c.a]
    print_table(f"elastic vs requeue, one node of 3 lost for {LINK_DOWN:.0f} s (ps-per-node, {epochs} epochs of 200 steps)",
                comparisons)
    if delays:
        print(f"Slurm's requeue delay (n3 back to the requeued job RUNNING): median {statistics.median(delays):.1f} s")
    save("elastic", comparisons, {"requeue_delay_seconds": delays, "link_down_seconds": LINK_DOWN}, args.out)


if __name__ == "__main__":
    main()
