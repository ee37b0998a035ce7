"""The ``deepspeed`` launcher's command line, carried out by torchrun.

::

    deepspeed          --num_gpus 2 train.py --deepspeed ds.json     # before
    zeroplug-deepspeed --num_gpus 2 train.py --deepspeed ds.json     # after (or: zeroplug launch ...)

The resources come from DeepSpeed's hostfile (``host slots=N`` per line, ``#`` comments;
default ``/job/hostfile``; without one, this host and its GPUs), narrowed by
``--include`` / ``--exclude`` (``host1:0,1@host2``), ``--num_nodes`` and ``--num_gpus``.

* One node that is this host: ``python -m torch.distributed.run`` (torchrun) is executed in
  this process's place with ``--nproc-per-node``, ``--master-addr`` / ``--master-port`` and
  ``CUDA_VISIBLE_DEVICES`` set to the chosen GPUs.
* Other hosts (several nodes, or one that is not this host): with ``--node_rank R`` this host
  runs node R's torchrun (every node runs the same line with its own rank; ``--master_addr``
  defaults to the first host). Without it the torchrun line of every node is printed, one per
  line, to run there (no ssh / pdsh here).

The script gets ``--local_rank=N`` before its own arguments, as DeepSpeed passes it
(``--no_local_rank``: not), and the ``LOCAL_RANK`` / ``RANK`` / ``WORLD_SIZE`` environment
torchrun sets. ``--bind_cores_to_rank`` gives each local rank an equal share of this host's
cores (or of ``--bind_core_list``). ``--module`` and ``--no_python`` run a module or a
program, as DeepSpeed's do. DeepSpeed options that only concern its own launch machinery
(``--launcher``, ``--launcher_args``, ``--no_ssh_check``, ``--force_multi``,
``--enable_each_rank_log``, ``--ssh_port``) are accepted; ``--autotuning`` and
``--elastic_training`` are refused with one line. Every mistake prints one ``error:`` line
and exits 2.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections import OrderedDict

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_PORT = 29500
_LOCAL = {"localhost", "127.0.0.1"}


class LaunchError(Exception):
    """A bad launch line: printed as one ``error:`` line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise LaunchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zeroplug-deepspeed", description="DeepSpeed's launcher command line, run by torchrun.")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE,
                   help="hostfile of 'hostname slots=N' lines (default /job/hostfile; none: this host)")
    p.add_argument("-i", "--include", default="", help="hosts / GPUs to use, e.g. 'worker-0@worker-1:0,2'")
    p.add_argument("-e", "--exclude", default="", help="hosts / GPUs not to use, e.g. 'worker-1:0'")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="processes (GPUs) per node")
    p.add_argument("--master_port", type=int, default=DEFAULT_PORT)
    p.add_argument("--master_addr", default="", help="rank 0's address (default: this host, or the first host)")
    p.add_argument("--node_rank", type=int, default=-1, help="several nodes: run node N's share here")
    p.add_argument("--launcher", default="pdsh", help="accepted; torchrun launches")
    p.add_argument("--launcher_args", default="", help="accepted; ignored")
    p.add_argument("--module", action="store_true", help="user_script is a Python module (python -m)")
    p.add_argument("--no_python", action="store_true", help="user_script is a program, run directly")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--no_ssh", action="store_true", help="with --node_rank: this node's share (as DeepSpeed)")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="", choices=["", "tune", "run"])
    p.add_argument("--elastic_training", action="store_true")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="each local rank gets its share of the cores")
    p.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. '0-15,32-47'")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("user_script", help="the training script (or module, program)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


# --- resources ---------------------------------------------------------------------------

def read_hostfile(path: str) -> OrderedDict | None:
    """{host: slots} from DeepSpeed's hostfile format; None when the file does not exist."""
    if not os.path.isfile(path):
        return None
    pool: OrderedDict = OrderedDict()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].startswith("slots="):
                raise LaunchError(f"hostfile {path} line {n}: {line!r} is not 'hostname slots=N'")
            try:
                slots = int(parts[1][len("slots="):])
            except ValueError:
                raise LaunchError(f"hostfile {path} line {n}: slots must be a number, got {parts[1]!r}") from None
            if parts[0] in pool:
                raise LaunchError(f"hostfile {path} line {n}: host {parts[0]!r} is listed twice")
            if slots < 1:
                raise LaunchError(f"hostfile {path} line {n}: slots must be at least 1")
            pool[parts[0]] = slots
    if not pool:
        raise LaunchError(f"hostfile {path} lists no hosts")
    return pool


def _local_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except (ImportError, RuntimeError, OSError):    # no torch / no driver: no GPUs
        return 0


def _parse_filter(text: str, pool: OrderedDict, what: str) -> OrderedDict:
    """'host1:0,2@host2' -> {host: [slots] or None (all)}."""
    out: OrderedDict = OrderedDict()
    for item in text.split("@"):
        item = item.strip()
        if not item:
            continue
        host, _, slots = item.partition(":")
        if host not in pool:
            raise LaunchError(f"--{what} {text!r}: host {host!r} is not among {', '.join(pool)}")
        if slots:
            try:
                ids = [int(s) for s in slots.split(",")]
            except ValueError:
                raise LaunchError(f"--{what} {text!r}: slots of {host!r} must be numbers like 0,1") from None
            bad = [i for i in ids if not 0 <= i < pool[host]]
            if bad:
                raise LaunchError(f"--{what} {text!r}: {host!r} has slots 0..{pool[host] - 1}, not {bad[0]}")
            if host not in out or out[host] is not None:     # None: every slot already
                out[host] = (out.get(host) or []) + ids
        else:
            out[host] = None
    return out


