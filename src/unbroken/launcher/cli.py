"""``unbroken-run``: parse torchrun's flags and ours, assemble the agent, run it, exit.

Start-up order is chosen for speed: the warm pool is spawned first, so that its imports of
torch run in parallel with the agent's own (the rendezvous needs torch.distributed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from unbroken import env as uenv
from unbroken.launcher import args as largs
from unbroken.launcher import bootstrap, errors, listen, nodecheck
from unbroken.launcher import config as lconfig
from unbroken.launcher.agent import Agent
from unbroken.launcher.errors import Failure
from unbroken.launcher.handover import Handover
from unbroken.launcher.monitor import (
    STATE_FILE,
    HeartbeatServer,
    HeartbeatTracker,
    Observed,
)
from unbroken.launcher.signals import SignalPipe
from unbroken.launcher.slowness import proc_runnable_s
from unbroken.launcher.workers import LocalWorkers
from unbroken.launcher.zygote import Zygote
from unbroken.ledger import Ledger, owner, process_start_time
from unbroken.ledger import events as ev
from unbroken.ledger.busy import proc_sent_bytes, proc_tcp_retransmitting
from unbroken.log import init_logging
from unbroken.version import __version__

logger = logging.getLogger("unbroken.launcher")


def node_addr(spec: largs.JobSpec) -> str:
    """How peers reach this node: --local-addr, loopback for one node, else the hostname."""
    if spec.local_addr:
        return spec.local_addr
    if spec.max_nodes == 1:
        return "127.0.0.1"
    return socket.getfqdn()


def job_run_id(spec: largs.JobSpec, run_dir: Path | None) -> str:
    """The ledger's run id, shared by every process of the job and across its restarts: the
    rendezvous id of a multi-node job (every node agrees on it; the run dir's name when it is
    "none"); for a standalone job, new at every launch (the run dir's name and the random
    rendezvous id's head), so that a later launch into the same run dir is another job."""
    if not spec.standalone and spec.rdzv_id not in ("", "none"):
        return spec.rdzv_id
    if run_dir is None:
        return spec.rdzv_id
    if spec.standalone:
        return f"{run_dir.name}-{spec.rdzv_id.replace('-', '')[:8]}"
    return run_dir.name


def claim_run_dir(spec: largs.JobSpec, cfg: lconfig.LauncherConfig, run_dir: Path) -> str:
    """Claim ``run_dir`` for this job (``unbroken.ledger.owner``) and return the job's run id.

    A run dir another job is using is refused; one another job used before is refused too,
    unless ``--ft-resume``: this launch then continues that run (its run id, so its ledger,
    checkpoints and fired faults go on). DirectoryOwned (a ValueError) names the owner."""
    run_id = job_run_id(spec, run_dir)
    previous = owner.OwnerRecord.read(run_dir)
    if cfg.resume and previous is not None:
        run_id = previous.job
    owner.claim(
        run_dir,
        job=run_id,
        takeover=cfg.resume,
        hint="pass --ft-resume to continue that run on purpose, or choose another --ft-run-dir",
    )
    return run_id


def default_run_dir(run_id: str) -> Path:
    return (
        Path("runs") / f"unbroken-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if run_id in ("", "none")
        else Path("runs") / run_id
    )


def _base_env(spec: largs.JobSpec) -> dict[str, str]:
    """The environment every worker starts from (torchrun's OMP_NUM_THREADS default)."""
    if uenv.OMP_NUM_THREADS not in os.environ and spec.nproc_per_node > 1:
        logger.warning(
            "setting OMP_NUM_THREADS=1 for each worker (as torchrun does); tune it "
            "for your application"
        )
        os.environ[uenv.OMP_NUM_THREADS] = "1"
    return dict(os.environ)


def _agent_gave_up(
    ledger: Ledger,
    path: Path,
    run_id: str,
    *,
    exit_code: int,
    cause: str,
    category: str,
    message: str,
) -> int:
    """The agent ends the job before any worker ran: error file, ledger, log; the exit code."""
    failure = Failure(
        rank=-1,
        local_rank=-1,
        cause=cause,
        category=category,
        detector=cause,
        ts=time.time(),
        message=message,
    )
    rec = errors.write_error_file(
        path, exit_code=exit_code, failures=[failure], restarts=0, run_id=run_id
    )
    ledger.emit(
        ev.JOB_END,
        status="failed",
        exit_code=exit_code,
        reason=rec["reason"],
        cause=cause,
        fault_rank=-1,
    )
    logger.error("%s", message)
    return exit_code


def _rendezvous_failed(ledger: Ledger, path: Path, run_id: str, e: Exception) -> int:
    return _agent_gave_up(
        ledger,
        path,
        run_id,
        exit_code=errors.EXIT_RENDEZVOUS_FAILED,
        cause="rendezvous",
        category="infra",
        message=str(e),
    )


def _node_unhealthy(ledger: Ledger, path: Path, run_id: str, bad: list[nodecheck.Verdict]) -> int:
    return _agent_gave_up(
        ledger,
        path,
        run_id,
        exit_code=errors.EXIT_NODE_UNHEALTHY,
        cause="node_check",
        category="platform",
        message="this node failed its node checks and stays out of the job: "
        + "; ".join(v.line() for v in bad),
    )


def metrics_host(spec: largs.JobSpec, cfg: largs.lconfig.LauncherConfig) -> str:
    """Where /metrics listens: ``--ft-metrics-host``, else loopback for a job on this machine
    alone (standalone, or one node with a loopback endpoint), else every interface (Prometheus
    scrapes each node)."""
    if cfg.metrics_host is not None:
        return cfg.metrics_host
    host = spec.rdzv_endpoint.rpartition(":")[0] or spec.rdzv_endpoint
    local = spec.standalone or (
        spec.max_nodes == 1 and listen.is_loopback(listen.bind_address(host, single_node=True))
    )
    return listen.LOOPBACK if local else "0.0.0.0"


def run(spec: largs.JobSpec, cfg: largs.lconfig.LauncherConfig) -> int:
    # Before anything is created: the run directory, the workers' checkpoints and ledgers, the
    # shared memory of the writers inherit it (077: private to the user).
    os.umask(int(cfg.umask, 8))
    run_dir = (
        cfg.run_dir or default_run_dir("none" if spec.standalone else spec.rdzv_id)
    ).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(
            f"unbroken-run: error: cannot create the run directory {run_dir}: {e}", file=sys.stderr
        )
        return errors.EXIT_USAGE
    try:  # held until the agent exits (its process's death drops it)
        run_id = claim_run_dir(spec, cfg, run_dir)
    except ValueError as e:
        print(f"unbroken-run: error: {e}", file=sys.stderr)
        return errors.EXIT_USAGE
    base_env = _base_env(spec)
    # The warm pool first, while this process runs one thread (the metrics server's is next):
    # an agent forked from a process that imported the pool's modules forks the pool from them.
    zygote = _warm_pool(spec, cfg, base_env)
    metrics = None
    try:
        if cfg.metrics_port is not None:
            from unbroken.dashboard.metrics import MetricsServer

            try:
                metrics = MetricsServer(
                    run_dir, port=cfg.metrics_port, host=metrics_host(spec, cfg)
                )
            except OSError as e:
                print(f"unbroken-run: error: {e}", file=sys.stderr)
                return errors.EXIT_USAGE
        return _run(spec, cfg, run_dir, run_id, base_env=base_env, zygote=zygote)
    finally:
        if metrics is not None:
            metrics.close()
        if zygote is not None:
            zygote.close()


def _warm_pool(
    spec: largs.JobSpec, cfg: largs.lconfig.LauncherConfig, base_env: dict[str, str]
) -> Zygote | None:
    """Make this process a child subreaper (workers forked from the pool are its children);
    then the warm pool the workers fork from, or None (off, a command entry, no subreaper)."""
    subreaper = bootstrap.set_child_subreaper()
    if not cfg.warm_pool or spec.entry.kind == "command":
        return None
    if not subreaper:
        logger.warning("cannot become a child subreaper: the warm pool is off")
        return None
    return Zygote(cfg.preload, env=base_env)


def _run(
    spec: largs.JobSpec,
    cfg: largs.lconfig.LauncherConfig,
    run_dir: Path,
    run_id: str,
    *,
    base_env: dict[str, str],
    zygote: Zygote | None,
) -> int:
    error_path = cfg.error_path(run_dir)
    error_path.unlink(missing_ok=True)  # a previous run's
    signals = SignalPipe(tuple(getattr(signal, s) for s in spec.stop_signals))
    heartbeats = HeartbeatServer(key=HeartbeatServer.new_key())
    ledger = Ledger(run_dir, run=run_id, rank=ev.LAUNCHER_RANK)
    ledger.emit(
        ev.PROCESS_START,
        ts=process_start_time(),
        pid=os.getpid(),
        host=socket.gethostname(),
        role="agent",
        nproc_per_node=spec.nproc_per_node,
        nnodes=f"{spec.min_nodes}:{spec.max_nodes}",
        max_restarts=spec.max_restarts,
        entry=[spec.entry.target, *spec.entry.args],
        config=dataclasses.asdict(cfg),
        python=platform.python_version(),
        version=__version__,
    )
    # The agent's own start-up (interpreter, imports, warm pool started), like a worker's.
    ledger.interval(ev.PHASE, begin=process_start_time(), name="import")
    workers = None
    peers = None
    try:
        if cfg.node_checks:  # before joining: a node that fails one stays out of the round
            t0 = time.time()
            verdicts = nodecheck.run(
                cfg.node_checks,
                nproc_per_node=spec.nproc_per_node,
                nnodes=spec.max_nodes,
                checkpoint_dir=cfg.node_check_dir,
            )
            for v in verdicts:
                logger.info("node check: %s", v.line())
            ledger.interval(
                ev.PHASE, begin=t0, name="node_check", checks=nodecheck.to_ledger(verdicts)
            )
            if bad := nodecheck.failed(verdicts):
                return _node_unhealthy(ledger, error_path, run_id, bad)
        from unbroken.launcher.rendezvous import C10dRendezvous

        if spec.max_nodes > 1:  # other nodes restore from, and replicate to, this one
            from unbroken.checkpoint.tiers.peers import PeerService

            host = node_addr(spec)
            peers = PeerService(host=host, bind=listen.bind_address(host, single_node=False))

        connect = time.time()
        try:
            rdzv = C10dRendezvous(
                spec,
                node_addr=node_addr(spec),
                timeout_s=cfg.rdzv_timeout_s,
                poll_s=cfg.rdzv_poll_s,
                peers=peers,
                ledger=ledger,
            )
        except errors.LauncherError as e:
            return _rendezvous_failed(ledger, error_path, run_id, e)
        # Reaching the rendezvous store (a store pod may still be starting); from here on this
        # node can join a round, or wait as a hot spare.
        ledger.interval(ev.PHASE, begin=connect, name="connect", host=socket.gethostname())
        state_file = run_dir / "launcher" / STATE_FILE
        tracker = HeartbeatTracker(
            enabled=cfg.hang_detection,
            initial_timeout_s=cfg.initial_timeout_s,
            steady_timeout_s=cfg.steady_timeout_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            auto_timeouts=cfg.auto_timeouts,
            auto_timeout_factor=cfg.auto_timeout_factor,
            observed=Observed.load(state_file),
            on_change=lambda name, value, previous: ledger.emit(
                ev.TUNED, name=name, value=round(value, 4), previous=previous, layer="launcher"
            ),
            runnable_s=proc_runnable_s,
            sent_bytes=proc_sent_bytes,
            retransmitting=proc_tcp_retransmitting,
        )
        workers = LocalWorkers(
            spec,
            cfg,
            run_dir=run_dir,
            run_id=run_id,
            heartbeats=heartbeats,
            signals=signals,
            zygote=zygote,
            base_env=base_env,
        )
        if peers is not None:
            peers.local = workers.keeper.dup
        handover = None
        if spec.max_nodes > 1 and cfg.handover:
            handover = Handover(lambda: rdzv.job_store, workers, nproc=spec.nproc_per_node)
        agent = Agent(
            spec=spec,
            cfg=cfg,
            rdzv=rdzv,
            workers=workers,
            tracker=tracker,
            ledger=ledger,
            run_dir=run_dir,
            run_id=run_id,
            state_file=state_file,
            handover=handover,
        )
        return agent.run()
    finally:
        if workers is not None:
            if workers.running():  # an exception in the agent itself: leave nothing behind
                workers.stop(cfg.stop_grace_s)
            workers.close()
        if peers is not None:
            peers.close()
        heartbeats.close()
        signals.close()
        ledger.close()


def main(argv: Sequence[str] | None = None) -> int:
    init_logging()
    try:
        spec, cfg, ignored = largs.parse(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"unbroken-run: error: {e}", file=sys.stderr)
        return errors.EXIT_USAGE
    for name in ignored:
        logger.warning(
            "--%s is accepted for torchrun compatibility and ignored", name.replace("_", "-")
        )
    return run(spec, cfg)


if __name__ == "__main__":
    sys.exit(main())
