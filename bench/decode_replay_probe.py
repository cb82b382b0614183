"""Probe: the host's time in the decode graph's replay() call (0.5B, decode_host's engine-alone load), with the
engine's programmatic dependent launch on (default) or off."""
import json, sys, time
import numpy as np
import torch
sys.path.insert(0, 'bench')
import decode_host
from lathe.engine import cuda_graph

orig, times = torch.cuda.CUDAGraph.replay, []


def replay(self):
    t = time.perf_counter()
    orig(self)
    times.append(time.perf_counter() - t)


torch.cuda.CUDAGraph.replay = replay
mode = sys.argv[1]
if mode == "nopdl":
    cuda_graph.pdl_available = lambda d: False
calls = decode_host.engine_alone(sys.argv[2] if len(sys.argv) > 2 else "0.5b")
a = np.array(times[-511:]) * 1e3
print("REPLAY", mode, json.dumps({"replay_ms": np.percentile(a, [10, 50, 90]).tolist(),
                                   "sections": calls[-1]["host_sections_ms"], "host_busy": calls[-1]["host_busy_ms"],
                                   "device_step_ms": calls[-1]["device_step_ms"], "wall_s": calls[-1]["wall_s"]}))