def active_resources(args, pool: OrderedDict) -> OrderedDict:
    """{host: [slot ids]} after --include / --exclude / --num_nodes / --num_gpus."""
    if args.include and args.exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    res = OrderedDict((h, list(range(n))) for h, n in pool.items())
    if args.include:
        inc = _parse_filter(args.include, pool, "include")
        res = OrderedDict((h, sorted(set(s)) if s is not None else res[h]) for h, s in inc.items())
    if args.exclude:
        exc = _parse_filter(args.exclude, pool, "exclude")
        for h, s in exc.items():
            if s is None:
                res.pop(h, None)
            else:
                res[h] = [i for i in res[h] if i not in s]
        res = OrderedDict((h, s) for h, s in res.items() if s)
    if args.num_nodes > 0:
        if args.num_nodes > len(res):
            raise LaunchError(f"--num_nodes {args.num_nodes}: only {len(res)} host(s) available ({', '.join(res)})")
        res = OrderedDict(list(res.items())[:args.num_nodes])
    if args.num_gpus > 0:
        for h, s in res.items():
            if args.num_gpus > len(s):
                raise LaunchError(f"--num_gpus {args.num_gpus}: host {h!r} has {len(s)} slot(s)")
            res[h] = s[:args.num_gpus]
    if not res:
        raise LaunchError("no hosts / GPUs left to run on after --include / --exclude")
    return res


# --- commands ------------------------------------------------------------------------------

def _is_this_host(host: str) -> bool:
    return host in _LOCAL or host in (socket.gethostname(), socket.getfqdn())


def torchrun_command(args, res: OrderedDict, node_rank: int) -> tuple[list[str], dict]:
    """(argv, environment additions) of node ``node_rank``'s torchrun."""
    hosts = list(res)
    host = hosts[node_rank]
    master = args.master_addr or ("127.0.0.1" if len(hosts) == 1 else hosts[0])
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--node-rank={node_rank}",
            f"--nproc-per-node={len(res[host])}", f"--master-addr={master}", f"--master-port={args.master_port}"]
    argv += ["-m", "zeroplug.deepspeed.launcher.rank_entry"]
    if args.module:
        argv.append("--module")
    elif args.no_python:
        argv.append("--no-python")
    if args.no_local_rank:
        argv.append("--no-local-rank")
    argv += [args.user_script, *args.user_args]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(s) for s in res[host])}
    if args.bind_cores_to_rank:
        env["ZEROPLUG_BIND_CORES"] = args.bind_core_list or "all"
    return argv, env


def plan(argv=None) -> list[tuple[str, list[str], dict]]:
    """[(host, argv, env)]: the one node this launch runs here, or (:func:`to_print` true)
    every node's line to print."""
    args = build_parser().parse_args(argv)
    if args.autotuning:
        raise LaunchError("--autotuning is DeepSpeed's autotuner; zeroplug's is `zeroplug tune`")
    if args.elastic_training or args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0:
        raise LaunchError("--elastic_training: run torchrun with --nnodes MIN:MAX yourself (zeroplug resumes "
                          "checkpoints at any world size)")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if not args.module and not args.no_python and not os.path.isfile(args.user_script):
        raise LaunchError(f"{args.user_script}: no such script")
    pool = read_hostfile(args.hostfile)
    if pool is None:
        if args.hostfile != DEFAULT_HOSTFILE:
            raise LaunchError(f"--hostfile {args.hostfile}: no such file")
        n = _local_devices()
        if n == 0:          # a CPU host: as many processes as asked for (gloo)
            n = args.num_gpus if args.num_gpus > 0 else 1
        pool = OrderedDict(localhost=n)
    res = active_resources(args, pool)
    hosts = list(res)
    if len(hosts) == 1 and (_is_this_host(hosts[0]) or args.node_rank == 0 or args.no_ssh):
        argv, env = torchrun_command(args, res, 0)
        return [(hosts[0], argv, env)]
    if args.node_rank >= 0:
        if args.node_rank >= len(hosts):
            raise LaunchError(f"--node_rank {args.node_rank}: the launch has {len(hosts)} node(s)")
        argv, env = torchrun_command(args, res, args.node_rank)
        return [(hosts[args.node_rank], argv, env)]
    return _Lines((h, *torchrun_command(args, res, i)) for i, h in enumerate(hosts))


class _Lines(list):
    """Nodes to print, not to run here (other hosts, no --node_rank)."""


def to_print(nodes) -> bool:
    return isinstance(nodes, _Lines)


def format_line(host: str, argv: list[str], env: dict) -> str:
    return f"{host}: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


def main(argv=None) -> int:
    try:
        nodes = plan(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if to_print(nodes):
        print(f"# {len(nodes)} node(s): run each line on its host (or add --node_rank N there)")
        for node in nodes:
            print(format_line(*node))
        return 0
    host, cmd, env = nodes[0]
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0        # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
