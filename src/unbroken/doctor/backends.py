"""torch, and the backends the ranks connect through: gloo (always), NCCL and CUDA (when torch
has them)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

from unbroken import env as uenv
from unbroken.doctor.config import Check, DoctorConfig

MIN_TORCH = (2, 4)
"""The oldest torch the package declares (pyproject's dependency)."""


def check_torch(cfg: DoctorConfig) -> Check:
    """torch imports, is new enough and has torch.distributed."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return Check("torch", "fail", f"cannot import torch: {e}", "pip install 'torch>=2.4'")
    version = torch.__version__
    parts = version.split("+")[0].split(".")
    major_minor = tuple(int(p) for p in parts[:2] if p.isdigit())
    if major_minor < MIN_TORCH:
        return Check("torch", "fail", f"torch {version}", "install torch >= 2.4")
    if not dist.is_available():
        return Check(
            "torch",
            "fail",
            f"torch {version} was built without torch.distributed",
            "install a torch build with distributed support (the PyPI wheels have it)",
        )
    return Check("torch", "ok", f"torch {version}, torch.distributed available")


def _host_address() -> tuple[str, str]:
    """(host name, the address it resolves to, or why it does not)."""
    host = socket.gethostname()
    try:
        return host, socket.gethostbyname(host)
    except OSError as e:
        return host, f"unresolvable ({e})"


def check_gloo(cfg: DoctorConfig) -> Check:
    """Two gloo ranks (threads) rendezvous on a TCPStore on port 0 and all-reduce."""
    import torch
    import torch.distributed as dist

    if not dist.is_gloo_available():
        return Check("gloo", "fail", "torch was built without gloo", "install a torch with gloo")
    timeout = timedelta(seconds=cfg.gloo_timeout_s)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    port = master.port
    results: list[float | BaseException] = [0.0, 0.0]

    def rank(r: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("doctor", store), r, 2, timeout)
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()  # type: ignore[attr-defined]
            results[r] = float(t[0])
        except BaseException as e:  # reported, never lost with the thread
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name=f"doctor-gloo-{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.gloo_timeout_s + 5)
    del master
    host, addr = _host_address()
    iface = uenv.lookup(uenv.GLOO_SOCKET_IFNAME)
    where = f"GLOO_SOCKET_IFNAME={iface}" if iface else f"host name {host} -> {addr}"
    errors = [r for r in results if isinstance(r, BaseException)]
    if any(t.is_alive() for t in threads) or errors or results != [3.0, 3.0]:
        why = f"{errors[0]!r}" if errors else f"got {results} (expected [3.0, 3.0]) or a hang"
        return Check(
            "gloo",
            "fail",
            f"two gloo ranks could not all-reduce on this host ({where}): {why}",
            "make the host name resolve to an address of this machine (/etc/hosts) or set "
            "GLOO_SOCKET_IFNAME to the interface the ranks share",
        )
    found = f"two ranks all-reduced over a TCPStore ({where})"
    unreachable = not addr[:1].isdigit() or addr.startswith("127.")
    if cfg.nnodes > 1 and not iface and unreachable:
        return Check(
            "gloo",
            "warn",
            found + ": not an address other nodes can reach",
            "set GLOO_SOCKET_IFNAME to the interface between the nodes (e.g. eth0), or map "
            "the host name to that interface's address in /etc/hosts",
        )
    return Check("gloo", "ok", found)


def check_cuda(cfg: DoctorConfig) -> Check:
    """CUDA devices for every local rank, and NCCL to connect them (when torch has CUDA)."""
    import torch
    import torch.distributed as dist

    if torch.version.cuda is None:
        return Check("cuda", "ok", "a CPU build of torch: ranks run on CPU with gloo")
    if not torch.cuda.is_available():
        visible = uenv.lookup(uenv.CUDA_VISIBLE_DEVICES)
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Check(
            "cuda",
            "warn",
            f"torch built for CUDA {torch.version.cuda} sees no device{hint}: ranks run on CPU",
            "on a GPU node: check the driver (nvidia-smi) and the device plugin / "
            "CUDA_VISIBLE_DEVICES",
        )
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    if not dist.is_nccl_available():
        return Check(
            "cuda",
            "fail",
            f"{count} x {name}, but torch was built without NCCL",
            "install a CUDA build of torch with NCCL (the PyPI CUDA wheels have it)",
        )
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    found = f"{count} x {name}, CUDA {torch.version.cuda}, NCCL {nccl}"
    if cfg.nproc_per_node > count:
        return Check(
            "cuda",
            "fail",
            f"{found}: fewer devices than --nproc-per-node {cfg.nproc_per_node}",
            f"run at most {count} ranks per node, or expose more devices",
        )
    try:
        store = dist.HashStore()
        pg = dist.ProcessGroupNCCL(store, 0, 1, dist.ProcessGroupNCCL.Options())
        t = torch.ones(4, device="cuda:0")
        pg.allreduce([t]).wait()  # type: ignore[attr-defined]
        torch.cuda.synchronize(0)
        pg.shutdown()
        if t.tolist() != [1.0] * 4:
            raise RuntimeError(f"a one-rank all-reduce of ones gave {t.tolist()}")
    except Exception as e:
        return Check(
            "cuda", "fail", f"{found}; a one-rank NCCL all-reduce failed: {e}", "check NCCL_*"
        )
    return Check("cuda", "ok", f"{found}; a one-rank NCCL all-reduce ran")
