"""The speed of two versions of zeroplug, measured in one run on one machine.

    # where git is: each version's files into bench_trees/<name> (a git revision, or a directory)
    python3 tests/benchmarks/before_after.py export main my-branch
    # on the GPU machine (the trees travel with the working tree): interleaved runs, a table
    python3 tests/benchmarks/before_after.py run bench_trees/main bench_trees/my-branch --nvme-path /local_nvme

Each version runs from its own tree, importable as ``zeroplug`` without installing it: the
packages named in its pyproject.toml (``package-dir``) are linked into a private site
directory with a dist-info carrying its entry points, which goes first on PYTHONPATH. Each
run is that version's own ``tests/benchmarks/h100_bench.py workload`` (the command
docs/benchmarks.md gives for each figure) in a fresh process; the versions alternate
(A B A B ...) so that a machine that drifts slows both alike. The table holds, per workload,
the median over rounds of each run's median step time, and after / before.

Workloads (``--only`` picks some): ``stage3``: 1.3B, stage 3 on the GPU; ``offload``: 1.3B, stage 3, optimizer and parameters
offloaded to the CPU with the tier's defaults; ``nvme``: 350M, stage 3, optimizer states on
NVMe (parameters in CPU memory), at ``--nvme-path``. ``--out DIR`` keeps each run's JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WORKLOADS = {
    "stage3": ["--model", "1.3B", "--zero", "stage3", "--steps", "8"],
    "offload": ["--model", "1.3B", "--zero", "stage3", "--offload-optimizer", "cpu", "--offload-param", "cpu",
                "--steps", "8"],
    "nvme": ["--model", "350M", "--zero", "stage3", "--offload-optimizer", "nvme", "--offload-param", "cpu",
             "--steps", "5"],
}


def export(revisions: list[str], out: Path) -> None:
    """``git archive`` of each revision into ``out/<revision>``."""
    for rev in revisions:
        dest = out / rev.replace("/", "_")
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        data = subprocess.run(["git", "archive", "--format=tar", rev], check=True, capture_output=True).stdout
        with tempfile.TemporaryFile() as f:
            f.write(data)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(dest)
        print(f"{rev} -> {dest}")


def site_of(tree: Path) -> Path:
    """A site directory that makes ``tree`` importable as ``zeroplug`` (with its entry points)."""
    meta = tomllib.loads((tree / "pyproject.toml").read_text())
    st = meta["tool"]["setuptools"]
    dirs = st.get("package-dir", {})
    site = tree / ".bench_site"
    if site.exists():
        shutil.rmtree(site)
    for pkg in st["packages"]:
        # the source directory: the longest package-dir prefix, plus the rest of the name
        base = max((k for k in dirs if pkg == k or pkg.startswith(k + ".")), key=len)
        src = tree / dirs[base] / Path(*pkg[len(base):].lstrip(".").split(".")) if pkg != base else tree / dirs[base]
        dst = site / Path(*pkg.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix in (".py", ".toml", ".json"):
                (dst / f.name).symlink_to(f.resolve())
    info = site / f"{meta['project']['name']}-{meta['project']['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['project']['name']}\n"
                                   f"Version: {meta['project']['version']}\n")
    eps = meta["project"].get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n" for group, items in eps.items()))
    return site


def run_one(tree: Path, site: Path, workload: list[str], out_json: Path, extra: list[str]) -> dict | None:
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "tests.benchmarks.h100_bench", "workload", *workload, *extra, "--json", str(out_json)]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    print(f"  {tree.name}: {line or 'FAILED: ' + (r.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
    if r.returncode != 0 or not out_json.exists():
        return None
    return json.loads(out_json.read_text())


def run(before: Path, after: Path, rounds: int, only: list[str], nvme_path: str, out: Path,
        steps_override: int | None = None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    trees = {"before": before.resolve(), "after": after.resolve()}
    sites = {k: site_of(t) for k, t in trees.items()}
    steps: dict = {(w, k): [] for w in only for k in trees}
    for i in range(rounds):
        for w in only:
            extra = ["--nvme-path", nvme_path] if w == "nvme" else []
            if steps_override:
                extra += ["--steps", str(steps_override)]     # the last --steps wins
            print(f"round {i + 1}/{rounds}, {w}", flush=True)
            for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
                res = run_one(trees[k], sites[k], WORKLOADS[w], out / f"{w}_{k}_{i}.json", extra)
                if res is not None:
                    steps[(w, k)].append(res["step_s"])
    print(f"\n| workload | before s/step | after s/step | after / before | runs |\n| --- | ---: | ---: | ---: | --- |")
    bad = 0
    for w in only:
        b, a = steps[(w, "before")], steps[(w, "after")]
        if not a or not b:
            print(f"| {w} | {'-' if not b else f'{statistics.median(b):.3f}'} | "
                  f"{'-' if not a else f'{statistics.median(a):.3f}'} | failed | {len(b)} / {len(a)} |")
            bad += 1
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"| {w} | {mb:.3f} | {ma:.3f} | {ma / mb:.3f} | before {', '.join(f'{x:.3f}' for x in b)}; "
              f"after {', '.join(f'{x:.3f}' for x in a)} |")
    print(f"\nbefore: {trees['before']}\nafter:  {trees['after']}")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("export", help="each git revision's files into --out/<revision>")
    e.add_argument("revisions", nargs="+")
    e.add_argument("--out", default="bench_trees")
    r = sub.add_parser("run", help="interleaved runs of two trees, then the table")
    r.add_argument("before")
    r.add_argument("after")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--steps", type=int, default=None, help="timed steps per run (default: the workload's)")
    r.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    r.add_argument("--nvme-path", default="/root/zeroplug_nvme")
    r.add_argument("--out", default=os.environ.get("OUT"),
                   help="keep each run's JSON here (default: $OUT; without either, a temporary directory)")
    args = p.parse_args()
    if args.what == "export":
        export(args.revisions, Path(args.out))
        return 0
    if args.out:
        rc = run(Path(args.before), Path(args.after), args.rounds, args.only, args.nvme_path, Path(args.out), args.steps)
        print(f"JSON per run: {args.out}")
        return rc
    with tempfile.TemporaryDirectory(prefix="before_after_") as tmp:
        return run(Path(args.before), Path(args.after), args.rounds, args.only, args.nvme_path, Path(tmp), args.steps)


if __name__ == "__main__":
    sys.exit(main())
