"""Where the workers run: a Ray cluster (started here or joined) and a pool of placement-group bundles.

`trainer.nnodes x trainer.n_gpus_per_node` devices become one placement group per node, each holding
`n_gpus_per_node` bundles of one GPU (or, on a CPU run, one CPU slot) packed onto one node (`STRICT_PACK`).
Rank r runs in bundle r: ranks 0..n-1 on the first node, n..2n-1 on the second, and so on.

`ray_kwargs.ray_init` (verl's key; the older `ray_init` too) goes to `ray.init`: `address` joins an existing
cluster (`auto`, `host:port`, or set RAY_ADDRESS; `scripts/slurm_ray.sbatch` starts one with `ray start`),
`num_cpus` sizes a local one (started without its dashboard).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("lathe")


class ClusterError(RuntimeError):
    """Ray is missing or the cluster cannot hold the workers asked for (the message says what to change)."""


def require_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("trainer.nnodes x trainer.n_gpus_per_node > 1 runs one worker per device through Ray, "
                           "which is not installed. Fix: pip install 'lathe[ray]' (or set trainer.n_gpus_per_node=1 "
                           "trainer.nnodes=1 for one device).") from None
    return ray


def ray_init_kwargs(cfg) -> dict:
    """verl's `ray_kwargs.ray_init` over the older top-level `ray_init` (null values dropped)."""
    merged = {**(cfg.ray_init or {}), **((cfg.ray_kwargs or {}).get("ray_init") or {})}
    return {k: v for k, v in merged.items() if v is not None}


def joining_address(kwargs: dict) -> str | None:
    """The cluster `ray.init(**kwargs)` will join, found as Ray finds it: `ray_init.address`, else RAY_ADDRESS, else
    the cluster a `ray start` left running on this machine (its address file in Ray's temp directory: verl's
    multi-node recipe starts the head so and runs the trainer there with neither set); None where it will start one
    of its own."""
    address = kwargs.get("address") or os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local"):
        return address
    if address == "local":
        return None
    require_ray()
    try:
        from ray._private.services import canonicalize_bootstrap_address     # (Ray's own lookup; private)
    except ImportError:
        return address
    try:
        return canonicalize_bootstrap_address(address, kwargs.get("_temp_dir"))
    except (ConnectionError, ValueError):    # "auto" with none running: ray.init says so itself
        return address


def start_ray(cfg) -> bool:
    """Join or start Ray; True when this call connected this process (and should shut the connection down)."""
    ray = require_ray()
    if ray.is_initialized():
        limit_driver_threads()
        return False
    kwargs = ray_init_kwargs(cfg)
    joining = joining_address(kwargs)
    if not joining:
        kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("logging_level", logging.WARNING)
    ray.init(**kwargs)
    log.info("ray: %s, %s", f"joined the cluster at {joining}" if joining else "started a local cluster",
             _show(ray.cluster_resources()))
    limit_driver_threads()
    return True


def limit_driver_threads() -> None:
    """This process now drives workers: few torch threads for its cuts, joins and rewards (`device.driver_threads`)."""
    import torch
    from lathe.device import driver_threads
    threads = driver_threads()
    if threads is not None:
        log.info("driver: %d torch threads of %d (its workers compute; set OMP_NUM_THREADS to choose)", threads,
                 torch.get_num_threads())
        torch.set_num_threads(threads)


def check_local_fit(cfg, plan, device_type: str, visible_gpus: int) -> None:
    """Refuse, before anything loads, workers that a Ray cluster started here could never place: the trainer's, the
    rollout pool's, the reward model's pool's and the teachers' pool's ranks, one CPU slot each on a CPU run
    (`ray_kwargs.ray_init.num_cpus`, else this machine's CPUs) or one GPU each. Joining a cluster (`ray_init.address`
    or RAY_ADDRESS, or one a `ray start` left running on this machine, which `ray.init` joins as well:
    `joining_address`) is checked when the pools are placed, against what that cluster holds."""
    kwargs = ray_init_kwargs(cfg)
    if joining_address(kwargs):
        return
    workers = plan.world + plan.rollout_devices + plan.reward_devices + plan.teacher_devices
    kind, have = (("CPU", int(kwargs.get("num_cpus") or os.cpu_count() or 1)) if device_type == "cpu"
                  else ("GPU", int(kwargs.get("num_gpus") or visible_gpus)))
    if workers <= have:
        return
    t, key = cfg.trainer, f"num_{kind.lower()}s"
    rollout = (f" + rollout.nnodes={cfg.rollout.nnodes} x rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node}"
               if plan.rollout_devices else "")
    rm = cfg.reward_model
    reward = (f" + reward_model.nnodes={rm.nnodes} x reward_model.n_gpus_per_node={rm.n_gpus_per_node}"
              if plan.reward_devices else "")
    d = cfg.distillation
    teacher = (f" + distillation.nnodes={d.nnodes} x distillation.n_gpus_per_node={d.n_gpus_per_node}"
               if plan.teacher_devices else "")
    lower = "".join(f" / {k}.n_gpus_per_node" for k, on in (("rollout", rollout), ("reward_model", reward),
                                                             ("distillation", teacher)) if on)
    source = f"ray_kwargs.ray_init.{key}={have}" if kwargs.get(key) else f"this machine's {kind}s"
    raise ClusterError(
        f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}{rollout}{reward}{teacher} = "
        f"{workers} workers, one {kind} each, but the Ray cluster lathe starts on this machine has {have} ({source}). Fix: lower "
        f"trainer.n_gpus_per_node / trainer.nnodes{lower}, or join a cluster that holds them (set RAY_ADDRESS or "
        "ray_kwargs.ray_init.address).")


class ResourcePool:
    """`nnodes` placement groups of `per_node` single-device bundles; `bundles()` in rank order. `key`: the config
    group whose nnodes / n_gpus_per_node the pool is (its error names them), else `name`."""

    def __init__(self, nnodes: int, per_node: int, *, use_gpu: bool, cpus_per_worker: float = 1,
                 timeout_s: float = 300, name: str = "trainer", key: str | None = None):
        ray = require_ray()
        from ray.util.placement_group import placement_group
        key = key or name
        self.nnodes, self.per_node, self.use_gpu, self.cpus_per_worker = nnodes, per_node, use_gpu, cpus_per_worker
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        self.groups = [placement_group([dict(bundle) for _ in range(per_node)], strategy="STRICT_PACK",
                                       name=f"lathe_{name}_node{i}") for i in range(nnodes)]
        ready, _ = ray.wait([pg.ready() for pg in self.groups], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:
            self.release()
            have = ray.available_resources()
            raise ClusterError(
                f"{key}.nnodes={nnodes} x {key}.n_gpus_per_node={per_node}: could not place {nnodes} node(s) of "
                f"{per_node} x {bundle} within {timeout_s:.0f} s; the cluster has "
                f"{_show(ray.cluster_resources())} in total and {_show(have)} free. Each node must hold "
                f"n_gpus_per_node {'GPUs' if use_gpu else 'CPU slots'}. Fix: lower {key}.n_gpus_per_node / nnodes, "
                f"or add nodes (ray start --address=... --num-gpus=...).")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.per_node

    def bundles(self):
        return [(pg, i) for pg in self.groups for i in range(self.per_node)]

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:      # noqa: BLE001 - already gone with the cluster
                pass
        self.groups = []


def _show(resources: dict) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
