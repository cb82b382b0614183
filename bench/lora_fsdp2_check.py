"""LoRA under FSDP2 on 2 NCCL ranks against one GPU process, bf16 on fp32 masters (a check, not a benchmark).

    PYTHONPATH=tests:$PYTHONPATH WORLD=2 python bench/lora_fsdp2_check.py

Uses `tests/cluster/test_lora_ray.py`'s worker and batches, without Ray: one process trains 2 steps and saves a
checkpoint, then 2 ranks (torch.multiprocessing, NCCL) train the same steps on their shares, sync the engines,
save, and both resume from each other's checkpoints. Reports (printed, and written to
`$OUT/lora_fsdp2_check.json`) the metrics side by side, the adapters' norm-relative difference, which tensors
changed, and each rank's engine weights against the merged `W + (alpha/r) B A`.
"""
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, "src")
sys.path.insert(0, "tests/cluster")
OUT = os.environ.get("OUT", "/tmp/out")
ROOT = "/tmp/gpucheck"


def cfg():
    from lathe.config import load_config
    from test_lora_ray import OVERRIDES
    over = [o for o in OVERRIDES if not o.startswith("trainer.device")] + [
        "trainer.device=cuda", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.model.target_modules=all-linear"]
    return load_config(None, over)


def make(device):
    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.hf import build_builtin_model
    from test_lora_ray import ProbedWorker
    tok = builtin_tokenizer()
    return ProbedWorker(cfg(), build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok, total_steps=10,
                        device=device, need_ref=True)


def share(batch, rank, world):
    from lathe.cluster.dispatch import update_shares
    return batch.select(update_shares(batch, world, mini_batch_size=4, balance=False)[rank])


def rank_main(rank, world, port):
    import torch.distributed as dist
    from pathlib import Path
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    w = make(dev)
    data = torch.load(f"{ROOT}/one.pt", weights_only=False)
    print(f"rank {rank}: policy {w.policy.describe()}; params", {str(p.dtype) + ('/train' if p.requires_grad else '')
                                                                for p in w.model.parameters()}, flush=True)
    res = {"start": w.full_weights(), "metrics": []}
    w.compute_log_prob(share(data["batches"][0], rank, world))     # a log-prob pass before the updates, as a step runs
    for b in data["batches"][:2]:
        res["metrics"].append(w.update_actor(share(b, rank, world)))
    w.sync_weights()
    res["weights"] = w.full_weights()
    res[f"engine{rank}"] = w.engine_weights()
    eng = [None] * world
    dist.all_gather_object(eng, {k: v.cpu() for k, v in res[f"engine{rank}"].items()})
    res["engines"] = eng
    w.save_checkpoint(Path(ROOT) / "two")
    res["third"] = w.update_actor(share(data["batches"][2], rank, world))
    w.load_checkpoint(Path(ROOT) / "one")
    res["third_from_one"] = w.update_actor(share(data["batches"][2], rank, world))
    if rank == 0:
        torch.save(res, f"{ROOT}/two.pt")
    dist.barrier()
    dist.destroy_process_group()


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main():
    from pathlib import Path
    from test_lora_ray import ppo_batch
    os.makedirs(ROOT, exist_ok=True)
    t0 = time.time()
    dev = torch.device("cuda", 0)
    one = make(dev)
    print("one:", one.policy.describe(), {str(p.dtype) for p in one.model.parameters()}, type(one.optimizer).__name__)
    batches = [ppo_batch(one, s).to("cpu") for s in (1, 2)]
    metrics = []
    for b in batches:
        metrics.append(one.update_actor(b))
    one.sync_weights()
    w_one = one.full_weights()
    one.save_checkpoint(Path(ROOT) / "one")
    b3 = ppo_batch(one, 3).to("cpu")
    third = one.update_actor(b3)
    torch.save({"batches": batches + [b3]}, f"{ROOT}/one.pt")
    del one
    torch.cuda.empty_cache()
    world = int(os.environ.get("WORLD", "2"))
    mp.spawn(rank_main, args=(world, 29533), nprocs=world, join=True)
    two = torch.load(f"{ROOT}/two.pt", weights_only=False)
    K = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
    report = {"bench": "lora_fsdp2_check", "device": f"{world}x {torch.cuda.get_device_name(0)}",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_sha": os.environ.get("LATHE_GIT_SHA"),
              "steps": {str(i + 1): {k: [a[k], b[k]] for k in K} for i, (a, b) in enumerate(zip(metrics, two["metrics"]))}}
    report["steps"]["3"] = {k: [third[k], two["third"][k], two["third_from_one"][k]] for k in K}
    ad = [k for k in w_one if k.endswith(("lora_A", "lora_B"))]
    report["adapters_rel_diff_one_vs_two_after_2_steps"] = rel(
        torch.cat([two["weights"][k].flatten().float() for k in ad]), torch.cat([w_one[k].flatten().float() for k in ad]))
    start, wt = two["start"], two["weights"]
    changed = [k for k in start if not torch.equal(start[k], wt[k])]
    report["changed_only_adapters"] = all(k.endswith(("lora_A", "lora_B")) for k in changed)
    report["changed_tensors"] = len(changed)
    paths = [k[:-7] for k in wt if k.endswith(".lora_A")]
    report["engine_max_rel_vs_merged"] = {
        f"rank{r}": max(rel(eng[f"{p}.weight"], wt[f"{p}.weight"].double() + 2.0 * wt[f"{p}.lora_B"].double().cpu()
                            @ wt[f"{p}.lora_A"].double().cpu()) for p in paths)
        for r, eng in enumerate(two["engines"])}
    restored = make(dev)
    restored.load_checkpoint(Path(ROOT) / "two")
    got = restored.update_actor(b3)
    report["one_process_resumed_from_two_ranks_step3"] = {k: [got[k], two["third"][k]] for k in K}
    report["checkpoint_files"] = sorted(os.listdir(Path(ROOT) / "two"))
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))
    Path(OUT).mkdir(parents=True, exist_ok=True)
    (Path(OUT) / "lora_fsdp2_check.json").write_text(json.dumps(report, indent=2))

if __name__ == "__main__":
    main()
